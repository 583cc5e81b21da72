#!/usr/bin/env bash
# Session 14, second device run: float32 forward on the AMX tiles in three bf16 parts (flash_bf16.cpp).
#   s14b_pytest_forward.txt    test_flash, test_masks, test_dropout, test_nonfinite (every ISA; float32 tests twice on
#                              amx: as chosen and forced onto the tiles) and test_backward's amx cases
#   s14b_probe_f32_tiles.txt   probe_f32_tiles.py: float32 FMAs against the tiles and SDPA, d = 64, 96, 128
#   s14b_forward_f32.txt       bench_attention.py, float32, issue 9's shapes (d = 128 now on the tiles)
source benchmarks/device/preamble.sh
timeout 240 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_dropout.py tests/test_nonfinite.py \
  > "$OUT/s14b_pytest_forward.txt" 2>&1
tail -1 "$OUT/s14b_pytest_forward.txt"; grep -E "^FAILED" "$OUT/s14b_pytest_forward.txt" | head -5
timeout 150 python3 -m pytest -q tests/test_backward.py -k amx >> "$OUT/s14b_pytest_forward.txt" 2>&1
tail -1 "$OUT/s14b_pytest_forward.txt"; grep -E "^FAILED" "$OUT/s14b_pytest_forward.txt" | head -5
uptime
timeout 150 python3 benchmarks/probe_f32_tiles.py --shapes 1,12,1024,64 1,8,2048,96 1,16,2048,128 --threads 1,16 \
  --causal both --rounds 3 --min-time 0.15 > "$OUT/s14b_probe_f32_tiles.txt" 2>&1
grep "^|" "$OUT/s14b_probe_f32_tiles.txt"
timeout 170 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype float32 --min-run-time 0.15 --rounds 2 > "$OUT/s14b_forward_f32.txt" 2>&1
grep -E " flash |peak" "$OUT/s14b_forward_f32.txt" | grep -v "^\[" | cut -c1-110 | head -20
uptime
