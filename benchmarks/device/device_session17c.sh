#!/usr/bin/env bash
# Session 17, third device run: the query tile chosen by a model of how the threads share the tasks
# (flash_common.h balanced_query_tile) against the previous rule (≥ 4 tasks a thread), on 16 threads, where small
# calls have few tasks a thread; A/B against the previous commit (.gpu_stage/base, carried), pairwise ratios.
#   ab_s17c_t16.txt            pairwise_ratio.py, 16 threads, float32 / bfloat16 / float16, causal both, 2 rounds
#   s17c_tiles_t16.txt         tile_sweep.py, 16 threads, (1,12,1024,64) and (1,4,1024,32), block_q sweep
source benchmarks/device/preamble.sh
(cd .gpu_stage/base && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('base', cs149gpt.isa())" 2>&1 | tail -1)
timeout 120 python3 -m pytest -q tests/test_flash.py -k "amx and not emulated" 2>&1 | tail -1
for round in 1 2; do
  for tree in base new; do
    dir=$PWD; [ $tree = base ] && dir=$PWD/.gpu_stage/base
    for dtype in float32 bfloat16 float16; do
      echo "== round $round $tree $dtype"
      (cd $dir && PYTHONPATH=$dir timeout 60 python3 benchmarks/pairwise_ratio.py --dtype $dtype --threads 16 \
        --causal both --pairs 15 --min-time 0.02 --shapes 1,4,1024,32 1,12,1024,64 1,8,1500,64 1,32,512,128 2>&1 \
        | grep -E "^\| [0-9]|^# probes")
    done
  done
done 2>&1 | tee "$OUT/ab_s17c_t16.txt" | grep -v probes
for dtype in float32 bfloat16; do
  bq=48,96,144,192; [ $dtype = bfloat16 ] && bq=64,128,192,256
  timeout 100 python3 benchmarks/tile_sweep.py --dtype $dtype --shapes 1,12,1024,64 1,4,1024,32 --block-q none,$bq \
    --block-k 1024 --threads 16 --repeats 5 --rounds 3 --all >> "$OUT/s17c_tiles_t16.txt" 2>&1
done
grep -E "^[0-9#]|block_k" "$OUT/s17c_tiles_t16.txt"
uptime
