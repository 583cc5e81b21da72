#!/usr/bin/env bash
# Session 17, second device run: issue 9's table on the session's final code, every cell as the median of pairwise
# ratios (pairwise_ratio.py: SDPA and ours back to back, pair after pair), with the machine's probes before and after
# each thread count; and the amx cases of the kernels' tests.
#   s17b_pytest.txt                 test_flash, test_masks, test_nonfinite, test_dropout, test_backward: amx cases
#   s17b_pairwise_{float32,bfloat16,float16}.txt   issue 9's four shapes, causal both, 1 and 16 threads
source benchmarks/device/preamble.sh
timeout 300 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s17b_pytest.txt" 2>&1
tail -1 "$OUT/s17b_pytest.txt"; grep -E "^FAILED" "$OUT/s17b_pytest.txt" | head -5
for dtype in float32 bfloat16 float16; do
  timeout 150 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 1 --causal both --pairs 7 \
    > "$OUT/s17b_pairwise_$dtype.txt" 2>&1
  timeout 60 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 16 --causal both --pairs 15 --min-time 0.02 \
    2>&1 | grep -E "^\||^#" | grep -v "^| shape\|^|---\|^# torch" >> "$OUT/s17b_pairwise_$dtype.txt"
  cat "$OUT/s17b_pairwise_$dtype.txt"
done
uptime
