#!/usr/bin/env bash
# Session 15, first device run: the one-pass backward with windows, key ranges and dropout under real AMX, and the
# attention calls of popular models (benchmarks/sweep_model_shapes.py), ours against torch's SDPA, same run.
#   s15a_pytest.txt              test_masks, test_dropout, test_backward: the amx cases
#   s15a_sweep_forward.txt       sweep_model_shapes.py: forward, float32 and bf16, 1 and 16 threads
#   s15a_sweep_backward.txt      the same, forward + backward (the shapes a 1-thread step takes seconds at left out)
source benchmarks/device/preamble.sh
timeout 200 python3 -m pytest -q tests/test_masks.py tests/test_dropout.py tests/test_backward.py -k "amx and not emulated" \
  > "$OUT/s15a_pytest.txt" 2>&1
tail -1 "$OUT/s15a_pytest.txt"; grep -E "^FAILED" "$OUT/s15a_pytest.txt" | head -5
uptime
timeout 170 python3 benchmarks/sweep_model_shapes.py --threads 1,16 --dtype float32,bfloat16 --rounds 3 --min-time 0.1 \
  > "$OUT/s15a_sweep_forward.txt" 2>&1
cut -d'|' -f2,6,7,11,12 "$OUT/s15a_sweep_forward.txt" | tail -n +4
uptime
timeout 170 python3 benchmarks/sweep_model_shapes.py --backward --threads 1,16 --dtype float32,bfloat16 --rounds 2 \
  --min-time 0.1 --only bert,vit,gpt2,qwen,phi,gemma,cross,whisper,t5 > "$OUT/s15a_sweep_backward.txt" 2>&1
cut -d'|' -f2,6,7,11,12 "$OUT/s15a_sweep_backward.txt" | tail -n +4
uptime
