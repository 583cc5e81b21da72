#!/usr/bin/env bash
# One device call: build the CUDA extension, run the CUDA tests, the driver and the benchmark, logs under $OUT.
#   bash benchmarks/cuda_device_run.sh [quick|full]
set -uo pipefail
mode=${1:-quick}
out=${OUT:-/tmp/cs149gpt_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 CS149GPT_CUDA_ARCHS=${CS149GPT_CUDA_ARCHS:-90a}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" | tee -a "$out/gpu.txt"
start=$(date +%s)
timeout 240 python3 -c "import cs149gpt, torch; q=torch.randn(1,1,8,64,device='cuda',dtype=torch.bfloat16); print(cs149gpt.attention(q,q,q).shape)" 2>&1 | tee "$out/build.txt"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$out/build.txt"
timeout 150 python3 -m pytest tests/test_cuda.py -q --maxfail=30 --tb=line -p no:cacheprovider 2>&1 | tail -40 | tee "$out/cuda_tests.txt"
for dt in float32 bfloat16; do
  timeout 30 python3 cs149gpt/gpt149.py part4 --device cuda --dtype $dt -B 4 -H 16 -N 2048 -d 64 --causal --scale 0.125 2>&1 | tee -a "$out/driver.txt"
done
args="--json $out/bench.json"; [ "$mode" = quick ] && args="$args --quick"
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_cuda.py $args 2>&1 | tee "$out/bench.txt"
