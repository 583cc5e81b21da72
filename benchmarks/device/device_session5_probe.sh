#!/usr/bin/env bash
# Session 5's first device run (16-core Xeon with AMX): build; the KV-cache tests (the decode kernel's serial /
# parallel choice changed); decode at 128 and 1024 keys (Llama heads); the whole-model prefill probe (why bf16 on
# one thread was slower with the faster attention); the whole-model benchmark, bf16 and float32.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session5_probe.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); print('isa', m.isa())"; } \
  > "$OUT/s5_build.txt" 2>&1
tail -4 "$OUT/s5_build.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py -x > "$OUT/s5_pytest_kvcache.txt" 2>&1
tail -2 "$OUT/s5_pytest_kvcache.txt"
timeout 60 python3 benchmarks/bench_decode.py --threads 16,1 --batches 1 --keys 128,128,1024 \
  --dtypes float32,bfloat16 --seconds 0.2 > "$OUT/s5_decode_128.txt" 2>&1
grep -E "^\|" "$OUT/s5_decode_128.txt" | tail -14
timeout 150 python3 benchmarks/probe_prefill_gap.py --dtype bfloat16 --threads 1 --rounds 7 2>&1 \
  | grep -v -E "USDT|Warn|warn" > "$OUT/s5_probe_prefill_bf16_t1.txt"
cat "$OUT/s5_probe_prefill_bf16_t1.txt"
for dtype in bfloat16 float32; do
  timeout 100 python3 benchmarks/bench_models.py --dtype $dtype --threads 1,16 --models llama --repeats 5
done > "$OUT/s5_models.txt" 2>&1
grep -E "^\||^#" "$OUT/s5_models.txt"
