#!/usr/bin/env bash
# Session 13, fourth device run: issue 12's backward table, and where a one-thread decode token goes (issue 10).
#   s13d_backward_f32.txt   bench_backward.py --memory: float32, issue 12's four shapes, causal both, 1 and 16 threads
#   s13d_backward_bf16.txt  the same in bf16
#   s13d_profile_t1_*.txt   profile_decode_step.py: the shipped GPT, one thread, contexts 1024 and 2048
source benchmarks/device/preamble.sh
for ctx in 1024 2048; do
  timeout 60 python3 benchmarks/profile_decode_step.py --context $ctx --threads 1 --steps 32 > "$OUT/s13d_profile_t1_$ctx.txt" 2>&1
  grep -E "^## |flash_decode|scaled_dot|attention_with" "$OUT/s13d_profile_t1_$ctx.txt" | cut -c1-110
done
uptime
for dt in float32 bfloat16; do
  tag=$([ $dt = float32 ] && echo f32 || echo bf16)
  timeout 200 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
    --threads 1,16 --causal both --dtype $dt --min-run-time 0.1 --rounds 2 --memory > "$OUT/s13d_backward_$tag.txt" 2>&1
  grep -E "peak|^\| .* \| (bwd|fwd\+bwd) \| " "$OUT/s13d_backward_$tag.txt" | cut -c1-130
  uptime
done
