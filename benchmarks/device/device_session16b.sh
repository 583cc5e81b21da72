#!/usr/bin/env bash
# Session 16, second device run: the first run's per-task packing moved BERT's 128-token workspace (10 MB of packed K,
# in a kept mapping from 4 MB up) down to ~2 MB, into glibc's heap; workspaces now take the kept mapping from 64 KB.
# A/B against the session's starting commit (.gpu_stage/base), BERT 32 x 128 float32 on 16 threads (issue 11).
#   ab_s16b_bert_f32.txt         bench_models.py --models bert, 32 x 128, float32, 16 threads, base vs new, 4 rounds
#   s16b_bert_heap.txt           probe_bert_heap.py: faults a forward and glibc's heap, base vs new vs SDPA
#   ab_s16b_sweep_short.txt      sweep_model_shapes.py --only bert,vit: the calls' own time, base vs new
source benchmarks/device/preamble.sh
TAG=s16b_bert_f32 ROUNDS=4 TL=150 CMD="benchmarks/bench_models.py --models bert --batch 32 --seq 128 --repeats 7" \
  KEEP="^\| bert" ARGS="--threads 16 --dtype float32" bash benchmarks/device/device_ab.sh
for round in 1 2 3; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/probe_bert_heap.py cs149gpt 16 2>&1 | tail -1 | sed "s/^/$tree /")
  done
  timeout 60 python3 benchmarks/probe_bert_heap.py sdpa 16 2>&1 | tail -1 | sed "s/^/sdpa /"
done | tee "$OUT/s16b_bert_heap.txt"
TAG=s16b_sweep_short ROUNDS=2 TL=100 CMD="benchmarks/sweep_model_shapes.py --rounds 3 --min-time 0.1" \
  KEEP="^\| [a-z]" ARGS="--only bert,vit --threads 1,16 --dtype float32,bfloat16" bash benchmarks/device/device_ab.sh \
  | cut -d'|' -f2,6,7,11,12
uptime
