#!/usr/bin/env bash
# Session 12, closing device run: the session's fixes tested under amx, then issue 9's forward table.
#   s12b_pytest.txt    test_masks (window bounds), test_kvcache (shared paged blocks), test_bad_input, under amx;
#                      test_real_models (sink models among them) on the default ISA (amx)
#   s12b_forward.txt   bench_attention.py: the four shapes, causal both, bf16 / fp16 / fp32, 1 and 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
uptime
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_masks.py tests/test_kvcache.py tests/test_bad_input.py \
  tests/test_real_models.py -k "amx and not emulated or bad_input or beyond_int64 or shared_blocks or real_models" \
  > "$OUT/s12b_pytest.txt" 2>&1
tail -2 "$OUT/s12b_pytest.txt"; grep -E "^FAILED" "$OUT/s12b_pytest.txt" | head -10
uptime
timeout 380 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype bfloat16,float16,float32 --min-run-time 0.2 --rounds 2 \
  > "$OUT/s12b_forward.txt" 2>&1
grep -E "flash|peak" "$OUT/s12b_forward.txt" | grep -v "^\[" | head -60
uptime
