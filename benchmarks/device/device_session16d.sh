#!/usr/bin/env bash
# Session 16, fourth device run: the final code under real AMX, and whether Whisper's float32 encoder call (1500
# tokens; 0.99x SDPA on one thread in s16a, 1.10 in session 15 before the 192 x 1024 float32 tiles) wants other tiles.
#   s16d_pytest.txt              test_flash, test_masks, test_nonfinite, test_dropout, test_backward: the amx cases
#   s16d_tiles_whisper_t1.txt    tile_sweep.py float32 (1,8,1500,64), one thread, block_q 96/192 x block_k 512/1024
source benchmarks/device/preamble.sh
timeout 300 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_nonfinite.py tests/test_dropout.py \
  tests/test_backward.py -k "amx and not emulated" > "$OUT/s16d_pytest.txt" 2>&1
tail -1 "$OUT/s16d_pytest.txt"; grep -E "^FAILED" "$OUT/s16d_pytest.txt" | head -5
timeout 150 python3 benchmarks/tile_sweep.py --dtype float32 --shapes 1,8,1500,64 1,12,1024,64 --block-q none,96,192 \
  --block-k 512,1024 --threads 1 --repeats 3 --rounds 3 --all > "$OUT/s16d_tiles_whisper_t1.txt" 2>&1
grep -E "^[0-9]|block_k" "$OUT/s16d_tiles_whisper_t1.txt"
uptime
