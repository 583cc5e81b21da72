#!/usr/bin/env bash
# Session 16, first device run: float32 forward tasks that pack their own key tiles (flash.cpp, pack_in_task: one
# query tile a head, no GQA group) against the previous commit (.gpu_stage/base), on BERT 32 x 128 (issue 11's last
# cell: float32, 16 threads, 0.92x SDPA in session 13), and the popular models' forward calls on the new code.
#   ab_s16a_bert_f32.txt         bench_models.py --models bert, 32 x 128, float32, 16 threads, base vs new, 3 rounds
#   s16a_bert_heap.txt           probe_bert_heap.py: faults a forward and glibc's heap, base vs new vs SDPA
#   s16a_sweep_forward.txt       sweep_model_shapes.py: forward, float32 and bf16, 1 and 16 threads (new)
source benchmarks/device/preamble.sh
TAG=s16a_bert_f32 ROUNDS=3 TL=150 CMD="benchmarks/bench_models.py --models bert --batch 32 --seq 128 --repeats 5" \
  KEEP="^\| bert" ARGS="--threads 16 --dtype float32" bash benchmarks/device/device_ab.sh
for round in 1 2; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/probe_bert_heap.py cs149gpt 16 2>&1 | tail -1 | sed "s/^/$tree /")
  done
  timeout 60 python3 benchmarks/probe_bert_heap.py sdpa 16 2>&1 | tail -1 | sed "s/^/sdpa /"
done | tee "$OUT/s16a_bert_heap.txt"
uptime
timeout 200 python3 benchmarks/sweep_model_shapes.py --threads 1,16 --dtype float32,bfloat16 --rounds 3 --min-time 0.1 \
  > "$OUT/s16a_sweep_forward.txt" 2>&1
cut -d'|' -f2,6,7,11,12 "$OUT/s16a_sweep_forward.txt" | tail -n +4
uptime
