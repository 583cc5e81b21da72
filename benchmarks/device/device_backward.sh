#!/usr/bin/env bash
# One run on the device host's CPU for the backward (issue 12): build, the backward tests under every ISA that CPU
# runs (amx included), attention's peak backward memory and the training step (bench_train.py), then the backward
# benchmark (fwd, bwd, fwd+bwd vs SDPA) in float32 and bf16 on 16 and 1 threads. Everything lands in $OUT, each
# file written as it goes, so a run cut short still brings back what it measured.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_backward.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu | head -20; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -3
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_backward.py \
    tests/test_nonfinite.py -k "${TEST_FILTER:-not compile}" > "$OUT/pytest_backward.txt" 2>&1
  tail -3 "$OUT/pytest_backward.txt"; grep -E "^FAILED" "$OUT/pytest_backward.txt" | head -20
fi
timeout 90 python3 benchmarks/bench_train.py --no-train --memory --memory-threads 16 > "$OUT/train_memory.txt" 2>&1
cat "$OUT/train_memory.txt"
for dtype in ${DTYPES:-float32 bfloat16}; do
  python3 benchmarks/bench_backward.py --shapes ${SHAPES16:-1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128} \
    --threads 16 --causal both --dtype $dtype --rounds ${ROUNDS:-1} --min-run-time ${MIN_RUN:-0.2} \
    --json "$OUT/backward_t16_$dtype.json" > "$OUT/backward_t16_$dtype.txt" 2>&1
  grep -E " bwd | fwd\+bwd " "$OUT/backward_t16_$dtype.txt" | grep flash
done
timeout 120 python3 benchmarks/bench_train.py --configs ${TRAIN_CONFIGS:-shipped,nano256,nano512} --threads 16 \
  --steps 4 --warmup 2 > "$OUT/train_t16.txt" 2>&1
cat "$OUT/train_t16.txt"
for dtype in ${DTYPES:-float32 bfloat16}; do
  python3 benchmarks/bench_backward.py --shapes ${SHAPES1:-1,4,1024,32 1,12,1024,64 4,12,2048,64} \
    --threads 1 --causal both --dtype $dtype --rounds ${ROUNDS:-1} --min-run-time ${MIN_RUN:-0.2} \
    --json "$OUT/backward_t1_$dtype.json" > "$OUT/backward_t1_$dtype.txt" 2>&1
  grep -E " bwd | fwd\+bwd " "$OUT/backward_t1_$dtype.txt" | grep flash
done
timeout 60 python3 benchmarks/bench_train.py --configs shipped --threads 1 --steps 3 --warmup 1 > "$OUT/train_t1.txt" 2>&1
cat "$OUT/train_t1.txt"
