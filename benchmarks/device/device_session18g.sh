#!/usr/bin/env bash
# Session 18, seventh device run: the batch-shared mask's order (a kv head index over the whole batch, its chunks just
# before its tiles) under real amx, and bench_masks' additive bias (a (1, H, N, N) bias, batch 4: that order) against
# the base (e07969f), alternating.
#   s18g_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout, test_backward: amx cases
#   ab_s18g_masks.txt    bench_masks.py additive bias, float32 and bfloat16, 16 and 1 threads, 3 rounds
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1) &
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s18g_pytest.txt" 2>&1
tail -1 "$OUT/s18g_pytest.txt"; grep -E "^FAILED" "$OUT/s18g_pytest.txt" | head -5
for round in 1 2 3; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/bench_masks.py --threads 16,1 --markdown \
      --cases "additive bias" --min-run-time 0.3 2>&1 | grep "^| additive" | sed "s/^/$tree round $round /")
  done
done 2>&1 | tee "$OUT/ab_s18g_masks.txt"
uptime
