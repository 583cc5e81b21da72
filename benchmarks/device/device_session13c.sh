#!/usr/bin/env bash
# Session 13, third device run: the closing figures of issues 9 (float32), 11 and 12 on the current kernels.
#   s13c_forward_f32.txt       bench_attention.py: float32 forward, issue 9's shapes, causal both, 1 and 16 threads
#   s13c_models_bf16.txt       bench_models.py: HF Llama / GPT-2 / BERT, bf16, 1 and 16 threads (no torch.compile)
#   s13c_models_bert_f32.txt   bench_models.py: BERT 32 x 128, float32, 1 and 16 threads
#   s13c_train.txt             bench_train.py: shipped model and nanoGPT-256, float32 and autocast, 1 and 16 threads
source benchmarks/device/preamble.sh
timeout 170 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype float32 --min-run-time 0.15 --rounds 2 > "$OUT/s13c_forward_f32.txt" 2>&1
grep -E " flash |peak" "$OUT/s13c_forward_f32.txt" | grep -v "^\[" | cut -c1-110 | head -20
uptime
timeout 150 python3 benchmarks/bench_models.py --dtype bfloat16 --threads 1,16 --repeats 3 > "$OUT/s13c_models_bf16.txt" 2>&1
grep -E "^\| [a-z]" "$OUT/s13c_models_bf16.txt"
timeout 60 python3 benchmarks/bench_models.py --dtype float32 --threads 1,16 --models bert --batch 32 --seq 128 --repeats 4 \
  > "$OUT/s13c_models_bert_f32.txt" 2>&1
grep -E "^\| [a-z]" "$OUT/s13c_models_bert_f32.txt"
uptime
timeout 150 python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast --threads 16,1 \
  --steps 4 --warmup 1 > "$OUT/s13c_train.txt" 2>&1
grep -E "^train|x SDPA|×" "$OUT/s13c_train.txt" | head -20
uptime
