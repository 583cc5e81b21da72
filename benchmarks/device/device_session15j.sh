#!/usr/bin/env bash
# Session 15, tenth device run: do taller query tiles and longer key tiles help the float32 FMA forward as they did
# the bf16 one (s15g)? Issue 9's float32 one-thread cells are 1.07-1.18x where 1.2x is asked.
#   s15j_tiles_f32_t{1,16}.txt   tile_sweep.py float32, issue 9's shapes, block_q 96 (default)/192/384 x block_k 512/1024
source benchmarks/device/preamble.sh
for t in 1 16; do
  timeout 200 python3 benchmarks/tile_sweep.py --dtype float32 --shapes 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
    --block-q none,192,384 --block-k 512,1024 --threads $t --repeats 3 --rounds 3 --all > "$OUT/s15j_tiles_f32_t$t.txt" 2>&1
  grep -E "^[0-9]|block_k" "$OUT/s15j_tiles_f32_t$t.txt"
done
uptime
