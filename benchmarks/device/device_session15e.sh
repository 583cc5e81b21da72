#!/usr/bin/env bash
# Session 15, fifth device run: the bf16 forward's tiles at issue 9's two cells under 1.5x, swept again on today's
# kernel (the last sweep at head_dim 128 predates the S rows off one L1 set, session 12).
#   s15e_sweep_d128_t{1,16}.txt   tile_sweep.py bf16 (1,16,4096,128), block_q 64-256 x block_k 128-512
#   s15e_sweep_d64_t16.txt        tile_sweep.py bf16 (1,12,1024,64), 16 threads
source benchmarks/device/preamble.sh
for t in 1 16; do
  timeout 150 python3 benchmarks/tile_sweep.py --dtype bfloat16 --shapes 1,16,4096,128 --block-q none,64,128,256 \
    --block-k 128,256,512 --threads $t --repeats 3 --rounds 2 --all > "$OUT/s15e_sweep_d128_t$t.txt" 2>&1
  tail -14 "$OUT/s15e_sweep_d128_t$t.txt"
done
timeout 100 python3 benchmarks/tile_sweep.py --dtype bfloat16 --shapes 1,12,1024,64 --block-q none,64,128,192 \
  --block-k 256,512,1024 --threads 16 --repeats 5 --rounds 3 --all > "$OUT/s15e_sweep_d64_t16.txt" 2>&1
tail -14 "$OUT/s15e_sweep_d64_t16.txt"
uptime
