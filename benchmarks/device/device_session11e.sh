#!/usr/bin/env bash
# Session 11, closing device run on the final kernels: the AMX tests of the kernels this session changed, the bf16
# forward table (issue 9) and the training table (issue 12).
#   s11e_pytest.txt          test_flash, test_backward, test_nonfinite, test_masks, test_dropout under amx
#   s11e_forward_bf16.txt    bench_attention.py, bf16, issue 9's four shapes, causal both, 1 and 16 threads
#   s11e_train_t16.txt       bench_train.py, shipped and nano256, fp32 and autocast, 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_backward.py tests/test_nonfinite.py \
  tests/test_masks.py tests/test_dropout.py -k "amx and not emulated" > "$OUT/s11e_pytest.txt" 2>&1
tail -2 "$OUT/s11e_pytest.txt"; grep -E "^FAILED" "$OUT/s11e_pytest.txt" | head -10
timeout 170 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype bfloat16 --rounds 2 --min-run-time 0.2 \
  > "$OUT/s11e_forward_bf16.txt" 2>&1
grep -E "flash|peak|warning" "$OUT/s11e_forward_bf16.txt" | head -40
timeout 100 python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast --threads 16 \
  --steps 8 > "$OUT/s11e_train_t16.txt" 2>&1
grep -E "^train" "$OUT/s11e_train_t16.txt"
