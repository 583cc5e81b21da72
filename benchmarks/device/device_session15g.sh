#!/usr/bin/env bash
# Session 15, seventh device run: the bf16 forward's candidate default tiles against today's, more rounds (s15f's
# single rounds moved ±10 %: its 1024- and 2048-key columns at N = 1024 are the same tile and differed that much).
#   s15g_tiles_t{1,16}{,_causal}.txt   tile_sweep.py, issue 9's four shapes: today's default (none x 512) against
#                                      192 x 1024, 256 x 1024, 256 x 2048 (query x key tiles)
source benchmarks/device/preamble.sh
for t in 1 16; do
  for c in "" "--causal"; do
    f="$OUT/s15g_tiles_t$t${c:+_causal}.txt"
    timeout 170 python3 benchmarks/tile_sweep.py --dtype bfloat16 --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
      1,16,4096,128 --block-q none,192,256 --block-k 512,1024,2048 --threads $t $c --repeats 3 --rounds 4 --all > "$f" 2>&1
    grep -E "^[0-9]|block_q    -  *block_k   512|block_q  192 block_k  1024|block_q  256 block_k  1024|block_q  256 block_k  2048" "$f"
  done
done
uptime
