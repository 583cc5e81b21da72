#!/usr/bin/env bash
# One run on the device host's CPU (16-core Xeon with AMX), CPU only, for masked decoding on the decode kernel
# (issue 11): build; Hugging Face Llama's whole-model padded prefill and generate, ours vs torch SDPA (bench_models.py,
# float32 and bfloat16, 16 and 1 threads); masked prefill attention (bench_masks.py, float32 and bfloat16, 16 and 1
# threads); the decode kernel with a key-padding mask against SDPA with the same mask (bench_decode.py --mask bool);
# then the masked-decode, KV-cache and real-model tests. Each step has its own time limit, so a slow one leaves the
# others' results. Outputs: $OUT/${PREFIX}_*.txt.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_mask_decode.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
P=${PREFIX:-masks_session4}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu | head -20; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)"; } > "$OUT/${P}_machine.txt" 2>&1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/${P}_build.txt" 2>&1
tail -4 "$OUT/${P}_build.txt"
for dt in float32 bfloat16; do
  timeout ${MODELS_TIMEOUT:-75} python3 benchmarks/bench_models.py --models llama --threads 16,1 --dtype $dt \
    --batch 4 --seq 512 --new-tokens 16 --repeats 3
done 2>&1 | tee "$OUT/${P}_models.txt"
timeout ${MASKS_TIMEOUT:-110} python3 benchmarks/bench_masks.py --shape 4,12,1024,64 --threads 16,1 \
  --dtype float32,bfloat16 --min-run-time ${MIN_RUN:-0.2} --markdown 2>&1 | tee "$OUT/${P}_bench_masks.txt"
timeout ${DECODE_TIMEOUT:-35} python3 benchmarks/bench_decode.py --threads 16,1 --batches 4 --keys 1024,4096 \
  --dtypes float32,bfloat16 --seconds 0.15 --mask bool 2>&1 | tee "$OUT/${P}_decode_bool_mask.txt"
timeout ${TEST_TIMEOUT:-80} python3 -m pytest -q -p no:cacheprovider tests/test_mask_decode.py \
  tests/test_real_models.py -k "not training and not compile" > "$OUT/${P}_pytest.txt" 2>&1
tail -3 "$OUT/${P}_pytest.txt"; grep -E "^FAILED" "$OUT/${P}_pytest.txt" | head -20
