#!/usr/bin/env bash
# Session 18, first device run: the forward's packing split into chunks (split_packing) against the session's base
# (e07969f in .gpu_stage/base, with this session's pairwise_ratio.py); where a small call's time goes on 16 threads
# (instrument_phases.py copies of both trees); and float32 on the bf16 tiles against the FMA kernel on this host.
#   s18a_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout: amx cases (new tree)
#   s18a_phases.txt      phase_times.py, 16 threads, base and new: fork, packing, tiles (mean/max busy), join
#   ab_s18a_t16.txt      pairwise_ratio.py, 16 threads, (1,4,1024,32) and (1,12,1024,64), causal both, 3 dtypes,
#                        base and new alternating, 2 rounds
#   s18a_f32_tiles.txt   pairwise_ratio.py --float32-products fma,bf16_tiles, issue 9's shapes, 1 and 16 threads
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
  -k "amx and not emulated" > "$OUT/s18a_pytest.txt" 2>&1
tail -1 "$OUT/s18a_pytest.txt"; grep -E "^FAILED" "$OUT/s18a_pytest.txt" | head -5

for tree in base new; do
  for cfg in "float32 1,4,1024,32" "float32 1,12,1024,64" "bfloat16 1,4,1024,32" "bfloat16 1,12,1024,64" \
             "float16 1,4,1024,32" "float16 1,12,1024,64"; do
    echo "== $tree $cfg"
    (cd .gpu_stage/phase_$tree && PYTHONPATH=$PWD timeout 30 python3 $OLDPWD/benchmarks/device/phase_times.py $cfg 16 2>&1)
  done
done 2>&1 | tee "$OUT/s18a_phases.txt"

for round in 1 2; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    for dtype in float32 bfloat16 float16; do
      echo "== round $round $tree $dtype"
      (cd $dir && PYTHONPATH=$dir timeout 40 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 16 \
        --causal both --pairs 15 --min-time 0.02 --shapes 1,4,1024,32 1,12,1024,64 2>&1 | grep -E "^\| [0-9]|^# probes")
    done
  done
done 2>&1 | tee "$OUT/ab_s18a_t16.txt"

timeout 150 python3 benchmarks/pairwise_ratio.py --float32-products fma,bf16_tiles --threads 1,16 --causal both \
  --pairs 7 2>&1 | tee "$OUT/s18a_f32_tiles.txt"
uptime
