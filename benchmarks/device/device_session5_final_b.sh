#!/usr/bin/env bash
# Session 5's closing run, part B (16-core Xeon with AMX), on merged main: masked prefill against SDPA given the
# same mask; whole Hugging Face Llama models (prefill, generate) with each attention; decoding (Llama heads, batch 1
# and 8, 128–8192 keys); the backward on 16 threads.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_session5_final_b.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "import cs149gpt; print(cs149gpt.isa())"
timeout 150 python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 --min-run-time 1.0 \
  > "$OUT/s5f_bench_masks.txt" 2>&1
grep -E "^\|" "$OUT/s5f_bench_masks.txt"
{ timeout 110 python3 benchmarks/bench_models.py --dtype bfloat16 --threads 1,16 --models llama --repeats 5
  timeout 150 python3 benchmarks/bench_models.py --dtype float32 --threads 1,16 --models llama,gpt2 --repeats 5
} > "$OUT/s5f_models.txt" 2>&1
grep -E "^\||^#" "$OUT/s5f_models.txt"
timeout 90 python3 benchmarks/bench_decode.py --threads 16,1 --batches 1,8 --keys 128,1024,4096,8192 \
  --dtypes float32,bfloat16 --seconds 0.15 > "$OUT/s5f_decode.txt" 2>&1
grep -E "^\||^##" "$OUT/s5f_decode.txt"
for dtype in float32 bfloat16; do
  timeout 60 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --threads 16 --causal both --dtype $dtype --rounds 1 --min-run-time 0.1
done > "$OUT/s5f_backward_t16.txt" 2>&1
grep -E "bwd flash" "$OUT/s5f_backward_t16.txt"
