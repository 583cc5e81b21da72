#!/usr/bin/env bash
# Session 19, third device run: does a batch-shared bias's tile get read from cache by the next batch element's task?
# probe_mask_cost.py, bf16, ALiBi and T5-style biases shared by the batch (1,H,N,N) against one copy per batch element
# (B,H,N,N), batch 1 and 4, 1 and 16 threads.
#   s19c_mask_reuse.txt
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo
for shape in 4,12,1024,64 1,12,1024,64; do
  timeout 200 python3 benchmarks/probe_mask_cost.py --shape $shape --threads 1,16 --dtype bfloat16 --min-time 0.3 \
    --cases "no mask,alibi f32 (,t5" 2>&1
done | tee "$OUT/s19c_mask_reuse.txt"
uptime
