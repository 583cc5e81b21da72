#!/usr/bin/env bash
# Session 8 on the device host (16-core Xeon with AMX): additive 0/−inf masks as key ranges, transformers' mask as
# float32 0/−inf under torch.compile (issue 11's compiled-prefill cells), and why BERT's attention calls cost more in
# the model than alone. Stages (env): PYTEST=1 the touched tests under amx; PROFILE=1 compiled Llama's operator
# profile (16 threads); PROBE=1 probe_bert_in_model.py at 32 x 128 (1 and 16 threads, both dtypes), PROBE=2 also
# at 4 x 512 and probe_small_calls.py;
# MODELS=1 every whole-model case (bench_models.py, DTYPE) with BERT at 32 x 128; FORWARD=1 issue 9's forward table
# (bench_attention.py, the shapes, 3 dtypes) and masked prefill (bench_masks.py).
#   run: CS149GPT_NO_CUDA=1 PYTEST=1 PROFILE=1 PROBE=1 DTYPE=bfloat16 bash benchmarks/device/device_session8.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DTYPE=${DTYPE:-bfloat16}
T=${TAG:-s8}_${DTYPE}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime
  python3 -c "import cs149gpt, torch, transformers; print('isa', cs149gpt.isa(), torch.__version__, transformers.__version__)"
} > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
rm -rf /tmp/torchinductor_* 2>/dev/null
if [ "${PYTEST:-0}" = 1 ]; then
  timeout ${TL_TESTS:-200} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_masks.py \
    tests/test_real_models.py tests/test_fast_path.py tests/test_mask_decode.py} > "$OUT/${T}_pytest.txt" 2>&1
  tail -2 "$OUT/${T}_pytest.txt"; grep -E "^FAILED|^E " "$OUT/${T}_pytest.txt" | head -10
fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 150 python3 benchmarks/profile_models.py --compile --threads 16 --dtype $DTYPE --rows 12 \
    > "$OUT/${T}_profile_compile.txt" 2>&1
  grep -E "^#|ms of self|arange" "$OUT/${T}_profile_compile.txt" | cut -c1-150
fi
if [ "${PROBE:-0}" = 1 ]; then
  { timeout 150 python3 benchmarks/probe_bert_in_model.py --threads 1,16 --dtype float32,bfloat16 --rounds 5
    if [ "${PROBE}" = 2 ]; then
      timeout 150 python3 benchmarks/probe_bert_in_model.py --threads 1,16 --dtype float32,bfloat16 --rounds 3 \
        --batch 4 --seq 512
      timeout 60 python3 benchmarks/probe_small_calls.py --threads 1,16
    fi
  } > "$OUT/${T}_probe_bert.txt" 2>&1
  grep -E "^\||^#" "$OUT/${T}_probe_bert.txt" | grep -v "^|---"
fi
if [ "${FORWARD:-0}" = 1 ]; then  # issue 9's forward table and masked prefill, on the final code
  timeout ${TL_FWD:-300} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
    --min-run-time ${MIN_RUN:-0.3} --rounds ${ROUNDS:-2} --json "$OUT/${T}_forward.json" > "$OUT/${T}_forward.txt" 2>&1
  grep -E " flash |peak" "$OUT/${T}_forward.txt"
  timeout ${TL_MASKS:-150} python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 \
    --min-run-time 0.5 > "$OUT/${T}_bench_masks.txt" 2>&1
  grep -E "^\|" "$OUT/${T}_bench_masks.txt"
fi
[ "${MODELS:-0}" = 1 ] || exit 0
{ timeout ${TL_MAIN:-420} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --compile --repeats ${REPEATS:-4}
  timeout ${TL_BERT:-60} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --models bert --batch 32 \
    --seq 128 --repeats ${REPEATS:-4}
} > "$OUT/${T}_models.txt" 2>&1
grep -E "^\||^#|Error|error" "$OUT/${T}_models.txt" | grep -v "^|---"
