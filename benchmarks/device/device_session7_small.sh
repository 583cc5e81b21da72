#!/usr/bin/env bash
# Session 7, device host (16-core Xeon with AMX): why BERT on 32 x 128 sentence batches runs slower with ours at 16
# threads (the attention calls 2x torch's there) — small calls, per ISA (amx, avx512_bf16); and Llama under
# torch.compile with the graph compiled per thread count (bench_models.py).
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session7_small.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T=${TAG:-s7s}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; python3 -c "import cs149gpt; print('isa', cs149gpt.isa())"; } \
  > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
for isa in amx avx512_bf16; do
  CS149GPT_ISA=$isa timeout 100 python3 benchmarks/probe_small_calls.py --threads 1,16 ${SMALL_ARGS:-}
done > "$OUT/${T}_small_calls.txt" 2>&1
cat "$OUT/${T}_small_calls.txt"
for dt in ${MODEL_DTYPES:-bfloat16 float32}; do
  timeout ${TL_MODELS:-150} python3 benchmarks/bench_models.py --dtype $dt --threads 1,16 --models llama --compile \
    --repeats 4
done > "$OUT/${T}_models_compile.txt" 2>&1
grep -E "^\||^#" "$OUT/${T}_models_compile.txt" | grep -v "^|---"
