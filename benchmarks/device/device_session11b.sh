#!/usr/bin/env bash
# Session 11, second device run: where the training step's time goes (issue 12's tokens/s target), with each
# config and precision profiled (attention's share of the step, ours and SDPA's), then the training table.
#   s11b_profile_<config>_<precision>.txt  profile_train.py, 16 threads, 4 steps
#   s11b_train_t16.txt                     bench_train.py, shipped and nano256, fp32 and autocast, 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
for config in nano256 shipped; do
  for precision in fp32 autocast; do
    timeout 60 python3 benchmarks/profile_train.py --config $config --precision $precision --threads 16 --steps 4 \
      --rows 25 > "$OUT/s11b_profile_${config}_${precision}.txt" 2>&1
    grep "=====" "$OUT/s11b_profile_${config}_${precision}.txt"
  done
done
timeout 150 python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast --threads 16 \
  --steps 10 > "$OUT/s11b_train_t16.txt" 2>&1
grep -E "^train|^#" "$OUT/s11b_train_t16.txt"
