#!/usr/bin/env bash
# Session 17, first device run: the float32 forward's row max taken in the S product's registers (flash.cpp,
# micro_gemm's row_max), under real AMX and against the previous commit (.gpu_stage/base, carried).
#   s17a_pytest.txt          test_flash, test_masks, test_nonfinite: the amx cases
#   ab_s17a_f32.txt          pairwise_ratio.py float32, issue 9's four shapes, causal both: 1 thread (2 rounds base/new
#                            alternating), 16 threads (1 round)
#   s17a_bf16_t16.txt        pairwise_ratio.py bfloat16 16 threads (the noisy (1,12,1024,64) cell), 25 pairs
source benchmarks/device/preamble.sh
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1)
timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py -k "amx and not emulated" \
  > "$OUT/s17a_pytest.txt" 2>&1
tail -1 "$OUT/s17a_pytest.txt"; grep -E "^FAILED" "$OUT/s17a_pytest.txt" | head -5
ab() {  # ab TAG ROUNDS ARGS...
  local tag=$1 rounds=$2; shift 2
  for round in $(seq $rounds); do
    for tree in base new; do
      dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
      echo "== round $round $tree"
      (cd $dir && PYTHONPATH=$dir timeout 120 python3 benchmarks/pairwise_ratio.py "$@" 2>&1 | grep -E "^\| [0-9]")
    done
  done 2>&1 | tee -a "$OUT/ab_$tag.txt"
}
cp benchmarks/pairwise_ratio.py .gpu_stage/base/benchmarks/
ab s17a_f32 2 --threads 1 --causal both --pairs 7
ab s17a_f32 1 --threads 16 --causal both --pairs 15 --min-time 0.02
timeout 60 python3 benchmarks/pairwise_ratio.py --dtype bfloat16 --threads 16 --causal both --pairs 25 --min-time 0.02 \
  > "$OUT/s17a_bf16_t16.txt" 2>&1
cat "$OUT/s17a_bf16_t16.txt"
uptime
