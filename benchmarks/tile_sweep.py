#!/usr/bin/env python3
"""Sweeps the tile sizes of one kernel: how the defaults in csrc/ were chosen.

    python benchmarks/tile_sweep.py --impl flash --block-q 24,48,96,192 --block-k 64,128,256,512
    python benchmarks/tile_sweep.py --impl blocked --block-q 16,32,64,128,256

Prints GFLOP/s per (shape, block_q, block_k), best first per shape, and the kernel's own default
(block_q = block_k = None) for comparison. Times are the best of --repeats calls, in each of --rounds rounds that
take every configuration (and torch's SDPA) in turn, so that a host whose speed drifts (the device host's one-thread
timings move 20-40 % within minutes) slows all of them alike.
"""
import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", choices=("blocked", "flash"), default="flash")
    parser.add_argument("--shapes", nargs="+", default=["1,4,1024,32", "1,12,1024,64", "1,16,1024,128"],
                        metavar="B,H,N,d")
    parser.add_argument("--block-q", default="24,48,96,192", help="comma-separated; 'none': the kernel's choice")
    parser.add_argument("--block-k", default="64,128,256,512", help="ignored by blocked (one tile size)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over all configurations")
    parser.add_argument("--all", action="store_true", help="print every (block_q, block_k), not only the best six")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="bfloat16 on amx/avx512_bf16 sweeps the bf16 dot-product path (flash_bf16.cpp)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    def sizes(text):  # "none": the kernel's own choice of that size (e.g. block_q shrunk for the thread count)
        return [None if x == "none" else int(x) for x in text.split(",")]
    block_qs = sizes(args.block_q)
    block_ks = sizes(args.block_k) if args.impl == "flash" else [None]
    dtype = getattr(torch, args.dtype)
    print(f"# {args.impl}, {args.threads} threads, isa {cs149gpt.isa()}, causal={args.causal}, {args.dtype}")
    for text in args.shapes:
        B, H, N, d = (int(x) for x in text.split(","))
        q, k, v = (torch.randn(B, H, N, d).to(dtype) for _ in range(3))
        flops = 4 * B * H * N * N * d * (0.5 if args.causal else 1.0)
        configs = [(None, None)] + [(bq, bk) for bq in block_qs for bk in block_ks if (bq, bk) != (None, None)]
        times = [math.inf] * len(configs)
        sdpa_time = math.inf
        for _ in range(args.rounds):
            for i, (bq, bk) in enumerate(configs):
                times[i] = min(times[i], best_time(lambda: cs149gpt.attention(
                    q, k, v, impl=args.impl, is_causal=args.causal, block_q=bq, block_k=bk), args.repeats))
            sdpa_time = min(sdpa_time, best_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=args.causal), args.repeats))
        results = [(flops / t * 1e-9, bq, bk) for t, (bq, bk) in zip(times, configs)]
        default = results[0][0]
        sdpa = flops / sdpa_time * 1e-9
        if args.all:
            print(f"{text}: torch SDPA {sdpa:.0f} GFLOP/s, default {default:.0f} GFLOP/s")
            for g, bq, bk in results[1:]:
                print(f"  block_q {bq if bq else '-':>4} block_k {bk if bk else '-':>5}  {g:6.0f} GFLOP/s  x{g / sdpa:.2f} SDPA")
            continue
        print(f"{text}: default {default:.0f} GFLOP/s; best: " + ", ".join(
            f"{g:.0f}@{bq or '-'}x{bk or '-'}" if args.impl == "flash" else f"{g:.0f}@{bq}"
            for g, bq, bk in sorted(results[1:], key=lambda r: r[0], reverse=True)[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
