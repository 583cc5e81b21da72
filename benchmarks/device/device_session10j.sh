#!/usr/bin/env bash
# Session 10: the bf16 backward's tiles at d = 128 on amx (default 64 x 256) against longer ones, (1,16,4096,128),
# 1 and 16 threads, causal both, two interleaved rounds.
#   s10j_bwd_tiles_d128_t1.txt, s10j_bwd_tiles_d128_t16.txt
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
for threads in 16 1; do
  timeout 200 python3 benchmarks/bench_backward_tiles.py --shapes 1,16,4096,128 1,8,2048,128 \
    --tiles 64x256 128x256 64x512 128x512 --threads $threads --causal both --dtype bfloat16 --rounds 2 \
    --min-run-time 0.2 > "$OUT/s10j_bwd_tiles_d128_t$threads.txt" 2>&1
  grep -vE "^#|^$" "$OUT/s10j_bwd_tiles_d128_t$threads.txt" | tail -8
done
