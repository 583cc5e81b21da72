#!/usr/bin/env bash
# Session 13, first device run.
#   ab_s13a_generate.txt  the shipped GPT's decode at context 1024 (calls of ~1 MB): flash_decode's serial threshold
#                         256 KB (working tree) against 1 MB (.gpu_stage/base), alternating processes, 3 rounds
#   s13a_profile_*.txt    where a decode token goes, context 1024, 16 threads, each tree
#   s13a_scaling_*.txt    nanoGPT-256's attention call (16,6,256,64), float32, causal: forward and backward on
#                         1, 8 and 16 threads, to see how the 16-thread call scales
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
nproc; uptime
TAG=s13a_generate ROUNDS=3 TL=100 CMD="benchmarks/bench_generate.py --threads 16 --contexts 1024 --impls flash --repeats 3" \
  KEEP="^\| [0-9]" ARGS="" bash benchmarks/device/device_ab.sh > /dev/null 2>&1
cat "$OUT/ab_s13a_generate.txt"
uptime
for tree in base new; do
  dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
  (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/profile_decode_step.py --context 1024 --threads 16 --steps 32) \
    > "$OUT/s13a_profile_$tree.txt" 2>&1
  grep -E "^## |flash_decode|scaled_dot|attention_with" "$OUT/s13a_profile_$tree.txt" | head -8
done
PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_attention.py --shapes 16,6,256,64 --impls flash --threads 1,8,16 \
  --causal on --dtype float32 --min-run-time 0.2 --rounds 2 > "$OUT/s13a_scaling_forward.txt" 2>&1
grep -E "flash|peak" "$OUT/s13a_scaling_forward.txt" | head -8
PYTHONPATH=$PWD timeout 100 python3 benchmarks/bench_backward.py --shapes 16,6,256,64 --threads 1,8,16 --causal on \
  --min-run-time 0.2 --rounds 2 > "$OUT/s13a_scaling_backward.txt" 2>&1
grep -E "flash|peak" "$OUT/s13a_scaling_backward.txt" | head -12
uptime
