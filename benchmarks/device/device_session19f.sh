#!/usr/bin/env bash
# Session 19, sixth device run: the two cells its closing note gives as blocked, on the session's final code.
#   s19f_pairwise_float32_t1.txt  issue 9: pairwise_ratio.py float32, 1 thread, causal both, 9 pairs, after a minute
#                                 of warm-up (s19a's host was still settling)
#   s19f_models_bert_f32.txt      issue 11: bench_models.py --models bert, 32 x 128, float32, 16 and 1 threads, 2 rounds
source benchmarks/device/preamble.sh
grep -m1 "^model\s" /proc/cpuinfo
timeout 60 python3 benchmarks/pairwise_ratio.py --dtype float32 --threads 1 --shapes 1,12,1024,64 --causal off \
  --pairs 9 > /dev/null 2>&1
timeout 260 python3 benchmarks/pairwise_ratio.py --dtype float32 --threads 1 --causal both --pairs 9 2>&1 \
  | tee "$OUT/s19f_pairwise_float32_t1.txt"
for round in 1 2; do
  echo "== round $round"
  timeout 150 python3 benchmarks/bench_models.py --models bert --batch 32 --seq 128 --repeats 7 --threads 16,1 \
    --dtype float32 2>&1 | grep -E "^\| bert|^\| model"
done | tee "$OUT/s19f_models_bert_f32.txt"
uptime
