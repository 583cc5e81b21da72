#!/usr/bin/env python3
"""Where one forward call's time goes (device measurement; needs a tree instrumented by instrument_phases.py).

    python benchmarks/device/phase_times.py float32 1,4,1024,32 16 [causal|-] [block_q]

Times --seconds of calls from Python, then the patched kernel prints at exit (stderr) its mean per call: from the
call's entry to the threads' fork, the packing phase (to its barrier), each thread's busy time over the query
tiles (mean and max), from the last thread's last tile to the join, and the whole parallel region. The Python
figure minus the region is what the call costs outside the kernel (checks, output allocation, dispatch).
"""
import sys
import time

import torch
import torch.nn.functional as F

import cs149gpt

dtype, shape, threads = getattr(torch, sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
causal = len(sys.argv) > 4 and sys.argv[4] == "causal"
block_q = int(sys.argv[5]) if len(sys.argv) > 5 else None
torch.set_num_threads(threads)
q, k, v = (torch.randn(*shape).to(dtype) for _ in range(3))
for fn, name in ((lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), "sdpa"),
                 (lambda: cs149gpt.attention(q, k, v, is_causal=causal, block_q=block_q), "ours")):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(5):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.1:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    print(f"{sys.argv[1]} {sys.argv[2]} {threads}t {'causal' if causal else 'non-causal'} block_q {block_q}: {name} "
          f"{best * 1e6:.1f} us "
          "a call (best of 5 x 0.1 s)", flush=True)
