#!/usr/bin/env bash
# One run on the device host's CPU (16-core Xeon with AMX): build, the flash/attention/non-finite tests under
# every ISA that CPU runs (the `isa` fixture forces amx, avx512_bf16, avx512, avx2, scalar in turn), then the
# forward benchmark for bf16, fp16 and fp32 on 1 and 16 threads. Everything lands in $OUT.
#   run: bash benchmarks/device/device_cpu.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD
{ lscpu; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -3
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_nonfinite.py tests/test_attention.py \
    tests/test_backward.py > "$OUT/pytest_cpu.txt" 2>&1
  tail -3 "$OUT/pytest_cpu.txt"; grep -E "^FAILED" "$OUT/pytest_cpu.txt" | head -20
fi
python3 benchmarks/bench_attention.py --shapes ${SHAPES:-1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128} \
  --impls flash --causal both --dtype ${DTYPES:-bfloat16,float16,float32} --threads ${THREADS:-1,16} \
  --min-run-time ${MIN_RUN:-0.3} --json "$OUT/forward.json" > "$OUT/forward.txt" 2>&1
grep -E "sdpa|flash|peak" "$OUT/forward.txt" | head -80
