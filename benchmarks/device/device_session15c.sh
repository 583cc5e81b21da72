#!/usr/bin/env bash
# Session 15, third device run: every backward call on the one-pass kernels (attn_mask read a tile pair / strip at a
# time; windows, key ranges, dropout), under real AMX, and what it does for models that train with masks and dropout.
#   s15c_pytest.txt             test_masks, test_dropout, test_backward, test_nonfinite: the amx cases
#   s15c_sweep_backward.txt     sweep_model_shapes.py --backward: the calls that read a mask or have few kv heads
#   s15c_sweep_dropout.txt      the same with dropout_p 0.1 (torch's SDPA then takes its math path)
#   s15c_models_train_{f32,bf16}.txt  bench_models.py: GPT-2 and BERT training steps (padded, dropout 0.1), 1/16 threads
source benchmarks/device/preamble.sh
timeout 230 python3 -m pytest -q tests/test_masks.py tests/test_dropout.py tests/test_backward.py tests/test_nonfinite.py \
  -k "amx and not emulated" > "$OUT/s15c_pytest.txt" 2>&1
tail -1 "$OUT/s15c_pytest.txt"; grep -E "^FAILED" "$OUT/s15c_pytest.txt" | head -5
timeout 120 python3 benchmarks/sweep_model_shapes.py --backward --threads 1,16 --dtype float32,bfloat16 --rounds 3 \
  --min-time 0.1 --only t5,gemma,bert-base,vit > "$OUT/s15c_sweep_backward.txt" 2>&1
cut -d'|' -f2,6,7,11,12 "$OUT/s15c_sweep_backward.txt" | tail -n +4
timeout 90 python3 benchmarks/sweep_model_shapes.py --backward --dropout 0.1 --threads 1,16 --dtype float32,bfloat16 \
  --rounds 2 --min-time 0.1 --only bert-base,gpt2 > "$OUT/s15c_sweep_dropout.txt" 2>&1
cut -d'|' -f2,6,7,11,12 "$OUT/s15c_sweep_dropout.txt" | tail -n +4
uptime
for dt in float32 bfloat16; do
  tag=$([ $dt = float32 ] && echo f32 || echo bf16)
  timeout 100 python3 benchmarks/bench_models.py --models gpt2,bert --threads 1,16 --dtype $dt --repeats 3 \
    > "$OUT/s15c_models_train_$tag.txt" 2>&1
  grep "^|" "$OUT/s15c_models_train_$tag.txt" | tail -n +3
done
uptime
