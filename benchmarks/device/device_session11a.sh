#!/usr/bin/env bash
# Session 11, first run on the device host: the bf16 AMX forward with O kept in tile registers (flash_bf16.cpp,
# query_tile_o_in_tiles) against the general path, then its tests on the hardware, then issue 9's bf16 table.
# That path measured 0.64-0.89x of the general path's speed and was reverted: the kernel, set_o_in_tiles() and
# benchmarks/probe_o_in_tiles.py live in commit e53d1e2 only (git checkout e53d1e2 to run this again).
#   s11a_probe_o_in_tiles.txt  probe_o_in_tiles.py: O in tiles vs general vs SDPA, issue 9's d <= 64 shapes, 1/16 threads
#   s11a_pytest.txt            test_flash, test_nonfinite, test_attention under amx and amx_emulated
#   s11a_forward_bf16.txt      bench_attention.py, bf16, issue 9's four shapes, causal both, 1 and 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 150 python3 benchmarks/probe_o_in_tiles.py --rounds 4 > "$OUT/s11a_probe_o_in_tiles.txt" 2>&1
cat "$OUT/s11a_probe_o_in_tiles.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_nonfinite.py tests/test_attention.py \
  -k amx > "$OUT/s11a_pytest.txt" 2>&1
tail -2 "$OUT/s11a_pytest.txt"; grep -E "^FAILED" "$OUT/s11a_pytest.txt" | head -10
timeout 200 python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 \
  --impls flash --threads 1,16 --causal both --dtype bfloat16 --rounds 2 --min-run-time 0.2 \
  > "$OUT/s11a_forward_bf16.txt" 2>&1
grep -E "flash|peak" "$OUT/s11a_forward_bf16.txt" | head -40
