#!/usr/bin/env bash
# The short form of device_backward.sh, for a device budget of a few minutes: build, the bf16 and thread-count
# backward tests on amx, attention's backward memory, the backward benchmark on 16 threads (float32, bf16; the four
# shapes), the training step on 16 threads, two shapes on 1 thread. Each step has its own time limit (TL_* seconds);
# files land in $OUT as they are written.
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -2
timeout ${TL_TESTS:-50} python3 -m pytest -q -p no:cacheprovider tests/test_backward.py \
  -k "${TEST_FILTER:-amx and (bfloat16 or bf16 or thread_count or fully) and not compile}" \
  > "$OUT/pytest_backward_amx.txt" 2>&1
tail -2 "$OUT/pytest_backward_amx.txt"; grep -E "^FAILED" "$OUT/pytest_backward_amx.txt" | head
timeout 40 python3 benchmarks/bench_train.py --no-train --memory --memory-threads 16 > "$OUT/train_memory.txt" 2>&1
for dtype in float32 bfloat16; do
  timeout ${TL_BWD16:-45} python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --threads 16 --causal both --dtype $dtype --rounds ${ROUNDS:-1} --min-run-time ${MIN_RUN:-0.1} \
    > "$OUT/backward_t16_$dtype.txt" 2>&1
done
timeout 45 python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast --threads 16 \
  --steps 3 --warmup 1 > "$OUT/train_t16.txt" 2>&1
for dtype in float32 bfloat16; do
  timeout ${TL_BWD1:-25} python3 benchmarks/bench_backward.py --shapes ${SHAPES1:-1,12,1024,64} --threads 1 \
    --causal both --dtype $dtype --rounds ${ROUNDS:-1} --min-run-time ${MIN_RUN:-0.1} > "$OUT/backward_t1_$dtype.txt" 2>&1
done
