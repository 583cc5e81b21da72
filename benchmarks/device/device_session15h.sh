#!/usr/bin/env bash
# Session 15, eighth device run: the bf16 forward's new default tiles on AMX (256 x 1024, were 128 x 512) against the
# previous commit (.gpu_stage/base), and the finfo.min fix of the bf16 backward, under real AMX.
#   s15h_pytest.txt          test_flash, test_masks, test_dropout, test_backward: the amx cases
#   ab_s15h_bf16.txt         bench_attention.py bf16, issue 9's four shapes, 1 and 16 threads, causal both, 3 rounds
#   s15h_forward_fp16.txt    bench_attention.py fp16 (the same kernel and tiles), new tree only
source benchmarks/device/preamble.sh
timeout 200 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_dropout.py tests/test_backward.py \
  -k "amx and not emulated" > "$OUT/s15h_pytest.txt" 2>&1
tail -1 "$OUT/s15h_pytest.txt"; grep -E "^FAILED" "$OUT/s15h_pytest.txt" | head -5
TAG=s15h_bf16 ROUNDS=3 TL=100 ARGS="--shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 --dtype bfloat16 \
  --threads 1,16 --causal both --min-run-time 0.15" bash benchmarks/device/device_ab.sh | grep -E "==| flash " | cut -c1-90
timeout 100 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --dtype float16 --threads 1,16 --causal both --min-run-time 0.15 --rounds 2 > "$OUT/s15h_forward_fp16.txt" 2>&1
grep -E " flash " "$OUT/s15h_forward_fp16.txt" | grep -v "^\[" | cut -c1-90
uptime
