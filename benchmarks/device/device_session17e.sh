#!/usr/bin/env bash
# Session 17, fifth device run: the row max in the S product (float32 forward) against session 16's final code
# (b626b1e in .gpu_stage/base, carried, with this session's pairwise_ratio.py), one thread, 3 rounds alternating.
#   ab_s17e_f32_t1.txt   pairwise_ratio.py float32, 1 thread, issue 9's four shapes, non-causal (+ causal at d = 128)
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1)
for round in 1 2 3; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    echo "== round $round $tree"
    (cd $dir && PYTHONPATH=$dir timeout 100 python3 benchmarks/pairwise_ratio.py --dtype float32 --threads 1 --pairs 9 \
      --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 2>&1 | grep -E "^\| [0-9]|^# probes")
  done
done 2>&1 | tee "$OUT/ab_s17e_f32_t1.txt"
uptime
