#!/usr/bin/env bash
# Session 7: every whole-model case of issue 11 on the device host (16-core Xeon with AMX), ours vs torch SDPA in
# the same run: Llama prefill, prefill under torch.compile, generate with a dynamic and a static cache; GPT-2
# train step with dropout; BERT encoding a right-padded batch (and a sentence-embedding-sized batch of 32 x 128).
# One dtype per call (each fits a 10-minute device call).
#   run: CS149GPT_NO_CUDA=1 DTYPE=bfloat16 bash benchmarks/device_session7_models.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DTYPE=${DTYPE:-float32}
T=s7m_${DTYPE}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; git log --oneline -1 2>/dev/null
  python3 -c "import cs149gpt, torch, transformers; print('isa', cs149gpt.isa(), torch.__version__, transformers.__version__)"
} > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
{ timeout ${TL_MAIN:-420} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --compile --repeats ${REPEATS:-4}
  timeout ${TL_BERT:-60} python3 benchmarks/bench_models.py --dtype $DTYPE --threads 1,16 --models bert --batch 32 \
    --seq 128 --repeats ${REPEATS:-4}
} > "$OUT/${T}_models.txt" 2>&1
grep -E "^\||^#|Error|error" "$OUT/${T}_models.txt" | grep -v "^|---"
