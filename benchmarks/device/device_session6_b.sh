#!/usr/bin/env bash
# Session 6, first device run (16-core Xeon with AMX) on main as session 5 left it: what session 5's closing run
# part B could not measure — masked prefill against SDPA given the same mask; whole Hugging Face models (prefill,
# generate, GPT-2 train step) with each attention; decoding (Llama heads, batch 1 and 8, 128–8192 keys); the
# backward on 16 threads. Every stage has its own time limit so that the whole fits one 10-minute device call.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session6_b.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ lscpu | grep -E "Model name|^CPU\(s\)|MHz"; uptime; python3 -c "import cs149gpt; print('isa', cs149gpt.isa())"; } \
  > "$OUT/s6b_machine.txt" 2>&1
cat "$OUT/s6b_machine.txt"
timeout 125 python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 --min-run-time 0.8 \
  > "$OUT/s6b_bench_masks.txt" 2>&1
grep -E "^\|" "$OUT/s6b_bench_masks.txt"
{ timeout 85 python3 benchmarks/bench_models.py --dtype bfloat16 --threads 1,16 --models llama --repeats 4
  timeout 120 python3 benchmarks/bench_models.py --dtype float32 --threads 1,16 --models llama,gpt2 --repeats 4
} > "$OUT/s6b_models.txt" 2>&1
grep -E "^\||^#" "$OUT/s6b_models.txt"
timeout 70 python3 benchmarks/bench_decode.py --threads 16,1 --batches 1,8 --keys 128,1024,4096,8192 \
  --dtypes float32,bfloat16 --seconds 0.12 > "$OUT/s6b_decode.txt" 2>&1
grep -E "^\||^##" "$OUT/s6b_decode.txt"
for dtype in float32 bfloat16; do
  timeout 50 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --threads 16 --causal both --dtype $dtype --rounds 1 --min-run-time 0.1
done > "$OUT/s6b_backward_t16.txt" 2>&1
grep -E "bwd flash" "$OUT/s6b_backward_t16.txt"
