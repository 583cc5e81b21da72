#!/usr/bin/env bash
# Session 11, last device run: the tests of the fuzz's fixes (huge finite logits on the bf16/fp16 tile kernels,
# key ranges with is_causal on the decode kernel, the KV cache's overlap checks) and the suites around them on amx.
#   s11f_pytest.txt   test_nonfinite, test_mask_decode, test_kvcache, test_flash under amx
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_nonfinite.py tests/test_mask_decode.py \
  tests/test_kvcache.py tests/test_flash.py -k "amx and not emulated" > "$OUT/s11f_pytest.txt" 2>&1
tail -2 "$OUT/s11f_pytest.txt"; grep -E "^FAILED" "$OUT/s11f_pytest.txt" | head -10
