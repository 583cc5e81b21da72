#!/usr/bin/env bash
# Session 16, third device run: the float32 one-pass backward splits an MQA/GQA group's query heads into parts
# (module.cpp head_parts), so Gemma-2B's 8 heads on 1 kv head take one pass (8 runs x 8 parts) where they took two.
# A/B against the previous commit (.gpu_stage/base): the popular models' forward + backward calls with GQA/MQA.
#   s16c_pytest.txt              test_backward.py: the amx cases (head parts, thread-count bits, every path)
#   ab_s16c_sweep_gqa.txt        sweep_model_shapes.py --backward --only gemma,llama,qwen: float32, 1/16 threads
source benchmarks/device/preamble.sh
timeout 150 python3 -m pytest -q tests/test_backward.py -k "amx and not emulated" > "$OUT/s16c_pytest.txt" 2>&1
tail -1 "$OUT/s16c_pytest.txt"; grep -E "^FAILED" "$OUT/s16c_pytest.txt" | head -5
TAG=s16c_sweep_gqa ROUNDS=2 TL=120 CMD="benchmarks/sweep_model_shapes.py --backward --rounds 3 --min-time 0.1" \
  KEEP="^\| [a-z]" ARGS="--only gemma,llama3-8b,qwen --threads 1,16 --dtype float32" bash benchmarks/device/device_ab.sh \
  | cut -d'|' -f2,3,6,7,11,12
uptime
