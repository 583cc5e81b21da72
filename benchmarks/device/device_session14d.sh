#!/usr/bin/env bash
# Session 14, fourth device run: the final float32-on-tiles code (opt-in) and float16 (its products back in the
# k-step order of session 13, bitwise).
#   s14d_pytest.txt            test_flash, test_masks, test_dropout, test_nonfinite, test_kvcache; test_backward's amx
#   s14d_forward_f16.txt       bench_attention.py, float16, two of issue 9's shapes, 1 and 16 threads
#   s14d_probe_f32_tiles.txt   probe_f32_tiles.py at (1,16,4096,128), one thread: FMAs, tiles, SDPA
source benchmarks/device/preamble.sh
timeout 260 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_dropout.py tests/test_nonfinite.py \
  tests/test_kvcache.py > "$OUT/s14d_pytest.txt" 2>&1
tail -1 "$OUT/s14d_pytest.txt"; grep -E "^FAILED" "$OUT/s14d_pytest.txt" | head -5
timeout 120 python3 -m pytest -q tests/test_backward.py -k amx >> "$OUT/s14d_pytest.txt" 2>&1
tail -1 "$OUT/s14d_pytest.txt"; grep -E "^FAILED" "$OUT/s14d_pytest.txt" | head -5
uptime
timeout 100 python3 benchmarks/bench_attention.py --shapes 1,12,1024,64 1,16,4096,128 --impls flash --threads 1,16 \
  --causal off --dtype float16 --min-run-time 0.15 --rounds 2 > "$OUT/s14d_forward_f16.txt" 2>&1
grep -E " flash " "$OUT/s14d_forward_f16.txt" | grep -v "^\[" | cut -c1-110
timeout 150 python3 benchmarks/probe_f32_tiles.py --shapes 1,16,4096,128 --threads 1 --causal both --rounds 2 \
  --min-time 0.1 > "$OUT/s14d_probe_f32_tiles.txt" 2>&1
grep "^|" "$OUT/s14d_probe_f32_tiles.txt"
uptime
