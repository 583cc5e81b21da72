#!/usr/bin/env bash
# One run on the device host's CPU for decoding (issue 10), everything into $OUT, most important first (each step has
# its own time limit, so a slow step costs only itself):
#   machine.txt           lscpu, memory, torch
#   decode.txt            bench_decode: 1 and 16 threads, float32 and bf16, batch 1 and 8, 128–8192 keys, ours beside
#                         the second ISA $EXTRA_ISA (bf16 rows: vdpbf16ps keys against the FMA keys of the AMX build)
#   generate_shipped.txt  bench_generate, the shipped GPT, contexts 1024 and 2048, 1 and 16 threads
#   generate_llama.txt    bench_generate --llama: 16 threads with prefill (1024, 4096); 1 thread decode-only (4096);
#                         batch 8 at 8192 keys decode-only (16 threads), where reading the cache is most of a token
#   profile.txt           profile_decode_step: where a decode step's time goes (shipped 1024 and Llama 4096, 16 threads)
#   overhead.txt          bench_overhead, 1 and 16 threads
#   pytest.txt            the KV-cache, fast-path and model tests under every ISA this CPU runs (AMX included)
#   run: bash benchmarks/device/device_decode.sh   (the device tool sets $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1
{ lscpu; free -g; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/machine.txt" 2>&1
time python3 -c "import cs149gpt; from cs149gpt import _ext; m = _ext.load(); \
print('isa', m.isa(), 'amx refusal:', repr(m.amx_unavailable_reason()))" 2>&1 | tail -3
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/bench_decode.py --threads ${THREADS:-1,16} \
  --seconds ${SECONDS_PER_SHAPE:-0.2} --extra-isa ${EXTRA_ISA:-avx512_bf16} 2>&1 | tee "$OUT/decode.txt"
G=${GENERATE_TIMEOUT:-60}
timeout $G python3 benchmarks/bench_generate.py --contexts 1024,2048 --threads 1,16 --impls flash --repeats 5 \
  2>&1 | tee "$OUT/generate_shipped.txt"
{ timeout 90 python3 benchmarks/bench_generate.py --llama --contexts 1024,4096 --threads 16 --impls flash --decode 16 \
    --repeats 3
  timeout $G python3 benchmarks/bench_generate.py --llama --contexts 4096 --threads 1 --impls flash --decode 8 \
    --repeats 3 --decode-only
  timeout $G python3 benchmarks/bench_generate.py --llama --contexts 8192 --batch 8 --threads 16 --impls flash \
    --decode 8 --repeats 3 --decode-only; } 2>&1 | tee "$OUT/generate_llama.txt"
{ timeout 30 python3 benchmarks/profile_decode_step.py --context 1024 --threads 16
  timeout 30 python3 benchmarks/profile_decode_step.py --llama --context 4096 --threads 16 --steps 8; } 2>&1 \
  | tee "$OUT/profile.txt"
{ timeout 30 python3 benchmarks/bench_overhead.py --calls 2000 --threads 1
  timeout 30 python3 benchmarks/bench_overhead.py --calls 2000 --threads 16; } 2>&1 | tee "$OUT/overhead.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_kvcache.py tests/test_fast_path.py \
    ${TESTS:-} > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt"; grep -E "^FAILED|Error" "$OUT/pytest.txt" | head -20
fi
