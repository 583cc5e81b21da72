#!/usr/bin/env bash
# Session 18, third device run: the forward's packing without a barrier (run_forward_tiles: chunks of the next kv
# head spread among the query tiles of the one before, a tile waiting only for its own kv head's chunks) against
# the session's base (e07969f in .gpu_stage/base, with this session's pairwise_ratio.py).
#   s18c_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout, test_backward: amx cases (new tree)
#   s18c_phases.txt      phase_times.py, 16 threads: base's phases (PHASES) and the new schedule's jobs (JOBS)
#   ab_s18c_t16.txt      pairwise_ratio.py, 16 threads, issue 9's four shapes, causal both, 3 dtypes, base and new
#                        alternating, 2 rounds
#   ab_s18c_t1.txt       the same, one thread, (1,12,1024,64) and (4,12,2048,64), float32 and bfloat16, 1 round
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
for tree in base new; do
  src=$PWD; [ $tree = base ] && src=$PWD/.gpu_stage/base
  dst=$PWD/.gpu_stage/phase_$tree
  mkdir -p "$dst" && (cd "$src" && tar --exclude=.gpu_stage --exclude=build --exclude=.git -cf - .) | tar -xf - -C "$dst"
  python3 benchmarks/device/instrument_phases.py "$dst"
done
for dir in .gpu_stage/base .gpu_stage/phase_base .gpu_stage/phase_new; do
  (cd $dir && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('$dir', cs149gpt.isa())" 2>&1 | tail -1) &
done
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core|^Socket|^L2|^L3"

timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s18c_pytest.txt" 2>&1
tail -1 "$OUT/s18c_pytest.txt"; grep -E "^FAILED" "$OUT/s18c_pytest.txt" | head -5

phases() {  # tree dtype shape
  (cd .gpu_stage/phase_$1 && PYTHONPATH=$PWD timeout 30 python3 $OLDPWD/benchmarks/device/phase_times.py $2 $3 16 \
    2>&1 | grep -v sdpa | sed "s/^/$1 /")
}
for cfg in "float32 1,4,1024,32" "float32 1,12,1024,64" "bfloat16 1,4,1024,32" "bfloat16 1,12,1024,64" \
           "float16 1,4,1024,32" "float16 1,12,1024,64"; do
  phases base $cfg; phases new $cfg
done 2>&1 | tee "$OUT/s18c_phases.txt"

ab() {  # threads rounds pairs min_time dtypes shapes...
  local threads=$1 rounds=$2 pairs=$3 min_time=$4 dtypes=$5; shift 5
  for round in $(seq $rounds); do
    for tree in base new; do
      dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
      for dtype in $dtypes; do
        echo "== round $round $tree $dtype"
        (cd $dir && PYTHONPATH=$dir timeout 100 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads $threads \
          --causal both --pairs $pairs --min-time $min_time --shapes "$@" 2>&1 | grep -E "^\| [0-9]|^# probes")
      done
    done
  done
}
ab 16 2 11 0.02 "float32 bfloat16 float16" 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 2>&1 | tee "$OUT/ab_s18c_t16.txt"
ab 1 1 5 0.05 "float32 bfloat16" 1,12,1024,64 4,12,2048,64 2>&1 | tee "$OUT/ab_s18c_t1.txt"
uptime
