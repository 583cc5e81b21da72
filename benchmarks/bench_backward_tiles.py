#!/usr/bin/env python3
"""The flash backward's time for several tile sizes (block_q × block_k), against torch SDPA's backward in the same run.

For each shape, dtype, causal mode and thread count: torch.autograd.grad of a forward recorded once (as
bench_backward.py's "bwd" phase), for SDPA, for our kernel with its default tiles, and for each requested
(block_q, block_k) — the same kernel the default runs, with other tiles (which backward kernel runs is decided by
the shape alone: module.cpp, choose_backward). Interleaved in rounds, the best of each reported as ms and as
SDPA time / our time (> 1: ours faster).

    python benchmarks/bench_backward_tiles.py --shapes 1,16,4096,128 --dtype float32 --threads 16 \\
        --tiles 96x96 96x192 192x96 192x192
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as fwd_bench  # noqa: E402  (repo root on sys.path, shapes, machine info)
from bench_attention import machine_info, torch_threads  # noqa: E402

import cs149gpt  # noqa: E402


def parse_tile(text: str) -> tuple[int, int]:
    block_q, block_k = text.lower().split("x")
    return int(block_q), int(block_k)


def time_call(fn, threads: int, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(
        min_run_time=min_run_time).median


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", type=fwd_bench.parse_shape, required=True, metavar="B,H,N,d")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, required=True, metavar="BQxBK")
    parser.add_argument("--threads", type=fwd_bench.parse_threads, default=fwd_bench.usable_cpus())
    parser.add_argument("--causal", choices=("off", "on", "both"), default="both")
    parser.add_argument("--dtype", type=fwd_bench.parse_dtype, default=torch.float32)
    parser.add_argument("--min-run-time", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    machine = machine_info()
    print(f"# {machine.get('cpu_model')}, {machine.get('usable_cpus')} CPUs, torch {torch.__version__}, "
          f"cs149gpt ISA {cs149gpt.isa()}; backward only, ms (x SDPA time / ours)", flush=True)
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    for shape in args.shapes:
        for causal in causals:
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq_len, shape.head_dim, generator=gen,
                                   dtype=args.dtype).requires_grad_() for _ in range(3))
            dout = torch.randn(q.shape, generator=gen, dtype=args.dtype)
            variants = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                        "default": lambda: cs149gpt.attention(q, k, v, is_causal=causal)}
            for bq, bk in args.tiles:
                variants[f"{bq}x{bk}"] = (lambda bq=bq, bk=bk: cs149gpt.attention(q, k, v, is_causal=causal,
                                                                                  block_q=bq, block_k=bk))
            best = {}
            with torch_threads(args.threads):
                calls = {}
                for name, forward in variants.items():
                    out = forward()
                    calls[name] = (lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                order = list(calls)
                for _ in range(args.rounds):
                    for name in order:
                        t = time_call(calls[name], args.threads, args.min_run_time)
                        best[name] = min(best.get(name, t), t)
                    order.reverse()
            cells = " ".join(f"{name} {best[name] * 1e3:.2f} (x{best['sdpa'] / best[name]:.2f})" for name in variants)
            print(f"{shape} causal={causal:d} {str(args.dtype).replace('torch.', '')} t={args.threads}: {cells}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
