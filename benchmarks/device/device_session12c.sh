#!/usr/bin/env bash
# Session 12: the bf16/fp16 forward's S and P rows a cache line longer (tile rows spread over L1's sets) against the
# previous commit (.gpu_stage/base), in alternating processes; then the bf16/fp16 forward's tests under amx.
#   ab_s12c_forward.txt  bench_attention.py --impls flash, the four shapes, causal both, bf16 and fp16,
#                        1 and 16 threads, two rounds per tree
#   s12c_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout under amx
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export CS149GPT_NO_CUDA=1
uptime
TAG=s12c_forward ROUNDS=2 TL=200 MIN_RUN=0.15 \
  ARGS="--shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 --threads 1,16 --causal both --dtype bfloat16,float16" \
  bash benchmarks/device/device_ab.sh > /dev/null 2>&1
awk '/^==/{print; next} $5=="flash"{print $1, $2, $3, $4, $6, $8}' "$OUT/ab_s12c_forward.txt"
uptime
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_masks.py \
  tests/test_nonfinite.py tests/test_dropout.py -k "amx and not emulated" > "$OUT/s12c_pytest.txt" 2>&1
tail -2 "$OUT/s12c_pytest.txt"; grep -E "^FAILED" "$OUT/s12c_pytest.txt" | head -10
