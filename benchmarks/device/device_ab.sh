#!/usr/bin/env bash
# A/B on the device host: the working tree against a copy of the previous commit (.gpu_stage/base, carried),
# both built, then the same benchmark alternating between the two in separate processes, ROUNDS times.
#   run: CS149GPT_NO_CUDA=1 ARGS="--shapes 1,12,1024,64 --dtype float32 --threads 1" bash benchmarks/device/device_ab.sh
#   another benchmark: CMD="benchmarks/bench_masks.py --markdown" KEEP="^\| [a-z]" ARGS="--threads 1,16" ...
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=8 PYTHONUNBUFFERED=1
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())") &
PYTHONPATH=$PWD python3 -c "import cs149gpt; print('new', cs149gpt.isa())"
wait
for round in $(seq ${ROUNDS:-3}); do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    echo "== round $round $tree"
    (cd $dir && PYTHONPATH=$dir timeout ${TL:-60} python3 ${CMD:-benchmarks/bench_attention.py --impls flash \
      --min-run-time ${MIN_RUN:-0.4} --rounds 1} $ARGS 2>&1 | grep -E "${KEEP:-^[0-9]}")
  done
done 2>&1 | tee "$OUT/ab_${TAG:-run}.txt"
