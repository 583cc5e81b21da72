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
# the error checks first, each in its own process (a crash here once took the whole pytest run down)
for case in "cpu:impl" "cuda:impl" "cuda:dtype" "cuda:d96" "cuda:f32bwd"; do
  cat > /tmp/err_case.py <<PY
import torch, cs149gpt
dev, what = "$case".split(":")
q = torch.randn(1, 2, 16, 96 if what == "d96" else 64, device=dev, dtype=torch.float32 if what in ("impl", "f32bwd") else torch.bfloat16)
try:
    if what == "impl": cs149gpt.attention(q, q, q, impl="bogus")
    elif what == "dtype": cs149gpt.attention(q, q.half(), q)
    elif what == "f32bwd": cs149gpt.attention(q.requires_grad_(), q, q).sum().backward()
    else: cs149gpt.attention(q, q, q)
    print("$case: no error")
except Exception as e:
    print("$case:", type(e).__name__, str(e).splitlines()[0][:120])
PY
  timeout 30 python3 /tmp/err_case.py > /tmp/err_out.txt 2>&1; rc=$?; echo "rc=$rc $(grep -v Warning /tmp/err_out.txt | head -3)" | tee -a "$out/errors.txt"
  if [ $rc -ne 0 ] && [ -n "$(which cuda-gdb)" ]; then
    timeout 120 cuda-gdb -q -batch -ex run -ex bt --args python3 /tmp/err_case.py 2>&1 | grep -E "^#|SIGSEGV" | head -30 | tee -a "$out/errors.txt"
  fi
done
timeout ${TEST_TIMEOUT:-170} python3 -m pytest tests/test_cuda.py -q -n 4 --tb=short -p no:cacheprovider 2>&1 | tail -150 > "$out/cuda_tests.txt"
tail -25 "$out/cuda_tests.txt"
for dt in float32 bfloat16; do
  timeout 30 python3 cs149gpt/gpt149.py part4 --device cuda --dtype $dt -B 4 -H 16 -N 2048 -d 64 --causal --scale 0.125 2>&1 | tee -a "$out/driver.txt"
done
args="--json $out/bench.json"; [ "$mode" = quick ] && args="$args --quick"; [ "${CONFIGS:-0}" = 1 ] && args="$args --configs"
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/bench_cuda.py $args 2>&1 | tee "$out/bench.txt"
