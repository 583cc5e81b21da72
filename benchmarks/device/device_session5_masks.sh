#!/usr/bin/env bash
# Session 5's second device run (16-core Xeon with AMX): build; the mask / fast-path / KV-cache tests under every
# ISA; masked prefill against SDPA (the mask block prefetch); per-call cost with and without a padding mask (masks
# now taken in C++); the shipped GPT's decoding at 16 threads, profiled and timed.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session5_masks.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); print('isa', m.isa())"; } \
  > "$OUT/s5m_build.txt" 2>&1
tail -4 "$OUT/s5m_build.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_masks.py tests/test_mask_decode.py \
  tests/test_fast_path.py tests/test_kvcache.py -x > "$OUT/s5m_pytest.txt" 2>&1
tail -2 "$OUT/s5m_pytest.txt"; grep -E "^FAILED" "$OUT/s5m_pytest.txt" | head
timeout 120 python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 \
  > "$OUT/s5m_bench_masks.txt" 2>&1
grep -E "^\|" "$OUT/s5m_bench_masks.txt"
for t in 1 16; do timeout 40 python3 benchmarks/bench_overhead.py --threads $t --calls 3000; done \
  > "$OUT/s5m_overhead.txt" 2>&1
grep -E "^\||^cs149" "$OUT/s5m_overhead.txt"
timeout 60 python3 benchmarks/profile_decode_step.py --context 1024 --threads 16 --steps 32 2>&1 \
  | grep -v -i warn > "$OUT/s5m_profile_decode_shakes1024_t16.txt"
grep -E "^## " "$OUT/s5m_profile_decode_shakes1024_t16.txt"
timeout 90 python3 benchmarks/bench_generate.py --contexts 1024,2048 --threads 16,1 --impls flash --repeats 5 \
  > "$OUT/s5m_generate_shipped.txt" 2>&1
grep -E "tok/s" "$OUT/s5m_generate_shipped.txt"
