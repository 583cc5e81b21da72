#!/usr/bin/env bash
# Session 11, third device run: A/B of the float32 one-pass backward's per-task work in vectors (D = rowsum(dO ∘ O)
# with dot(), K_jᵀ and V_jᵀ packed 16 × 16 through registers; bf16's D likewise) against the commit before it
# (.gpu_stage/base), alternating processes (device_ab.sh); then the training table on the new code.
#   ab_s11c_backward.txt   bench_backward.py, the backward alone and fwd+bwd, ours and SDPA, 3 rounds per tree
#   ab_s11c_train.txt      bench_train.py, nano256 and shipped, fp32 and autocast, 16 threads, 2 rounds per tree
set -uo pipefail
export CS149GPT_NO_CUDA=1
CMD="benchmarks/bench_backward.py --rounds 1 --min-run-time 0.25" KEEP="bwd|fwd\+bwd" TAG=s11c_backward ROUNDS=3 TL=80 \
  ARGS="--shapes 16,6,256,64 1,4,1024,32 1,12,1024,64 --threads 1,16 --causal both" bash benchmarks/device/device_ab.sh > /dev/null
grep -E "round|flash" ${OUT:-/tmp/cs149gpt-device}/ab_s11c_backward.txt | grep -v "fwd+bwd" | head -80
CMD="benchmarks/bench_train.py --configs nano256,shipped --precisions fp32,autocast --threads 16 --steps 8" KEEP="^train" \
  TAG=s11c_train ROUNDS=2 TL=120 ARGS="" bash benchmarks/device/device_ab.sh
