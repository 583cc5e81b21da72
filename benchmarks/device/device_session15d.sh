#!/usr/bin/env bash
# Session 15, fourth device run: the forward's masked blocks added straight from the mask rows (no offsets buffer),
# A/B against the previous commit (.gpu_stage/base), and issue 9's two bf16 cells under 1.5x again with 5 rounds.
#   s15d_pytest.txt              test_masks, test_dropout, test_flash: the amx cases
#   ab_s15d_t5.txt               sweep_model_shapes.py --only t5 (a (1, H, N, N) additive bias), base vs new, 3 rounds
#   s15d_forward_bf16_cells.txt  bench_attention.py: bf16 (1,16,4096,128) one thread, (1,12,1024,64) 16 threads
source benchmarks/device/preamble.sh
timeout 150 python3 -m pytest -q tests/test_masks.py tests/test_dropout.py tests/test_flash.py -k "amx and not emulated" \
  > "$OUT/s15d_pytest.txt" 2>&1
tail -1 "$OUT/s15d_pytest.txt"; grep -E "^FAILED" "$OUT/s15d_pytest.txt" | head -5
TAG=s15d_t5 ROUNDS=3 TL=90 CMD="benchmarks/sweep_model_shapes.py --rounds 1 --min-time 0.2 --only t5" \
  ARGS="--threads 1,16" KEEP="^\| t5" bash benchmarks/device/device_ab.sh | cut -d'|' -f6,7,9,10,11
uptime
timeout 120 python3 benchmarks/bench_attention.py --shapes 1,16,4096,128 --threads 1 --causal off --dtype bfloat16 \
  --impls flash --min-run-time 0.3 --rounds 5 > "$OUT/s15d_forward_bf16_cells.txt" 2>&1
timeout 60 python3 benchmarks/bench_attention.py --shapes 1,12,1024,64 --threads 16 --causal off --dtype bfloat16 \
  --impls flash --min-run-time 0.3 --rounds 5 >> "$OUT/s15d_forward_bf16_cells.txt" 2>&1
grep -E " (sdpa|flash) " "$OUT/s15d_forward_bf16_cells.txt" | grep -v "^\[" | cut -c1-100
uptime
