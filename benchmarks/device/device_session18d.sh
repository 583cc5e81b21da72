#!/usr/bin/env bash
# Session 18, fourth device run: issue 9's table on the session's final kernels (the packing without a barrier), as
# pairwise ratios, and issue 11's masked-prefill rows.
#   s18d_pairwise_{float32,bfloat16,float16}.txt   issue 9's four shapes, causal both, 1 thread (5 pairs) and
#                                                  16 threads (15 pairs)
#   s18d_masks.txt       bench_masks.py (4,12,1024,64), float32 and bfloat16, 16 and 1 threads
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
for dtype in float32 bfloat16 float16; do
  timeout 130 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 1 --causal both --pairs 5 \
    > "$OUT/s18d_pairwise_$dtype.txt" 2>&1
  timeout 60 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 16 --causal both --pairs 15 --min-time 0.02 \
    2>&1 | grep -E "^\||^#" | grep -v "^| shape\|^|---\|^# torch" >> "$OUT/s18d_pairwise_$dtype.txt"
  cat "$OUT/s18d_pairwise_$dtype.txt"
done
timeout 120 python3 benchmarks/bench_masks.py --threads 16,1 --markdown 2>&1 | tee "$OUT/s18d_masks.txt"
uptime
