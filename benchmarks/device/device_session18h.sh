#!/usr/bin/env bash
# Session 18, eighth device run: the final read's mend (int64 packing counters first in the workspace; the backward's
# merge turns on the same spin-wait) under real amx.
#   s18h_pytest.txt      test_flash, test_masks, test_nonfinite, test_dropout, test_backward: amx cases
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo
timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s18h_pytest.txt" 2>&1
tail -1 "$OUT/s18h_pytest.txt"; grep -E "^FAILED" "$OUT/s18h_pytest.txt" | head -5
