#!/usr/bin/env bash
# Session 12, first device run: decode tasks on a static schedule (the same part of the cache on the same thread every
# call) against the previous commit (.gpu_stage/base), in alternating processes; then the decode tests under amx.
#   ab_s12a_decode.txt   bench_decode.py, 16 threads, batch 1 and 8, 1024/4096/8192 keys, float32 and bf16, 3 rounds
#   ab_s12a_generate.txt bench_generate.py, shipped GPT, 16 threads, contexts 1024/2048, 2 rounds
#   s12a_pytest.txt      test_kvcache, test_mask_decode under amx
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
nproc; uptime
TAG=s12a_decode ROUNDS=3 TL=120 CMD="benchmarks/bench_decode.py --threads 16 --batches 1,8 --keys 1024,4096,8192 --dtypes float32,bfloat16 --seconds 0.3" \
  KEEP="^\| [a-z]|probe" ARGS="" bash benchmarks/device/device_ab.sh > /dev/null 2>&1
cat "$OUT/ab_s12a_decode.txt" | head -80
uptime
TAG=s12a_generate ROUNDS=2 TL=150 CMD="benchmarks/bench_generate.py --threads 16 --contexts 1024,2048 --repeats 3" \
  KEEP="^\\||context" ARGS="" bash benchmarks/device/device_ab.sh > /dev/null 2>&1
cat "$OUT/ab_s12a_generate.txt" | head -60
PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py tests/test_mask_decode.py \
  -k "amx and not emulated" > "$OUT/s12a_pytest.txt" 2>&1
tail -2 "$OUT/s12a_pytest.txt"; grep -E "^FAILED" "$OUT/s12a_pytest.txt" | head -10
uptime
