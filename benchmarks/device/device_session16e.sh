#!/usr/bin/env bash
# Session 16, fifth device run: the final code (after the review's fixes: the backward_path fixture's "auto" case now
# leaves path, runs and parts to module.cpp, whose choices on this 16-CPU host differ from the dev box's) under real AMX.
#   s16e_pytest.txt   test_backward, test_masks, test_dropout, test_nonfinite, test_flash: the amx cases
source benchmarks/device/preamble.sh
timeout 400 python3 -m pytest -q tests/test_backward.py tests/test_masks.py tests/test_dropout.py tests/test_nonfinite.py \
  tests/test_flash.py -k "amx and not emulated" > "$OUT/s16e_pytest.txt" 2>&1
tail -1 "$OUT/s16e_pytest.txt"; grep -E "^FAILED" "$OUT/s16e_pytest.txt" | head -5
uptime
