#!/usr/bin/env bash
# Session 10, fifth run on the device host: the float32 backward's tiles on one thread (issue 12's one-thread cells),
# interleaved in rounds, and the training step on 16 threads with the bf16 tiles of this session (512 keys forward,
# 256 backward, at d <= 64 on AMX).
#   s10e_bwd_tiles_f32_t1.txt   bench_backward_tiles.py, float32, 1 thread, the three smaller shapes
#   s10e_train_t16.txt          bench_train.py, shipped and nanoGPT-256, fp32 and autocast, 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 240 python3 benchmarks/bench_backward_tiles.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  --tiles 96x96 96x192 192x96 192x192 48x96 --threads 1 --causal both --dtype float32 --rounds 2 \
  --min-run-time 0.2 > "$OUT/s10e_bwd_tiles_f32_t1.txt" 2>&1
grep -vE "^#|^$" "$OUT/s10e_bwd_tiles_f32_t1.txt" | tail -12
timeout ${TL_TRAIN:-150} python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast \
  --threads 16 2>&1 | tee "$OUT/s10e_train_t16.txt"
