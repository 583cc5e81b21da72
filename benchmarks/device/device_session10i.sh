#!/usr/bin/env bash
# Session 10, last run on the device host: amx against amx_emulated with the ulps column, and BERT 32 x 128's page
# faults (issue 11) with ours, SDPA, and ours with a 2 MiB allocation in each call where SDPA's path makes its float
# mask (probe_bert_heap.py, PROBE_SPACER_MB), float32, 16 threads, two rounds.
#   s10i_emulation.txt, s10i_bert_heap.txt
set -uo pipefail
OUT=${OUT:-/tmp/cs149gpt-device}
mkdir -p "$OUT"
export MAX_JOBS=16 PYTHONUNBUFFERED=1 CS149GPT_NO_CUDA=1 PYTHONPATH=$PWD
python3 -c "import cs149gpt; print('isa', cs149gpt.isa())" 2>&1 | tail -1
timeout 120 python3 benchmarks/probe_amx_emulation.py 2>&1 | tee "$OUT/s10i_emulation.txt"
{ echo "| env | impl | threads | dtype | forward ms | faults a forward | heap MiB | mmapped MiB | top free MiB |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for round in 1 2; do
    timeout 60 python3 benchmarks/probe_bert_heap.py sdpa 16
    timeout 60 python3 benchmarks/probe_bert_heap.py cs149gpt 16
    PROBE_SPACER_MB=2 timeout 60 python3 benchmarks/probe_bert_heap.py cs149gpt 16
  done; } 2>&1 | grep -E "^\|" | tee "$OUT/s10i_bert_heap.txt"
