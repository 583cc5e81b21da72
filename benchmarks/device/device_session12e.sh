#!/usr/bin/env bash
# Session 12, last device run: issue 9's bf16 forward table on the final kernels (S and P rows padded).
#   s12e_forward_bf16.txt  bench_attention.py --impls flash, the four shapes, causal both, 1 and 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
uptime
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 200 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype bfloat16 --min-run-time 0.15 --rounds 2 2>&1 \
  | tee "$OUT/s12e_forward_bf16.txt" | grep -E "^[0-9].* flash |peak"
uptime
