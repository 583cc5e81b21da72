#!/usr/bin/env bash
# Session 15, second device run: the backward's path for few kv heads (Gemma-2B: 8 query heads, 1 kv head, d = 256),
# where module.cpp chose two passes on this 16-CPU host (too few (batch, kv head) tasks) and bf16 ran at 0.30x SDPA
# on one thread (s15a_sweep_backward.txt).
#   s15b_backward_paths_{bf16,f32}.txt   probe_backward_tasks.py: auto, two passes, one pass with 4 / 8 key runs
source benchmarks/device/preamble.sh
for dt in bfloat16 float32; do
  tag=$([ $dt = float32 ] && echo f32 || echo bf16)
  timeout 200 python3 benchmarks/probe_backward_tasks.py --shapes 1,8/1,1024,256 1,16/2,2048,128 --dtype $dt \
    --threads 1,16 --causal yes --rounds 3 --variants auto,two_pass,chunks_4,chunks_8,chunks_8_bk128 \
    > "$OUT/s15b_backward_paths_$tag.txt" 2>&1
  grep "^|" "$OUT/s15b_backward_paths_$tag.txt" | cut -d'|' -f2-8
  uptime
done
