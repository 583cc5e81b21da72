#!/usr/bin/env bash
# One device-host run for issue 12 (session 4), within ~7 minutes: build; a few backward tests under amx; the backward
# benchmark (fwd, bwd, fwd+bwd vs SDPA) in float32 and bf16 on 16 threads (the four shapes) and on 1 thread
# ((1,12,1024,64) and (1,16,4096,128)); the training step on 16 threads (shipped, nano256; fp32, autocast); a
# torch.profiler breakdown of nano256's fp32 step; the backward's time for other tile sizes (bench_backward_tiles.py).
# Each step has its own time limit; files land in $OUT as they are written.
#   run: CS149GPT_NO_CUDA=1 bash benchmarks/device/device_backward_session4.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
log() { echo "[$(date -u +%T)] $*" | tee -a "$OUT/console.txt"; }
log build
python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -2 | tee -a "$OUT/console.txt"
log tests
timeout 30 python3 -m pytest -q -p no:cacheprovider tests/test_backward.py \
  -k "laid_out or opcheck_flash_attention_backward or (amx and thread_count)" > "$OUT/pytest.txt" 2>&1
tail -1 "$OUT/pytest.txt" | tee -a "$OUT/console.txt"
SHAPES16="1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128"
{
  for dtype in float32 bfloat16; do
    log "bwd t16 $dtype"
    timeout 50 python3 benchmarks/bench_backward.py --shapes $SHAPES16 --threads 16 --causal both --dtype $dtype \
      --rounds 1 --min-run-time 0.1
  done
} > "$OUT/backward_t16.txt" 2>&1
log train
timeout 50 python3 benchmarks/bench_train.py --configs shipped,nano256 --precisions fp32,autocast --threads 16 \
  --steps 7 --warmup 2 > "$OUT/train_t16.txt" 2>&1
cat "$OUT/train_t16.txt" >> "$OUT/console.txt"
{
  for dtype in float32 bfloat16; do
    log "bwd t1 $dtype"
    timeout 40 python3 benchmarks/bench_backward.py --shapes 1,12,1024,64 1,16,4096,128 --threads 1 --causal both \
      --dtype $dtype --rounds 1 --min-run-time 0.1
  done
} > "$OUT/backward_t1.txt" 2>&1
log tiles
{
  timeout 30 python3 benchmarks/bench_backward_tiles.py --shapes 1,16,4096,128 --threads 16 --dtype float32 \
    --tiles 96x96 96x192 48x192 192x96 192x192 96x288 --rounds 2
  timeout 20 python3 benchmarks/bench_backward_tiles.py --shapes 1,16,4096,128 --threads 16 --dtype bfloat16 \
    --tiles 64x256 32x256 128x128 64x512 --rounds 2
  timeout 15 python3 benchmarks/bench_backward_tiles.py --shapes 4,12,2048,64 --threads 16 --dtype float32 \
    --tiles 96x192 48x192 192x192 --rounds 2
} > "$OUT/backward_tiles.txt" 2>&1
log profile
timeout 25 python3 benchmarks/profile_train.py --config nano256 --precision fp32 --threads 16 --steps 2 \
  > "$OUT/profile_train.txt" 2>&1
log done
