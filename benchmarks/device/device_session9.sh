#!/usr/bin/env bash
# Session 9's closing run on the device host (16-core Xeon with AMX): the float32 one-pass backward with its key runs
# merged in order (4 tasks a CPU, no partial buffers) — issue 12's backward table at 16 threads with peak memory
# (bench_backward.py, the shapes, float32), and the training step (bench_train.py, 16 threads). The one-thread
# rows: BWD1=1 (the three smaller shapes; the largest takes minutes a call there).
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session9.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T=${TAG:-s9z}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime
  python3 -c "import cs149gpt, torch; print('isa', cs149gpt.isa(), torch.__version__)"
} > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
timeout ${TL_BWD:-300} python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --threads 16 --causal both --dtype float32 --memory --rounds 3 > "$OUT/${T}_backward_t16.txt" 2>&1
grep -E "bwd|peak" "$OUT/${T}_backward_t16.txt" | head -40
if [ "${BWD1:-0}" = 1 ]; then
  timeout ${TL_BWD1:-200} python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    --threads 1 --causal both --dtype float32 --rounds 2 > "$OUT/${T}_backward_t1.txt" 2>&1
  grep -E "bwd" "$OUT/${T}_backward_t1.txt" | head -40
fi
timeout ${TL_TRAIN:-150} python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast \
  --threads 16 > "$OUT/${T}_train_t16.txt" 2>&1
grep -E "^train" "$OUT/${T}_train_t16.txt"
