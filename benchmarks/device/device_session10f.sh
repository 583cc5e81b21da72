#!/usr/bin/env bash
# Session 10, closing run on the device host: the tests of the kernels whose AMX defaults changed this session
# (forward key tiles of 512, bf16 backward key tiles of 256 at d <= 64) under every ISA, amx first; then the bf16
# backward table (issue 12) with its peak memory, 16 and 1 threads.
#   s10f_pytest.txt           test_flash, test_backward, test_masks, test_dropout (every ISA; the default is amx here)
#   s10f_backward_bf16_t16.txt  bench_backward.py --memory, bf16, the four shapes, causal both
#   s10f_backward_bf16_t1.txt   the same on one thread, the three smaller shapes
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout ${TL_TEST:-330} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_backward.py \
  tests/test_masks.py tests/test_dropout.py > "$OUT/s10f_pytest.txt" 2>&1
tail -2 "$OUT/s10f_pytest.txt"; grep -E "^FAILED" "$OUT/s10f_pytest.txt" | head -10
timeout 90 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --threads 16 --causal both --dtype bfloat16 --rounds 2 --memory > "$OUT/s10f_backward_bf16_t16.txt" 2>&1
grep -E "bwd flash|memory" "$OUT/s10f_backward_bf16_t16.txt" | head -30
timeout 120 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  --threads 1 --causal both --dtype bfloat16 --rounds 2 > "$OUT/s10f_backward_bf16_t1.txt" 2>&1
grep -E "bwd flash" "$OUT/s10f_backward_bf16_t1.txt" | head -12
