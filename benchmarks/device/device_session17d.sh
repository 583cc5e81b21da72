#!/usr/bin/env bash
# Session 17, fourth device run: the final code's amx cases of test_flash (with test_logits_far_below_zero), and issue
# 11's last cell — BERT 32 x 128 float32 — on this session's host type (16 cores of one thread).
#   s17d_pytest.txt            test_flash, amx cases
#   s17d_models_bert_f32.txt   bench_models.py --models bert, 32 x 128, float32, 1 and 16 threads, 3 processes
#   s17d_bert_heap.txt         probe_bert_heap.py: faults a forward and glibc's heap, ours vs SDPA, 16 threads
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo
timeout 120 python3 -m pytest -q tests/test_flash.py -k "amx and not emulated" > "$OUT/s17d_pytest.txt" 2>&1
tail -1 "$OUT/s17d_pytest.txt"; grep -E "^FAILED" "$OUT/s17d_pytest.txt" | head -5
for round in 1 2 3; do
  echo "== round $round"
  timeout 150 python3 benchmarks/bench_models.py --models bert --batch 32 --seq 128 --repeats 7 --threads 16,1 \
    --dtype float32 2>&1 | grep -E "^\| bert|^\| model"
done | tee "$OUT/s17d_models_bert_f32.txt"
for round in 1 2; do
  timeout 60 python3 benchmarks/probe_bert_heap.py cs149gpt 16 2>&1 | tail -1 | sed "s/^/ours /"
  timeout 60 python3 benchmarks/probe_bert_heap.py sdpa 16 2>&1 | tail -1 | sed "s/^/sdpa /"
done | tee "$OUT/s17d_bert_heap.txt"
uptime
