#!/usr/bin/env bash
# Session 19, second device run: shown_keys_end reading each mask row forward (new) against the session's base
# (.gpu_stage/base: backward from the block's end), and forward without prefetch_next_mask_block (.gpu_stage/nopf).
#   s19b_pytest.txt     test_masks, test_nonfinite, test_flash: amx cases (new tree)
#   ab_s19b_masks.txt   probe_mask_cost.py, (4,12,1024,64), bf16 and float32, 1 and 16 threads, the three trees
#                       alternating, 2 rounds
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
for dir in .gpu_stage/base .gpu_stage/nopf; do
  (cd $dir && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('$dir', cs149gpt.isa())" 2>&1 | tail -1) &
done
source benchmarks/device/preamble.sh
wait
grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core"
timeout 150 python3 -m pytest -q tests/test_masks.py tests/test_nonfinite.py tests/test_flash.py -k "amx and not emulated" \
  > "$OUT/s19b_pytest.txt" 2>&1
tail -1 "$OUT/s19b_pytest.txt"; grep -E "^FAILED" "$OUT/s19b_pytest.txt" | head -5
cases="no mask, causal,float 0/-inf,alibi f32 (1,alibi q-dtype,alibi f32, 256,t5"
for round in 1 2; do
  for tree in base new nopf; do
    dir=$PWD; [ $tree != new ] && dir=$PWD/.gpu_stage/$tree
    (cd $dir && timeout 150 python3 benchmarks/probe_mask_cost.py --threads 1,16 --cases "$cases" --min-time 0.25 \
      2>&1 | grep -E "^\| [a-z]" | sed "s/^/$tree $round /")
  done
done 2>&1 | tee "$OUT/ab_s19b_masks.txt"
uptime
