#!/usr/bin/env bash
# Session 6's closing runs (16-core Xeon with AMX) on main, in two parts that each fit one 10-minute device call.
#   PART=a: build; the CPU test suites under every ISA the CPU runs (the `isa` fixture forces amx, avx512_bf16,
#           avx512, avx2, scalar in turn); masked prefill against SDPA given the same mask (issue 11).
#   PART=b: the forward benchmark (issue 9: bf16, fp16, fp32; the four shapes; causal both; 1 and 16
#           threads); the backward on 16 threads (issue 12).
#   run: CS149GPT_NO_CUDA=1 PART=a bash benchmarks/device/device_session6_final.sh
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
T=s6f${PART}
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; git log --oneline -1 2>/dev/null
  time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))"; } > "$OUT/${T}_machine.txt" 2>&1
cat "$OUT/${T}_machine.txt"
if [ "$PART" = a ]; then
  timeout ${TL_TESTS:-330} python3 -m pytest -q -p no:cacheprovider tests/test_flash.py tests/test_nonfinite.py \
    tests/test_attention.py tests/test_backward.py tests/test_masks.py tests/test_mask_decode.py tests/test_kvcache.py \
    tests/test_dropout.py tests/test_fast_path.py > "$OUT/${T}_pytest_cpu.txt" 2>&1
  tail -2 "$OUT/${T}_pytest_cpu.txt"; grep -E "^FAILED" "$OUT/${T}_pytest_cpu.txt" | head -10
  timeout ${TL_MASKS:-150} python3 benchmarks/bench_masks.py --threads 1,16 --markdown --dtype float32,bfloat16 \
    --min-run-time 1.0 > "$OUT/${T}_bench_masks.txt" 2>&1
  grep -E "^\|" "$OUT/${T}_bench_masks.txt"
else
  timeout ${TL_FWD:-300} python3 benchmarks/bench_attention.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
    1,16,4096,128 --impls flash --causal both --dtype bfloat16,float16,float32 --threads 1,16 \
    --min-run-time ${MIN_RUN:-0.3} --rounds ${ROUNDS:-2} --json "$OUT/${T}_forward.json" > "$OUT/${T}_forward.txt" 2>&1
  grep -E " flash |peak" "$OUT/${T}_forward.txt"
  for dtype in float32 bfloat16; do
    timeout 60 python3 benchmarks/bench_backward.py --shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 \
      1,16,4096,128 --threads 16 --causal both --dtype $dtype --rounds 1 --min-run-time 0.1
  done > "$OUT/${T}_backward_t16.txt" 2>&1
  grep -E "bwd flash" "$OUT/${T}_backward_t16.txt"
fi
