#!/usr/bin/env bash
# One device call: build the CUDA extension, run the CUDA tests, the driver, a profile and the benchmark, logs
# under $OUT.
#   bash benchmarks/device/cuda_device_run.sh [quick|full]
#   CONFIGS=1: first sweep the tile configurations;  PROFILE=1: Nsight Compute on ours and FA2 (d 128)
set -uo pipefail
mode=${1:-quick}
out=${OUT:-/tmp/cs149gpt_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CS149GPT_CUDA_ARCHS=${CS149GPT_CUDA_ARCHS:-90a}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" | tee -a "$out/gpu.txt"
start=$(date +%s)
timeout 300 python3 -c "import cs149gpt, torch; q=torch.randn(1,1,8,64,device='cuda',dtype=torch.bfloat16); print(cs149gpt.attention(q,q,q).shape)" 2>&1 | tail -30 | tee "$out/build.txt"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$out/build.txt"
start=$(date +%s)
timeout ${TEST_TIMEOUT:-170} python3 -m pytest tests/test_cuda.py -q -n 4 --tb=short -p no:cacheprovider 2>&1 | tail -150 > "$out/cuda_tests.txt"
tail -25 "$out/cuda_tests.txt"
echo "tests: $(( $(date +%s) - start )) s"
for dt in float32 bfloat16; do
  timeout 30 python3 cs149gpt/gpt149.py part4 --device cuda --dtype $dt -B 4 -H 16 -N 2048 -d 64 --causal --scale 0.125 2>&1 | tee -a "$out/driver.txt"
done
if [ "${SASS:-0}" = 1 ] && [ -n "$(which cuobjdump)" ]; then  # static instruction counts and spill sites
  objs=$(ls build/jit-*-cuda/flash_{fwd,bwd}_hdim128_bf16.cuda.o build/jit-*-cuda/flash_{fwd,bwd}_hdim64_bf16.cuda.o)
  timeout 60 python3 benchmarks/sass_summary.py $objs --spills "${SASS_SPILLS:-FwdTraitsILi128ELi4ELi64E13__nv_bfloat16Li2ELb0|BwdTraitsILi128ELi64ELi128ELi8ELi4ELi4ELi2E13__nv_bfloat16}" > "$out/sass.txt" 2>&1
  echo "sass: $(wc -l < "$out/sass.txt") lines"
fi
if [ "${PROFILE:-0}" = 1 ] && [ -n "$(which ncu)" ]; then
  start=$(date +%s)
  sections="--section LaunchStats --section Occupancy --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats"
  metrics=smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  for stall in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction; do
    metrics=$metrics,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
  done
  kernels="regex:flash_fwd_kernel|flash_bwd_kernel|flash_bwd_dq_dk_dv"
  timeout ${PROFILE_TIMEOUT:-150} ncu --clock-control none -k "$kernels" $sections --metrics $metrics \
    python3 benchmarks/cuda_profile.py --d 128 > "$out/profile.txt" 2>&1 ||
    timeout ${PROFILE_TIMEOUT:-150} ncu --clock-control none -k "$kernels" $sections \
      python3 benchmarks/cuda_profile.py --d 128 >> "$out/profile.txt" 2>&1
  echo "profile: $(( $(date +%s) - start )) s, $(grep -c 'flash' "$out/profile.txt") lines naming a kernel"
fi
args="--json $out/bench.json"; [ "$mode" = quick ] && args="$args --quick"; [ "${CONFIGS:-0}" = 1 ] && args="$args --configs"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_cuda.py $args 2>&1 | tee "$out/bench.txt"
