#!/usr/bin/env bash
# Session 13, last device run: the Llama-shaped generation (issue 10) on the current kernels, and where its token goes.
#   s13f_generate_llama.txt  bench_generate.py --llama: 2 layers of Llama-3-8B width, bf16, context 4096, 16 threads
#   s13f_profile_llama.txt   profile_decode_step.py --llama, context 4096, 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
uptime
timeout 150 python3 benchmarks/bench_generate.py --llama --contexts 4096 --threads 16 --impls flash --repeats 3 --decode 16 \
  > "$OUT/s13f_generate_llama.txt" 2>&1
grep -E "^\| [0-9]" "$OUT/s13f_generate_llama.txt"
timeout 120 python3 benchmarks/profile_decode_step.py --llama --context 4096 --threads 16 --steps 8 > "$OUT/s13f_profile_llama.txt" 2>&1
grep -E "^## |flash_decode|scaled_dot|attention_with|aten::mm|aten::linear " "$OUT/s13f_profile_llama.txt" | cut -c1-110
uptime
