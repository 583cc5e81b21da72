#!/usr/bin/env bash
# Session 5's closing run, part A (16-core Xeon with AMX), on merged main: build; the CPU test suites under every
# ISA the CPU runs (the `isa` fixture forces amx, avx512_bf16, avx512, avx2, scalar in turn); the forward benchmark
# (bf16, fp16, fp32; the four shapes; causal both; 1 and 16 threads).
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session5_final_a.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/s5f_build.txt" 2>&1
tail -4 "$OUT/s5f_build.txt"
timeout ${TL_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_nonfinite.py \
  tests/test_attention.py tests/test_backward.py tests/test_masks.py tests/test_mask_decode.py tests/test_kvcache.py \
  tests/test_dropout.py tests/test_fast_path.py -x > "$OUT/s5f_pytest_cpu.txt" 2>&1
tail -2 "$OUT/s5f_pytest_cpu.txt"; grep -E "^FAILED" "$OUT/s5f_pytest_cpu.txt" | head -10
timeout ${TL_FWD:-250} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
  --min-run-time ${MIN_RUN:-0.3} --json "$OUT/s5f_forward.json" > "$OUT/s5f_forward.txt" 2>&1
grep -E " flash " "$OUT/s5f_forward.txt"
