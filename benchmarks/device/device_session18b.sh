#!/usr/bin/env bash
# Session 18, second device run: where a small call's time goes on 16 threads, base (e07969f) against the packing
# in chunks of about eight a thread, taken dynamically; with the last thread's arrival and each thread's packing time
# (instrument_phases.py), and the query tile forced to a few sizes (the tiles phase's balance).
#   s18b_phases.txt      phase_times.py, 16 threads, non-causal
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
OUT=${OUT:-/tmp/cs149gpt-device}; mkdir -p "$OUT"
for tree in base new; do
  src=$PWD; [ $tree = base ] && src=$PWD/.gpu_stage/base
  dst=$PWD/.gpu_stage/phase_$tree
  mkdir -p "$dst" && (cd "$src" && tar --exclude=.gpu_stage --exclude=build --exclude=.git -cf - .) | tar -xf - -C "$dst"
  python3 benchmarks/device/instrument_phases.py "$dst"
done
for dir in .gpu_stage/phase_base .gpu_stage/phase_new; do
  (cd $dir && PYTHONPATH=$PWD python3 -c "import cs149gpt; print('$dir', cs149gpt.isa())" 2>&1 | tail -1) &
done
wait
nproc; grep -m1 "^model\s" /proc/cpuinfo; lscpu | grep -E "^Thread|^Core|^Socket|^L2|^L3"
phases() {  # tree dtype shape [causal|-] [block_q]
  (cd .gpu_stage/phase_$1 && PYTHONPATH=$PWD timeout 30 python3 $OLDPWD/benchmarks/device/phase_times.py $2 $3 16 ${4:--} $5 \
    2>&1 | grep -v sdpa | sed "s/^/$1 /")
}
for round in 1 2; do
  for cfg in "float32 1,4,1024,32" "float32 1,12,1024,64" "bfloat16 1,4,1024,32" "bfloat16 1,12,1024,64" \
             "float16 1,4,1024,32" "float16 1,12,1024,64"; do
    phases base $cfg; phases new $cfg
  done
done 2>&1 | tee "$OUT/s18b_phases.txt"
for bq in 24 48 96; do phases new float32 1,4,1024,32 - $bq; done 2>&1 | tee -a "$OUT/s18b_phases.txt"
for bq in 24 48 96 192; do phases new float32 1,12,1024,64 - $bq; done 2>&1 | tee -a "$OUT/s18b_phases.txt"
for dtype in bfloat16 float16; do
  for bq in 32 64 128; do phases new $dtype 1,4,1024,32 - $bq; done
  for bq in 32 64 128 192; do phases new $dtype 1,12,1024,64 - $bq; done
done 2>&1 | tee -a "$OUT/s18b_phases.txt"
uptime
