#!/usr/bin/env bash
# Session 15, ninth device run: the closing figures of what changed — the bf16 forward's peak memory with its new
# tiles (issue 9 reports it), and the whole-model Llama bf16 cells (issue 11) on the new tiles, 16 threads.
#   s15i_forward_bf16_memory.txt   bench_attention.py --memory, bf16, issue 9's four shapes, 1 and 16 threads
#   s15i_models_llama_t16.txt      bench_models.py --models llama, bf16, 16 threads, 5 rounds
source benchmarks/device/preamble.sh
timeout 150 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --dtype bfloat16 --threads 1,16 --causal off --min-run-time 0.15 --rounds 2 --memory \
  > "$OUT/s15i_forward_bf16_memory.txt" 2>&1
grep -E " (sdpa|flash) " "$OUT/s15i_forward_bf16_memory.txt" | grep -v "^\[" | cut -c1-120
timeout 240 python3 benchmarks/bench_models.py --models llama --dtype bfloat16 --threads 16 --repeats 5 \
  > "$OUT/s15i_models_llama_t16.txt" 2>&1
grep "^|" "$OUT/s15i_models_llama_t16.txt" | tail -n +3
uptime
