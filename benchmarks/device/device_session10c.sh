#!/usr/bin/env bash
# Session 10, third run on the device host: bf16/fp16 (amx) key tiles of 256 against 512 at head_dim <= 64 — issue 9's
# shapes, 1 and 16 threads, causal and not, in interleaved rounds (tile_sweep.py --rounds); s10b's one-thread sweep
# had 512 ahead at (1,12,1024,64).
#   s10c_sweep_<dtype>_t<threads>[_causal].txt
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
for dtype in bfloat16 float16; do
  for threads in 1 16; do
    for causal in "" "--causal"; do
      timeout 100 python3 benchmarks/tile_sweep.py --threads $threads --rounds 3 --repeats 3 --all --dtype $dtype \
        --block-q none --block-k 256,512 --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 $causal 2>&1 \
        | tee "$OUT/s10c_sweep_${dtype}_t${threads}${causal:+_causal}.txt"
    done
  done
done
