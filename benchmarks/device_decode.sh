#!/usr/bin/env bash
# One run on the device host's CPU for decoding (issue 10): build, the KV-cache and flash tests under every ISA that
# CPU runs, then the decode benchmark (1 and 16 threads, float32 and bf16, batch 1 and 8) and the per-call overhead;
# with GENERATE=1 also bench_generate's Llama-shaped config. Everything lands in $OUT.
#   run: bash benchmarks/device_decode.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
{ lscpu; free -g; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -3
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py tests/test_model.py \
    ${TESTS:-tests/test_flash.py} > "$OUT/pytest_decode.txt" 2>&1
  tail -3 "$OUT/pytest_decode.txt"; grep -E "^FAILED|Error" "$OUT/pytest_decode.txt" | head -20
fi
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_decode.py --threads ${THREADS:-1,16} \
  --seconds ${SECONDS_PER_SHAPE:-0.3} ${EXTRA_ISA:+--extra-isa $EXTRA_ISA} 2>&1 | tee "$OUT/decode.txt"
timeout 60 python3 benchmarks/bench_overhead.py --calls 3000 2>&1 | tee "$OUT/overhead.txt"
if [ -n "${GENERATE:-}" ]; then
  timeout ${GENERATE_TIMEOUT:-200} python3 benchmarks/bench_generate.py --llama --contexts ${LLAMA_CONTEXTS:-1024,4096} \
    --threads 16 --impls flash --decode 16 --repeats 3 2>&1 | tee "$OUT/generate_llama.txt"
  timeout ${GENERATE_TIMEOUT:-200} python3 benchmarks/bench_generate.py --contexts 1024,2048 --threads 1,16 \
    --impls flash --repeats 3 2>&1 | tee "$OUT/generate_shipped.txt"
fi
