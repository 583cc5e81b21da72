#!/usr/bin/env python3
"""Peak backward memory of our flash attention for several tile sizes, against torch SDPA's, in the same run.

bench_train.py --memory's method (bench_attention.peak_allocator_bytes: torch's allocator, profiler events, during one
torch.autograd.grad of a recorded forward), but with the tiles given (block_q × block_k; "default" = the kernel's
choice), and the one-pass backward's key chunks forced if asked: module.cpp (choose_backward) decides them from the
machine's CPU count, so --key-chunks lets a 2-core machine size the workspace as the 16-core device host does.

    python benchmarks/bench_backward_memory_tiles.py --shapes 1,16,4096,128 --dtype bfloat16 --threads 16 \\
        --tiles default 64x128 64x256
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as fwd_bench  # noqa: E402  (repo root on sys.path, shapes, machine info, memory probe)
from bench_attention import machine_info, peak_allocator_bytes, torch_threads  # noqa: E402

import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402


def parse_tile(text: str) -> Optional[tuple[int, int]]:
    if text == "default":
        return None
    block_q, block_k = text.lower().split("x")
    return int(block_q), int(block_k)


def peak_mib(shape, dtype: torch.dtype, threads: int, tiles: Optional[tuple[int, int]], sdpa: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq_len, shape.head_dim, generator=gen).to(dtype)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    bq, bk = tiles if tiles else (None, None)
    with torch_threads(threads):
        out = (F.scaled_dot_product_attention(q, k, v) if sdpa
               else cs149gpt.attention(q, k, v, block_q=bq, block_k=bk))
        peak = peak_allocator_bytes(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), threads)
    return float("nan") if peak is None else peak / 2**20


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", type=fwd_bench.parse_shape, required=True, metavar="B,H,N,d")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[None], metavar="BQxBK|default")
    parser.add_argument("--threads", type=fwd_bench.parse_threads, default=fwd_bench.usable_cpus())
    parser.add_argument("--dtype", type=fwd_bench.parse_dtype, default=torch.float32)
    parser.add_argument("--key-chunks", type=int, default=0, help="force the one-pass backward's key chunks (0: auto)")
    args = parser.parse_args(argv)
    machine = machine_info()
    print(f"# {machine.get('cpu_model')}, {machine.get('usable_cpus')} CPUs, torch {torch.__version__}, "
          f"cs149gpt ISA {cs149gpt.isa()}; peak backward MiB (x ours / SDPA), {args.threads} threads, "
          f"key chunks {args.key_chunks or 'auto'}", flush=True)
    m = _ext.load()
    m.set_backward_key_chunks(args.key_chunks)
    try:
        for shape in args.shapes:
            sdpa = peak_mib(shape, args.dtype, args.threads, None, sdpa=True)
            cells = []
            for tiles in args.tiles:
                ours = peak_mib(shape, args.dtype, args.threads, tiles, sdpa=False)
                cells.append(f"{'default' if tiles is None else '%dx%d' % tiles} {ours:.1f} (x{ours / sdpa:.3f})")
            print(f"{shape} {str(args.dtype).replace('torch.', '')}: sdpa {sdpa:.1f} | " + " ".join(cells), flush=True)
    finally:
        m.set_backward_key_chunks(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
