#!/usr/bin/env bash
# Session 12: a cache line more per row of the bf16 forward's S and P and of the bf16 backward's dQᵀ (tile rows spread
# over L1's sets) against the previous commit (.gpu_stage/base), alternating processes; then the amx tests.
#   ab_s12d_forward.txt   bench_attention.py --impls flash, bf16, one thread, (1,12,1024,64) (4,12,2048,64)
#                         (1,16,4096,128), causal both, three rounds per tree
#   ab_s12d_backward.txt  bench_backward.py, bf16, (1,12,1024,64) (1,8,2048,128), causal both, 1 and 16 threads,
#                         two rounds per tree
#   s12d_pytest.txt       test_backward, test_flash, test_masks, test_dropout under amx
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export CS149GPT_NO_CUDA=1
uptime
TAG=s12d_forward ROUNDS=3 TL=150 MIN_RUN=0.15 \
  ARGS="--shapes 1,12,1024,64 4,12,2048,64 1,16,4096,128 --threads 1 --causal both --dtype bfloat16" \
  bash benchmarks/device/device_ab.sh > /dev/null 2>&1
awk '/^==/{print; next} $5=="flash"{print $1, $2, $3, $4, $6, $8}' "$OUT/ab_s12d_forward.txt"
uptime
TAG=s12d_backward ROUNDS=2 TL=200 KEEP="^\| [0-9]" \
  CMD="benchmarks/bench_backward.py --shapes 1,12,1024,64 1,8,2048,128 --threads 1,16 --causal both --dtype bfloat16 --rounds 1 --min-run-time 0.2" \
  ARGS="" bash benchmarks/device/device_ab.sh > /dev/null 2>&1
awk -F'|' '/^==/{print; next} $7 ~ /flash/ {print $2, $3, $5, $6, $8, $10}' "$OUT/ab_s12d_backward.txt"
uptime
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_flash.py \
  tests/test_masks.py tests/test_dropout.py -k "amx and not emulated" > "$OUT/s12d_pytest.txt" 2>&1
tail -2 "$OUT/s12d_pytest.txt"; grep -E "^FAILED" "$OUT/s12d_pytest.txt" | head -10
exit 0
