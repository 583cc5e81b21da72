#!/usr/bin/env bash
# Session 19, fifth device run: biased runs of keys taken only where each mask row serves 4 (batch, head) pairs or more
# (module.cpp kMinBiasReuse) against the session's base (.gpu_stage/base), the amx tests, and bench_masks (issue 11).
#   s19e_pytest.txt       test_masks, test_nonfinite, test_flash, test_backward, test_mask_decode, test_dropout: amx
#   ab_s19e_masks.txt     probe_mask_cost.py, bf16 and float32, (1,12,1024,64) and (4,12,1024,64), 1 and 16
#                         threads, base and new alternating, 2 rounds
#   s19e_bench_masks.txt  bench_masks.py (4,12,1024,64), float32 and bfloat16, 16 and 1 threads (new)
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1) &
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo
timeout 200 python3 -m pytest -q tests/test_masks.py tests/test_nonfinite.py tests/test_flash.py tests/test_backward.py \
  tests/test_mask_decode.py tests/test_dropout.py -k "amx and not emulated" > "$OUT/s19e_pytest.txt" 2>&1
tail -1 "$OUT/s19e_pytest.txt"; grep -E "^FAILED" "$OUT/s19e_pytest.txt" | head -5
cases="bool causal,alibi f32 (,alibi q-dtype,t5 f32 ("
for round in 1 2; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    for shape in 1,12,1024,64 4,12,1024,64; do
      (cd $dir && timeout 100 python3 benchmarks/probe_mask_cost.py --shape $shape --threads 1,16 --cases "$cases" \
        --min-time 0.2 2>&1 | grep -E "^\| [a-z]" | sed "s/^/$tree $round $shape /")
    done
  done
done 2>&1 | tee "$OUT/ab_s19e_masks.txt"
timeout 120 python3 benchmarks/bench_masks.py --threads 16,1 --markdown 2>&1 | tee "$OUT/s19e_bench_masks.txt"
uptime
