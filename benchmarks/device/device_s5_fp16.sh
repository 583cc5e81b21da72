#!/usr/bin/env bash
# Issue 9, float16 on AMX in two bf16 parts (flash_bf16.cpp): on the device host's CPU (16-core Xeon with AMX-BF16,
# no AMX-FP16): build; the float16 forward benchmark (the four shapes, causal both, 1 and 16 threads; ours
# vs torch's float16 SDPA, same run); the flash/mask/dropout/non-finite tests under every ISA the CPU runs (the
# `isa` fixture forces amx, avx512_bf16, avx512, avx2, scalar in turn); with SWEEP=1 also a one-thread tile sweep of
# float16 and bfloat16. Files land in $OUT as s5_fp16_<tag>_*.
#   run: CS149GPT_NO_CUDA=1 TAG=run1 bash benchmarks/device/device_s5_fp16.sh
#        CS149GPT_NO_CUDA=1 TAG=run2 ROUNDS=3 MIN_RUN=0.25 SWEEP=1 bash benchmarks/device/device_s5_fp16.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
TAG=${TAG:-run1}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/s5_fp16_${TAG}_build.txt" 2>&1
tail -4 "$OUT/s5_fp16_${TAG}_build.txt"
timeout ${TL_FWD:-140} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --impls flash --causal both --dtype float16 --threads 1,16 --rounds ${ROUNDS:-1} \
  --min-run-time ${MIN_RUN:-0.1} --json "$OUT/s5_fp16_${TAG}_forward.json" > "$OUT/s5_fp16_${TAG}_forward.txt" 2>&1
grep -E " flash |peak" "$OUT/s5_fp16_${TAG}_forward.txt"
if [ "${SWEEP:-0}" = 1 ]; then  # tile sizes on one thread, float16 (split) and bfloat16: best of 3 calls each
  for dtype in float16 bfloat16; do
    timeout ${TL_SWEEP:-60} python3 benchmarks/tile_sweep.py --dtype $dtype --threads 1 --repeats 3 \
      --shapes 1,4,4096,128 1,4,1024,128 1,12,1024,64 --block-q 128,256 --block-k 128,256,512
  done > "$OUT/s5_fp16_${TAG}_tile_sweep_t1.txt" 2>&1
  cat "$OUT/s5_fp16_${TAG}_tile_sweep_t1.txt"
fi
timeout ${TL_TESTS:-170} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_masks.py \
  tests/test_dropout.py tests/test_nonfinite.py > "$OUT/s5_fp16_${TAG}_pytest.txt" 2>&1
echo "pytest rc=$?"
tail -2 "$OUT/s5_fp16_${TAG}_pytest.txt"; grep -E "^FAILED|^ERROR|Fatal|Segmentation" "$OUT/s5_fp16_${TAG}_pytest.txt" | head -20
