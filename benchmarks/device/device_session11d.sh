#!/usr/bin/env bash
# Session 11, fourth device run: A/B of the bf16 backward's packing and write-out in vectors (transpose_bf16,
# store_scaled_bf16, store_transposed_scaled_bf16) against the commit before it (.gpu_stage/base), then the bf16
# backward's tests on the AMX hardware.
#   ab_s11d_backward.txt   bench_backward.py, bf16, 2 rounds per tree
#   ab_s11d_train.txt      bench_train.py, autocast, 16 threads, 2 rounds per tree
#   s11d_pytest.txt        test_backward and test_nonfinite under amx
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
export CS149GPT_NO_CUDA=1
CMD="benchmarks/bench_backward.py --rounds 1 --min-run-time 0.2 --dtype bfloat16" KEEP="bwd" TAG=s11d_backward \
  ROUNDS=2 TL=80 ARGS="--shapes 16,6,256,64 1,4,1024,32 1,12,1024,64 --threads 1,16 --causal both" \
  bash benchmarks/device/device_ab.sh > /dev/null
grep -E "round|flash" $OUT/ab_s11d_backward.txt | grep -v "fwd+bwd" | grep -v "^|" | head -60
CMD="benchmarks/bench_train.py --configs nano256,shipped --precisions autocast --threads 16 --steps 8" KEEP="^train" \
  TAG=s11d_train ROUNDS=2 TL=100 ARGS="" bash benchmarks/device/device_ab.sh
PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py tests/test_nonfinite.py \
  -k "amx and not emulated" > "$OUT/s11d_pytest.txt" 2>&1
tail -2 "$OUT/s11d_pytest.txt"; grep -E "^FAILED" "$OUT/s11d_pytest.txt" | head
