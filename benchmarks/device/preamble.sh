# Sourced first by the device scripts (bash benchmarks/device/device_session*.sh, from the repo root): results go
# to $OUT, the build uses every CPU and skips CUDA, and the log opens with the machine's CPU count, load and ISA
# (the first import also builds the kernels).
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
nproc; uptime
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
