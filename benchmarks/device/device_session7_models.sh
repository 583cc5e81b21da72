#!/usr/bin/env bash
# Session 7: every whole-model case of issue 11 on the device host (16-core Xeon with AMX), ours vs torch SDPA in
# the same run: Llama prefill, prefill under torch.compile, generate with a dynamic and a static cache; GPT-2
# train step with dropout; BERT encoding a right-padded batch (and a sentence-embedding-sized batch of 32 x 128).
# One dtype per call (each fits a 10-minute device call). TAG names the outputs; PYTEST=1 first runs the tests the
# output-layout change touches (every ISA, amx included); PROFILE=1 adds operator profiles (profile_models.py) of
# compiled Llama and of BERT at 32 x 128, 16 threads; SMALL=1 small calls (probe_small_calls.py) and masked prefill
# (bench_masks.py); MODELS=0 skips the whole models; TESTS overrides the test files.
#   run: CS149GPT_NO_CUDA=1 DTYPE=bfloat16 bash benchmarks/device/device_session7_models.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DTYPE=${DTYPE:-float32}
T=${TAG:-s7m}_${DTYPE}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; git log --oneline -1 2>/dev/null
  python3 -c "import cs149gpt, torch, transformers; print('isa', cs149gpt.isa(), torch.__version__, transformers.__version__)"
} > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
if [ "${PYTEST:-0}" = 1 ]; then
  timeout ${TL_TESTS:-150} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_attention.py \
    tests/test_flash.py tests/test_fast_path.py tests/test_real_models.py tests/test_backward.py} \
    > "$OUT/${T}_pytest.txt" 2>&1
  tail -2 "$OUT/${T}_pytest.txt"; grep -E "^FAILED|^E " "$OUT/${T}_pytest.txt" | head -10
fi
if [ "${PROFILE:-0}" = 1 ]; then
  { timeout 150 python3 benchmarks/profile_models.py --compile --threads 16 --dtype $DTYPE --rows 25
    timeout 60 python3 benchmarks/profile_models.py --model bert --batch 32 --seq 128 --threads 16 --dtype $DTYPE \
      --rows 14; } > "$OUT/${T}_profile.txt" 2>&1
  grep -E "^#|ms of self" "$OUT/${T}_profile.txt"
fi
if [ "${SMALL:-0}" = 1 ]; then
  { timeout 60 python3 benchmarks/probe_small_calls.py --threads 1,16
    timeout 60 python3 benchmarks/probe_key_ranges.py --threads 1,16
    timeout 150 python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 \
      --min-run-time 0.5; } > "$OUT/${T}_small_masks.txt" 2>&1
  grep -E "^\|" "$OUT/${T}_small_masks.txt" | grep -v "^|---"
fi
[ "${MODELS:-1}" = 1 ] || exit 0
{ timeout ${TL_MAIN:-420} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --compile --repeats ${REPEATS:-4}
  timeout ${TL_BERT:-60} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --models bert --batch 32 \
    --seq 128 --repeats ${REPEATS:-4}
} > "$OUT/${T}_models.txt" 2>&1
grep -E "^\||^#|Error|error" "$OUT/${T}_models.txt" | grep -v "^|---"
