#!/usr/bin/env bash
# Session 15, eleventh device run: the float32 forward's new default tiles with AVX-512 (192 x 1024, were 96 x 512)
# against the previous commit (.gpu_stage/base), and the forward tests under real AMX.
#   s15k_pytest.txt     test_flash, test_masks (forward), test_dropout: the amx cases
#   ab_s15k_f32.txt     bench_attention.py float32, issue 9's four shapes, 1 and 16 threads, causal both, 3 rounds
source benchmarks/device/preamble.sh
timeout 150 python3 -m pytest -q tests/test_flash.py tests/test_masks.py tests/test_dropout.py -k "amx and not emulated" \
  > "$OUT/s15k_pytest.txt" 2>&1
tail -1 "$OUT/s15k_pytest.txt"; grep -E "^FAILED" "$OUT/s15k_pytest.txt" | head -5
TAG=s15k_f32 ROUNDS=3 TL=120 ARGS="--shapes 1,4,1024,32 1,12,1024,64 4,12,2048,64 1,16,4096,128 --dtype float32 \
  --threads 1,16 --causal both --min-run-time 0.15" bash benchmarks/device/device_ab.sh > /dev/null
python3 - "$OUT/ab_s15k_f32.txt" <<'PY'
import re, statistics, collections, sys
tree = None; r = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"== round (\d+) (\w+)", line)
    if m: tree = m.group(2); continue
    p = line.split()
    if len(p) >= 8 and p[4] == "flash": r[(p[0], p[1], p[3], tree)].append(float(p[7]))
for k in sorted({k[:3] for k in r}, key=lambda k: (k[2], k[1], k[0])):
    print(*k, "x SDPA median base", statistics.median(r[(*k, "base")]), "new", statistics.median(r[(*k, "new")]))
PY
uptime
