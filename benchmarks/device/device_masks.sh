#!/usr/bin/env bash
# One run on the device host's CPU (16-core Xeon with AMX), CPU only: build, the mask/window/dropout tests and the
# flash, backward and non-finite suites under every ISA the CPU runs (the `isa` fixture), then the masked-prefill
# benchmark (ours vs torch SDPA with the same mask, same run) for float32 and bfloat16 on 1 and 16 threads.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_masks.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu | head -20; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/build.txt" 2>&1
tail -4 "$OUT/build.txt"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_masks.py --shape ${SHAPE:-4,12,1024,64} --threads 1,16 \
  --dtype float32,bfloat16 --min-run-time ${MIN_RUN:-0.3} --markdown > "$OUT/bench_masks.txt" 2>&1
cat "$OUT/bench_masks.txt"
timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -p no:cacheprovider tests/test_masks.py tests/test_dropout.py \
  tests/test_real_models.py tests/test_flash.py tests/test_backward.py tests/test_nonfinite.py \
  > "$OUT/pytest_cpu.txt" 2>&1
tail -3 "$OUT/pytest_cpu.txt"; grep -E "^FAILED" "$OUT/pytest_cpu.txt" | head -20
