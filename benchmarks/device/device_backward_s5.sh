#!/usr/bin/env bash
# One device-host run for issue 12, session 5 (the backward's default tiles), within ~7 minutes: build; the backward
# tests on amx (tests/test_backward.py, the amx cases and those without an ISA); attention's peak backward memory
# ours vs SDPA at the four shapes (bench_train.py --memory, 16 threads); the backward benchmark (fwd, bwd, fwd+bwd
# vs SDPA) at the four shapes on 16 threads, float32 and bf16; the new default tiles against the old ones
# (bench_backward_tiles.py); two shapes on 1 thread. Each step has its own time limit; files land in $OUT as
# s5_backward_*.txt as they are written.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_backward_s5.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
CONSOLE="$OUT/s5_backward_console.txt"
log() { echo "[$(date -u +%T)] $*" | tee -a "$CONSOLE"; }
log "build (commit $(cat COMMIT 2>/dev/null || echo unknown))"
python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -2 | tee -a "$CONSOLE"
log tests
# -k: the amx-parametrised tests and the ISA-free ones (the dev box runs the other ISAs; "avx512" also drops avx512_bf16)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py -k "not (avx512 or avx2 or scalar)" \
  > "$OUT/s5_backward_pytest.txt" 2>&1
tail -1 "$OUT/s5_backward_pytest.txt" | tee -a "$CONSOLE"; grep -E "^FAILED" "$OUT/s5_backward_pytest.txt" | head | tee -a "$CONSOLE"
SHAPES="1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128"
log memory
timeout 45 python3 benchmarks/bench_train.py --no-train --memory --memory-threads 16 --shapes $SHAPES \
  > "$OUT/s5_backward_memory.txt" 2>&1
for dtype in float32 bfloat16; do
  log "bwd t16 $dtype"
  timeout 50 python3 benchmarks/bench_backward.py --shapes $SHAPES --threads 16 --causal both --dtype $dtype \
    --rounds 1 --min-run-time 0.1 > "$OUT/s5_backward_t16_$dtype.txt" 2>&1
done
log tiles
{
  timeout 20 python3 benchmarks/bench_backward_tiles.py --shapes 1,16,4096,128 --threads 16 --dtype bfloat16 \
    --tiles 64x128 64x256 --rounds 2
  timeout 20 python3 benchmarks/bench_backward_tiles.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 --threads 16 \
    --dtype float32 --tiles 96x96 96x192 --rounds 2
} > "$OUT/s5_backward_tiles.txt" 2>&1
{
  log "bwd t1 bfloat16"
  timeout 35 python3 benchmarks/bench_backward.py --shapes 1,12,1024,64 1,16,4096,128 --threads 1 --causal both \
    --dtype bfloat16 --rounds 1 --min-run-time 0.1
  log "bwd t1 float32"
  timeout 30 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 --threads 1 --causal both \
    --dtype float32 --rounds 1 --min-run-time 0.1
} > "$OUT/s5_backward_t1.txt" 2>&1
log done
