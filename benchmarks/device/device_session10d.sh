#!/usr/bin/env bash
# Session 10, fourth run on the device host: issue 9's forward table on the code with 512-key AMX tiles (bf16, fp16;
# float32 beside them), and the bf16 backward's tiles at d <= 64 (default 128 x 128 against longer key tiles),
# interleaved in rounds.
#   s10d_forward.txt         bench_attention.py, the four shapes, causal both, 3 dtypes, 1 and 16 threads
#   s10d_bwd_tiles_t1.txt    bench_backward_tiles.py, bf16, 1 thread
#   s10d_bwd_tiles_t16.txt   the same, 16 threads
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout ${TL_FWD:-240} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
  1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
  --min-run-time ${MIN_RUN:-0.3} --rounds ${ROUNDS:-2} > "$OUT/s10d_forward.txt" 2>&1
grep -E " flash |peak" "$OUT/s10d_forward.txt"
for threads in 1 16; do
  timeout 150 python3 benchmarks/bench_backward_tiles.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    --tiles 128x128 128x256 64x256 128x512 --threads $threads --causal both --dtype bfloat16 --rounds 2 \
    --min-run-time 0.2 > "$OUT/s10d_bwd_tiles_t$threads.txt" 2>&1
  grep -vE "^#|^$" "$OUT/s10d_bwd_tiles_t$threads.txt" | tail -40
done
