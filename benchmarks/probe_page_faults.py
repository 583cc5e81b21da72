#!/usr/bin/env python3
"""What fresh memory costs a call: our flash forward and torch's SDPA, alternating, with the process's minor page
faults per call, first with glibc's malloc defaults, then with glibc told to keep every freed page (mallopt: no
trimming, no mmap for large blocks), same process. A large block (our packed K and V: ≥ 32 MB at (1,16,4096,128))
is mmap-ed afresh by every call under the defaults, and each of its 4 KB pages faults when first written.

    python benchmarks/probe_page_faults.py --threads 16,1
"""
import argparse
import ctypes
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def table(label, shapes, dtypes, threads_list, rounds):
    print(f"\n## {label}: median of {rounds} alternating calls")
    print("| shape | dtype | threads | SDPA ms | ours ms | ×SDPA | SDPA faults | ours faults |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        for dtype in dtypes:
            q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
            fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                   "ours": lambda: cs149gpt.attention(q, k, v)}
            for threads in threads_list:
                torch.set_num_threads(threads)
                samples = {n: [] for n in fns}
                for n, fn in fns.items():
                    fn()
                for _ in range(rounds):
                    for n, fn in fns.items():
                        f0, t0 = faults(), time.perf_counter()
                        fn()
                        samples[n].append((time.perf_counter() - t0, faults() - f0))
                med = {n: (statistics.median(t for t, _ in s), int(statistics.median(f for _, f in s)))
                       for n, s in samples.items()}
                print(f"| {','.join(map(str, shape))} | {str(dtype).replace('torch.', '')} | {threads} | "
                      f"{med['sdpa'][0] * 1e3:.2f} | {med['ours'][0] * 1e3:.2f} | {med['sdpa'][0] / med['ours'][0]:.2f} | "
                      f"{med['sdpa'][1]} | {med['ours'][1]} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="16,1")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    shapes = [(1, 16, 4096, 128), (4, 12, 2048, 64)]
    dtypes = [torch.bfloat16, torch.float32]
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}")
    table("glibc malloc defaults", shapes, dtypes, threads, args.rounds)
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if libc.mallopt(m_trim_threshold, 1 << 30) and libc.mallopt(m_mmap_threshold, 1 << 29):
        table("mallopt: no trim, no mmap", shapes, dtypes, threads, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
