#!/usr/bin/env bash
# Session 6 (16-core Xeon): why the float32 forward reaches ~52 % of the FMA peak on one thread there (78–83 % on the
# dev box's Zen 5): every tile size, key tiles whose row stride is not a power of two among them (cache-set and
# 4K-aliasing effects), and flush-to-zero off/on (microcode assists on subnormals).
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session6_f32probe.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())"
timeout 60 python3 benchmarks/probe_f32_denormal.py --shapes 1,12,1024,64 1,4,2048,128 2>&1 | tee "$OUT/s6p_denormal.txt"
timeout 200 python3 benchmarks/tile_sweep.py --shapes 1,12,1024,64 1,4,2048,128 --threads 1 --all --repeats 4 \
  --block-q 24,48,96,192 --block-k 64,128,240,256,272,496,512,528,1024 2>&1 | tee "$OUT/s6p_sweep_f32_t1.txt"
CS149GPT_ISA=avx512 timeout 40 python3 benchmarks/tile_sweep.py --shapes 1,12,1024,64 --threads 1 --all --repeats 4 \
  --block-q 96 --block-k 256,512 2>&1 | tee "$OUT/s6p_sweep_f32_t1_isa_avx512.txt"
