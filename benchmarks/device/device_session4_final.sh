#!/usr/bin/env bash
# Session 4's closing run on the device host's CPU (16-core Xeon with AMX), on merged main: build; the CPU test
# suites under every ISA that CPU runs (the `isa` fixture forces amx, avx512_bf16, avx512, avx2, scalar in turn);
# the forward benchmark (bf16, fp16, fp32; the four shapes; causal both; 1 and 16 threads); the backward
# benchmark on 16 threads; decode with a padding mask. Each step has its own time limit; files land in $OUT.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session4_final.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/final_build.txt" 2>&1
tail -4 "$OUT/final_build.txt"
timeout ${TL_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_nonfinite.py \
  tests/test_attention.py tests/test_backward.py tests/test_masks.py tests/test_mask_decode.py tests/test_kvcache.py \
  tests/test_dropout.py -x > "$OUT/final_pytest_cpu.txt" 2>&1
tail -2 "$OUT/final_pytest_cpu.txt"; grep -E "^FAILED" "$OUT/final_pytest_cpu.txt" | head -10
timeout ${TL_FWD:-200} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
  --min-run-time ${MIN_RUN:-0.3} --json "$OUT/final_forward.json" > "$OUT/final_forward.txt" 2>&1
grep -E " flash " "$OUT/final_forward.txt"
for dtype in float32 bfloat16; do
  timeout ${TL_BWD:-50} python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --threads 16 --causal both --dtype $dtype --rounds 1 --min-run-time 0.1
done > "$OUT/final_backward_t16.txt" 2>&1
grep -E "bwd flash" "$OUT/final_backward_t16.txt"
timeout ${TL_DECODE:-40} python3 benchmarks/bench_decode.py --threads 16,1 --batches 4 --keys 1024,4096 \
  --dtypes float32,bfloat16 --seconds 0.15 --mask bool > "$OUT/final_decode_bool_mask.txt" 2>&1
tail -12 "$OUT/final_decode_bool_mask.txt"
