#!/usr/bin/env bash
# Session 15, twelfth device run: no regression of the unmasked backward from this session's one-pass changes
# (mask, window, dropout branches): A/B against the session's starting commit 193f9d7 (.gpu_stage/base), issue 12's
# (1,12,1024,64) and (1,16,4096,128), non-causal, 1 and 16 threads, float32 and bf16, 2 rounds.
#   ab_s15l_bwd_{f32,bf16}.txt   bench_backward.py rows (bwd, fwd+bwd), base vs new
source benchmarks/device/preamble.sh
for dt in float32 bfloat16; do
  tag=$([ $dt = float32 ] && echo f32 || echo bf16)
  TAG=s15l_bwd_$tag ROUNDS=2 TL=120 CMD="benchmarks/bench_backward.py --min-run-time 0.15 --rounds 1" \
    KEEP="^\| .* \| (bwd|fwd\+bwd) \| " ARGS="--shapes 1,12,1024,64 1,16,4096,128 --threads 1,16 --causal off \
    --dtype $dt" bash benchmarks/device/device_ab.sh | cut -c1-140
done
uptime
