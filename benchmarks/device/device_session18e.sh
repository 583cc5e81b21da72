#!/usr/bin/env bash
# Session 18, fifth device run: two cells of s18d below their marks, base (e07969f) against new, alternating:
#   ab_s18e_masks.txt    bench_masks.py additive bias (the batch-shared (1, H, N, N) bias: every chunk first, then the
#                        tiles), float32 and bfloat16, 16 and 1 threads, 3 rounds
#   ab_s18e_f32_t1.txt   pairwise_ratio.py float32 one thread, (1,4,1024,32) and (1,12,1024,64), 2 rounds
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1) &
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
for round in 1 2 3; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/bench_masks.py --threads 16,1 --markdown \
      --cases "additive bias" --min-run-time 0.3 2>&1 | grep "^| additive" | sed "s/^/$tree round $round /")
  done
done 2>&1 | tee "$OUT/ab_s18e_masks.txt"
for round in 1 2; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    echo "== round $round $tree float32"
    (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/pairwise_ratio.py --dtype float32 --threads 1 \
      --causal both --pairs 7 --shapes 1,4,1024,32 1,12,1024,64 2>&1 | grep -E "^\| [0-9]|^# probes")
  done
done 2>&1 | tee "$OUT/ab_s18e_f32_t1.txt"
uptime
