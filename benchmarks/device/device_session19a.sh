#!/usr/bin/env bash
# Session 19, first device run: what each kind of attn_mask costs the forward (benchmarks/probe_mask_cost.py), bf16 and
# float32, 1 and 16 threads; and issue 9's float32 one-thread cells as pairwise ratios with the FMA probe.
#   s19a_mask_cost.txt            probe_mask_cost.py (4,12,1024,64)
#   s19a_pairwise_float32_t1.txt  pairwise_ratio.py float32, 1 thread, causal both, 7 pairs
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
timeout 240 python3 benchmarks/probe_mask_cost.py --threads 1,16 --dtype bfloat16,float32 2>&1 | tee "$OUT/s19a_mask_cost.txt"
timeout 200 python3 benchmarks/pairwise_ratio.py --dtype float32 --threads 1 --causal both --pairs 7 2>&1 \
  | tee "$OUT/s19a_pairwise_float32_t1.txt"
uptime
