#!/usr/bin/env bash
# Session 6 (16-core Xeon with AMX): the forward benchmark (issue 9: bf16, fp16, fp32; the four shapes;
# causal both; 1 and 16 threads), the one-thread backward (issue 12), the training step (shipped model and a
# nanoGPT-sized one). Each stage time-limited to fit one 10-minute device call.
#   run: CS149GPT_NO_CUDA=1 TAG=s6a bash benchmarks/device/device_session6_a.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
TAG=${TAG:-s6a}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; git log --oneline -1 2>/dev/null
  python3 -c "import cs149gpt; print('isa', cs149gpt.isa())"; } > "$OUT/${TAG}_machine.txt" 2>&1
cat "$OUT/${TAG}_machine.txt"
timeout ${TL_FWD:-250} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
  --min-run-time ${MIN_RUN:-0.3} --rounds ${ROUNDS:-2} --json "$OUT/${TAG}_forward.json" > "$OUT/${TAG}_forward.txt" 2>&1
grep -E " flash |peak" "$OUT/${TAG}_forward.txt"
uptime
for dtype in float32 bfloat16; do
  timeout ${TL_BWD1:-80} python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --threads 1 --causal both --dtype $dtype --rounds 1 --min-run-time 0.1
done > "$OUT/${TAG}_backward_t1.txt" 2>&1
grep -E "bwd flash" "$OUT/${TAG}_backward_t1.txt"
timeout ${TL_TRAIN:-100} python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast \
  --threads 16 --steps 5 --warmup 2 > "$OUT/${TAG}_train_t16.txt" 2>&1
grep -E "^train" "$OUT/${TAG}_train_t16.txt"
