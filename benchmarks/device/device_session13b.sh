#!/usr/bin/env bash
# Session 13, second device run: the closing figures of issues 9 and 10 on the current kernels (decode's serial
# threshold at 256 KB).
#   s13b_pytest.txt            test_kvcache, test_mask_decode, test_fast_path under amx
#   s13b_decode.txt            bench_decode.py: Llama heads 32/8, d 128, batch 1 and 8, 128-8192 keys, 1 and 16 threads
#   s13b_generate.txt          bench_generate.py: the shipped GPT, contexts 1024 and 2048, 1 and 16 threads
#   s13b_forward_lowp.txt      bench_attention.py --memory: bf16 and fp16 forward, issue 9's shapes, causal both
source benchmarks/device/preamble.sh
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py tests/test_mask_decode.py tests/test_fast_path.py \
  -k "amx and not emulated" > "$OUT/s13b_pytest.txt" 2>&1
tail -1 "$OUT/s13b_pytest.txt"; grep -E "^FAILED" "$OUT/s13b_pytest.txt" | head -5
timeout 150 python3 benchmarks/bench_decode.py --threads 1,16 --batches 1,8 --keys 128,1024,4096,8192 \
  --dtypes float32,bfloat16 --seconds 0.15 > "$OUT/s13b_decode.txt" 2>&1
grep -E "^\| [a-z]|probe" "$OUT/s13b_decode.txt" | awk -F"|" 'NF>8{printf "%s|%s|%s|%s|%s|%s\n",$2,$3,$4,$8,$9,$12} NF<=8{print}' | head -90
uptime
timeout 170 python3 benchmarks/bench_generate.py --threads 1,16 --contexts 1024,2048 --impls flash --repeats 3 \
  > "$OUT/s13b_generate.txt" 2>&1
grep -E "^\| [0-9]" "$OUT/s13b_generate.txt"
uptime
timeout 200 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype bfloat16,float16 --min-run-time 0.15 --rounds 2 --memory \
  > "$OUT/s13b_forward_lowp.txt" 2>&1
grep -E " flash |peak" "$OUT/s13b_forward_lowp.txt" | grep -v "^\[" | cut -c1-120 | head -90
uptime
