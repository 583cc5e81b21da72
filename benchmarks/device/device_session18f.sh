#!/usr/bin/env bash
# Session 18, sixth device run: the final kernels (after the review: counters a cache line apart, the next kv head's
# chunks from the start of each block, yielding after long spins) under real amx, and against the base once more.
#   s18f_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout, test_backward: amx cases
#   s18f_phases.txt      phase_times.py (JOBS), 16 threads, the final tree
#   ab_s18f_t16.txt      pairwise_ratio.py, 16 threads, issue 9's four shapes, causal both, 3 dtypes, base and new,
#                        1 round
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
dst=$PWD/.gpu_stage/phase_new
mkdir -p "$dst" && tar --exclude=.gpu_stage --exclude=build --exclude=.git -cf - . | tar -xf - -C "$dst"
python3 benchmarks/device/instrument_phases.py "$dst"
for dir in .gpu_stage/base .gpu_stage/phase_new; do
  (cd $dir && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('$dir', cs149gpt.isa())" 2>&1 | tail -1) &
done
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s18f_pytest.txt" 2>&1
tail -1 "$OUT/s18f_pytest.txt"; grep -E "^FAILED" "$OUT/s18f_pytest.txt" | head -5
for cfg in "float32 1,4,1024,32" "float32 1,12,1024,64" "bfloat16 1,4,1024,32" "bfloat16 1,12,1024,64" \
           "float16 1,4,1024,32" "float16 1,12,1024,64"; do
  (cd .gpu_stage/phase_new && PYTHONPATH=$PWD timeout 30 python3 $OLDPWD/benchmarks/device/phase_times.py $cfg 16 2>&1 \
    | grep -v sdpa)
done 2>&1 | tee "$OUT/s18f_phases.txt"
for tree in base new; do
  dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
  for dtype in float32 bfloat16 float16; do
    echo "== round 1 $tree $dtype"
    (cd $dir && PYTHONPATH=$dir timeout 100 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 16 \
      --causal both --pairs 11 --min-time 0.02 2>&1 | grep -E "^\| [0-9]|^# probes")
  done
done 2>&1 | tee "$OUT/ab_s18f_t16.txt"
uptime
