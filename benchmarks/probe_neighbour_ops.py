#!/usr/bin/env python3
"""Does our attention slow down the operator that runs next? In whole models (BERT inference, GPT training) the
profiles show the matrix products and elementwise operators around attention taking longer with ours than with torch's
SDPA. One process: a matrix product (and a GELU) timed right after our attention, right after SDPA, and right after
another matrix product, interleaved; and the OpenMP runtimes loaded in the process (two copies would mean two thread
pools, one spinning while the other works).

    python benchmarks/probe_neighbour_ops.py --threads 16
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--shape", default="32,8,128,64")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cs149gpt._ext.load()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        runtimes = sorted({line.split()[-1] for line in maps if "omp" in line.split()[-1]})
    print(f"# torch {torch.__version__}, {args.threads} threads, OpenMP runtimes loaded: {runtimes}")
    B, H, N, d = (int(x) for x in args.shape.split(","))
    q, k, v = (torch.randn(B, N, H, d).transpose(1, 2) for _ in range(3))
    x, w = torch.randn(B * N, H * d), torch.randn(H * d, 4 * H * d)
    y = torch.randn(B * N, 4 * H * d)
    before = {"ours": lambda: cs149gpt.scaled_dot_product_attention(q, k, v),
              "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
              "mm": lambda: torch.mm(x, w),
              "sleep 1 ms": lambda: time.sleep(0.001)}
    after = {"mm": lambda: torch.mm(x, w), "gelu": lambda: F.gelu(y)}
    times = {(a, b): [] for a in after for b in before}
    with torch.no_grad():
        for _ in range(3):
            for fn in list(before.values()) + list(after.values()):
                fn()
        for _ in range(args.rounds):
            for a, run_after in after.items():
                for b, run_before in before.items():
                    run_before()
                    start = time.perf_counter()
                    run_after()
                    times[(a, b)].append(time.perf_counter() - start)
    print("| op | right after | median ms | min ms |")
    print("|---|---|---|---|")
    for (a, b), t in times.items():
        print(f"| {a} | {b} | {statistics.median(t) * 1e3:.3f} | {min(t) * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
