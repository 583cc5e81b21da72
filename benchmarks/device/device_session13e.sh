#!/usr/bin/env bash
# Session 13, fifth device run: the bf16 backward's key runs adding their dQ to one sum per kv head in turn.
#   s13e_pytest.txt            test_backward under amx (bf16 one-pass kernel, chunked runs, thread-count bits)
#   ab_s13e_backward_bf16.txt  bench_backward.py --memory, bf16, the two shapes that take key runs on this machine,
#                              causal both, 1 and 16 threads: working tree against the previous commit, 2 rounds
#   s13e_backward_f32_t16.txt  float32 backward, issue 12's four shapes, 16 threads (cut by s13d's timeout)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
nproc; uptime
TAG=s13e_backward_bf16 ROUNDS=2 TL=120 CMD="benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 --threads 1,16 \
  --causal both --dtype bfloat16 --min-run-time 0.1 --rounds 1 --memory" KEEP="^\| .* \| bwd \| " ARGS="" \
  bash benchmarks/device/device_ab.sh > /dev/null 2>&1
cut -c1-100 "$OUT/ab_s13e_backward_bf16.txt"
uptime
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py -k "amx and not emulated" > "$OUT/s13e_pytest.txt" 2>&1
tail -1 "$OUT/s13e_pytest.txt"; grep -E "^FAILED" "$OUT/s13e_pytest.txt" | head -5
timeout 100 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --threads 16 --causal both --dtype float32 --min-run-time 0.1 --rounds 2 --memory > "$OUT/s13e_backward_f32_t16.txt" 2>&1
grep -E "^\| .* \| (bwd|fwd\+bwd) \| flash" "$OUT/s13e_backward_f32_t16.txt" | cut -c1-100
uptime
