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
# The error checks first, each in its own process (a bad-argument error on the GPU path crashed the process on
# the device host: see which call does, and where).
gdb_done=0
for case in "cpu:direct" "cpu:wrapped" "cuda:direct" "cuda:wrapped" "cuda:grad" "cuda:f32bwd"; do
  cat > /tmp/err_case.py <<PY
import torch, cs149gpt
dev, how = "$case".split(":")
dt = torch.float32 if dev == "cpu" or how == "f32bwd" else torch.bfloat16
q = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
k = torch.randn(1, 2, 16, 96 if how != "f32bwd" else 64, device=dev, dtype=dt)  # head dims differ: an error
try:
    if how == "direct": torch.ops.cs149gpt.flash_attention(q, k, k, None, "none", None, None)  # no Python around it
    elif how == "wrapped": cs149gpt.attention(q, k, k)  # cs149gpt's wrapper (below autograd)
    elif how == "grad": cs149gpt.attention(q.requires_grad_(), k, k)  # through the autograd layer
    else: cs149gpt.attention(q.requires_grad_(), k, k).sum().backward()  # float32 backward: raises on the autograd thread
    print("no error")
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0][:100])
PY
  PYTHONPATH=. timeout 30 python3 /tmp/err_case.py > /tmp/err_out.txt 2>&1; rc=$?
  echo "$case rc=$rc: $(grep -E 'Error|error|no error|Fatal' /tmp/err_out.txt | head -2 | tr '\n' ' ')" | tee -a "$out/errors.txt"
  if [ $rc -ne 0 ] && [ $gdb_done = 0 ] && [ -n "$(which cuda-gdb)" ]; then
    gdb_done=1
    PYTHONPATH=. timeout 60 cuda-gdb -q -batch -ex run -ex bt --args python3 /tmp/err_case.py 2>&1 | grep -E "^#|SIG" | head -40 >> "$out/errors.txt"
  fi
done
timeout ${TEST_TIMEOUT:-170} python3 -m pytest tests/test_cuda.py -q -n 4 --tb=short -p no:cacheprovider 2>&1 | tail -150 > "$out/cuda_tests.txt"
tail -25 "$out/cuda_tests.txt"
for dt in float32 bfloat16; do
  timeout 30 python3 cs149gpt/gpt149.py part4 --device cuda --dtype $dt -B 4 -H 16 -N 2048 -d 64 --causal --scale 0.125 2>&1 | tee -a "$out/driver.txt"
done
args="--json $out/bench.json"; [ "$mode" = quick ] && args="$args --quick"; [ "${CONFIGS:-0}" = 1 ] && args="$args --configs"
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_cuda.py $args 2>&1 | tee "$out/bench.txt"
