#!/usr/bin/env bash
# Session 10, second run on the device host: how close the software tiles are to the hardware's, and one-thread tile
# sweeps interleaved in rounds (tile_sweep.py --rounds) at the shapes where one thread misses issue 9's marks.
#   s10b_emulation.txt   probe_amx_emulation.py: amx against amx_emulated, bits that differ
#   s10b_sweep_f32.txt   float32, 1 thread, block_q 96/192/384 x block_k 256/512, 3 rounds
#   s10b_sweep_bf16.txt  bfloat16 (amx), 1 thread, block_q 64/128/256 x block_k 128/256/512, 3 rounds
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 120 python3 benchmarks/probe_amx_emulation.py 2>&1 | tee "$OUT/s10b_emulation.txt"
timeout 200 python3 benchmarks/tile_sweep.py --threads 1 --rounds 3 --repeats 2 --all --block-q 96,192,384 \
  --block-k 256,512 --shapes 1,16,4096,128 4,12,2048,64 1,12,1024,64 2>&1 | tee "$OUT/s10b_sweep_f32.txt"
timeout 150 python3 benchmarks/tile_sweep.py --threads 1 --rounds 3 --repeats 3 --all --dtype bfloat16 \
  --block-q 64,128,256 --block-k 128,256,512 --shapes 1,12,1024,64 1,16,4096,128 2>&1 | tee "$OUT/s10b_sweep_bf16.txt"
