#!/usr/bin/env python3
"""Ours against torch's SDPA on a noisy host: many pairs of back-to-back timings, one ratio per pair.

bench_attention.py times each implementation for a while, then the next: on a shared host whose speed drifts by
10-30 % within seconds (the device host's one-thread cells), a ratio of two such medians moves by as much. Here
every pair times SDPA and then ours (each for at least --min-time seconds, the order alternating pair by pair), so
both see nearly the same machine, and the figure is the median of the pairs' ratios with its quartiles, beside the
ratio of the two best times.

    python benchmarks/pairwise_ratio.py --shapes 1,12,1024,64 4,12,2048,64 --threads 1 --pairs 9
    python benchmarks/pairwise_ratio.py --dtype bfloat16 --threads 16 --causal both --pairs 25
    python benchmarks/pairwise_ratio.py --float32-products fma,bf16_tiles --threads 1,16

With several --float32-products (cs149gpt.set_float32_products) each pair times SDPA and ours under every setting,
the order rotating pair by pair, and prints a row for each setting: their ratios share the same SDPA timings.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402

ISSUE_SHAPES = ["1,4,1024,32", "1,12,1024,64", "4,12,2048,64", "1,16,4096,128"]


def seconds(fn, min_time: float) -> float:
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls


def probes(threads: int) -> str:
    """The machine's float32 FMA and bf16 (AMX or vdpbf16ps) peaks right now, GFLOP/s: the host's state."""
    module = _ext.load()
    fma = getattr(module, "fma_peak_gflops", None)
    bf16 = getattr(module, "bf16_peak_gflops", None)
    parts = []
    if fma:
        parts.append(f"float32 FMA {max(float(fma(threads)) for _ in range(3)):.0f}")
    if bf16 and bf16(1, 0.01) is not None:
        parts.append(f"bf16 {max(float(bf16(threads)) for _ in range(3)):.0f}")
    return f"# probes on {threads} threads, GFLOP/s: " + ", ".join(parts)


def flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    pairs = n * (n + 1) / 2 if causal else n * n
    return 4.0 * b * h * pairs * d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=ISSUE_SHAPES, help="B,H,N,d (q, k and v alike)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--causal", default="off", choices=("off", "on", "both"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds of calls per timing (at least one call)")
    ap.add_argument("--float32-products", default="auto",
                    help="comma-separated cs149gpt.set_float32_products settings, each timed as its own 'ours'")
    a = ap.parse_args()
    settings = a.float32_products.split(",")
    dtype = getattr(torch, a.dtype)
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}, {a.dtype}; {a.pairs} pairs of back-to-back timings "
          f"(>= {a.min_time} s each); ratio = SDPA time / ours (> 1: ours faster)")
    print("| shape | causal | threads | float32 products | median ratio | quartiles | ratio of best times | SDPA ms | ours ms | ours GFLOP/s, best time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        print(probes(threads), flush=True)
        for shape in a.shapes:
            b, h, n, d = (int(x) for x in shape.split(","))
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))
            for causal in {"off": [False], "on": [True], "both": [False, True]}[a.causal]:
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                ours = lambda: cs149gpt.attention(q, k, v, is_causal=causal)  # noqa: E731
                contenders = ["sdpa"] + settings

                def timed(name: str) -> float:
                    if name == "sdpa":
                        return seconds(sdpa, a.min_time)
                    cs149gpt.set_float32_products(name)
                    return seconds(ours, a.min_time)

                for name in contenders:  # warm-up: workspaces, packing buffers, the thread pool
                    timed(name)
                times = {name: [] for name in contenders}
                for i in range(a.pairs):
                    order = contenders[i % len(contenders):] + contenders[:i % len(contenders)]
                    for name in order if i % 2 == 0 else order[::-1]:
                        times[name].append(timed(name))
                t_sdpa = times["sdpa"]
                for name in settings:
                    t_ours = times[name]
                    ratios = [ts / to for ts, to in zip(t_sdpa, t_ours)]
                    q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
                    print(f"| {shape} | {'yes' if causal else 'no'} | {threads} | {name} | {statistics.median(ratios):.3f} | "
                          f"{q1:.3f}–{q3:.3f} | {min(t_sdpa) / min(t_ours):.3f} | {statistics.median(t_sdpa) * 1e3:.2f} | "
                          f"{statistics.median(t_ours) * 1e3:.2f} | {flops(b, h, n, d, causal) / min(t_ours) / 1e9:.0f} |",
                          flush=True)
                cs149gpt.set_float32_products("auto")
        print(probes(threads), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
