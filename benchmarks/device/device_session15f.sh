#!/usr/bin/env bash
# Session 15, sixth device run: the bf16 forward's key tile past 512 (s15e: 1024 keys ran ~6 % faster at
# (1,12,1024,64) on 16 threads; the session-10 sweep stopped at 512), at issue 9's four shapes, 1 and 16 threads,
# causal both; query tiles as the kernel chooses and 256.
#   s15f_sweep_bk_t{1,16}{,_causal}.txt   tile_sweep.py --dtype bfloat16 --block-k 512,1024,2048
source benchmarks/device/preamble.sh
for t in 1 16; do
  for c in "" "--causal"; do
    f="$OUT/s15f_sweep_bk_t$t${c:+_causal}.txt"
    timeout 140 python3 benchmarks/tile_sweep.py --dtype bfloat16 --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
      1,16,4096,128 --block-q none,256 --block-k 512,1024,2048 --threads $t $c --repeats 3 --rounds 2 --all > "$f" 2>&1
    grep -E "^[0-9]|block_q    -" "$f"
  done
done
uptime
