#!/usr/bin/env python3
"""Masked prefill attention: cs149gpt's flash kernel against torch's SDPA given the same attn_mask, same run.

The masks real models pass (tests/test_real_models.py):
    padded causal   bool (B, 1, N, N): causal and left padding, is_causal=False — transformers' prefill of a
                    padded batch (Llama, GPT-2)
    key padding     bool (B, 1, 1, N): right padding, not causal — an encoder (BERT) on a padded batch
    additive bias   float32 (1, H, N, N): an ALiBi-style bias with −inf above the diagonal — every block cut

    python benchmarks/bench_masks.py                          # (4, 12, 1024, 64), float32 and bfloat16, 1 thread
    python benchmarks/bench_masks.py --threads 1,16 --shape 4,12,1024,64 --markdown

Timing: the two implementations alternate, each call timed on its own; the median of each is reported, and
×SDPA = SDPA's median / ours (> 1: ours is faster). `max diff` is the largest |ours − SDPA| (a sanity check).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_lengths(b: int, n: int) -> list[int]:
    """Sequence lengths of a padded batch: the longest fills N, the others 7/8, 5/8, 1/2 of it, ..."""
    fractions = [1.0, 0.875, 0.625, 0.5, 0.75, 0.375, 0.9375, 0.25]
    return [max(1, int(n * fractions[i % len(fractions)])) for i in range(b)]


def make_mask(case: str, b: int, h: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """(mask, number of visible (query, key) pairs summed over the batch and heads)."""
    lengths = padded_lengths(b, n)
    if case == "padded causal":
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = torch.zeros(b, n, dtype=torch.bool)
        for i, length in enumerate(lengths):
            keep[i, n - length:] = True  # left padding
        mask = (causal[None] & keep[:, None, :])[:, None]  # (B, 1, N, N)
    elif case == "key padding":
        mask = torch.zeros(b, 1, 1, n, dtype=torch.bool)
        for i, length in enumerate(lengths):
            mask[i, ..., :length] = True  # right padding
    elif case == "additive bias":
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])
        distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()  # j − i
        mask = (slopes[:, None, None] * distance[None]).masked_fill(distance[None] > 0, float("-inf"))[None]
    else:
        raise ValueError(case)
    visible = int(mask.expand(b, h, n, n).ne(False if mask.dtype == torch.bool else float("-inf")).sum())
    return mask, visible


def time_pair(fns: dict, min_time: float) -> dict[str, float]:
    """Median seconds per call of each function, alternating between them for at least min_time each."""
    for fn in fns.values():
        fn()
        fn()
    samples = {name: [] for name in fns}
    spent = 0.0
    while spent < min_time * len(fns) or min(len(s) for s in samples.values()) < 5:
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            samples[name].append(elapsed)
            spent += elapsed
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,12,1024,64", help="B,H,N,d")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--cases", default="padded causal,key padding,additive bias",
                        help="comma-separated; _ for a space (additive_bias)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per implementation and row")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    print(f"# torch {torch.__version__}, cs149gpt isa {cs149gpt.isa()}, shape (B,H,N,d) = ({b},{h},{n},{d})")
    header = ["case", "dtype", "threads", "SDPA ms", "flash ms", "×SDPA", "GFLOP/s (flash)", "max diff"]
    print(("| " + " | ".join(header) + " |") if args.markdown else "  ".join(f"{c:>16}" for c in header))
    if args.markdown:
        print("|" + "---|" * len(header))
    g = torch.Generator().manual_seed(0)
    for dtype_name in args.dtype.split(","):
        dtype = DTYPES[dtype_name]
        q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))
        for case in (c.replace("_", " ") for c in args.cases.split(",")):  # additive_bias: no space to quote
            mask, visible = make_mask(case, b, h, n, dtype)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                fns = {
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                    "flash": lambda: cs149gpt.attention(q, k, v, attn_mask=mask),
                }
                with torch.no_grad():
                    diff = (fns["sdpa"]().float() - fns["flash"]().float()).abs()
                    # rows that see no key: torch and ours both give 0
                    max_diff = diff.max().item()
                    t = time_pair(fns, args.min_run_time)
                gflops = 4 * visible * d / t["flash"] * 1e-9
                cells = [case, dtype_name, str(threads), f"{t['sdpa'] * 1e3:.2f}", f"{t['flash'] * 1e3:.2f}",
                         f"{t['sdpa'] / t['flash']:.2f}", f"{gflops:.1f}", f"{max_diff:.2g}"]
                print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(f"{c:>16}" for c in cells),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
