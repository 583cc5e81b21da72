#!/usr/bin/env bash
# Session 10 on the device host (issue 10): bf16 keys on AMX tiles in the decode kernel, against the commit before
# (carried as .gpu_stage/base), and the decode tests under every ISA, amx and amx_emulated included.
#   s10a_pytest.txt   test_kvcache.py, test_mask_decode.py (every ISA), test_flash.py -k 'decode or amx'
#   s10a_ab.txt       bench_decode.py --dtypes bfloat16, 1 and 16 threads, base and new alternating, $ROUNDS rounds
#   run: bash benchmarks/device/device_session10.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=8 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
{ lscpu | head -20; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/s10a_machine.txt" 2>&1
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1) &
PYTHONPATH=$PWD python3 -c "import cs149gpt; print('new', cs149gpt.isa())" 2>&1 | tail -1
wait
{ PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py \
    tests/test_mask_decode.py
  PYTHONPATH=$PWD timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py \
    -k "${TEST_FILTER:-decode or amx}"; } > "$OUT/s10a_pytest.txt" 2>&1
tail -3 "$OUT/s10a_pytest.txt"; grep -E "^FAILED" "$OUT/s10a_pytest.txt" | head -20
for round in $(seq ${ROUNDS:-2}); do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    echo "== round $round $tree"
    (cd $dir && PYTHONPATH=$dir timeout ${TL:-90} python3 benchmarks/bench_decode.py --dtypes bfloat16 \
      --threads ${THREADS:-1,16} --seconds ${SECONDS_PER_SHAPE:-0.1} 2>&1 | grep -E "^\| bfloat16|^## ")
  done
done 2>&1 | tee "$OUT/s10a_ab.txt"
