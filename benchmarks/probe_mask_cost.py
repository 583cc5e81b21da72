#!/usr/bin/env python3
"""What an attn_mask costs our forward, by kind of mask: the same (B, H, N, d) call with no mask (causal or not) and with
the masks real models pass, ours and torch's SDPA alternating, each call timed on its own (medians), and ours' time per
score the mask leaves visible. Session 19: on the device host one thread's bf16 call with an ALiBi-style (1, H, N, N)
float32 bias took 71 ms against ~29 ms causal without a mask (results/s18d_masks.txt): where does the difference go?

    python benchmarks/probe_mask_cost.py --threads 1,16 --dtype bfloat16,float32
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


def masks(b: int, h: int, n: int, dtype: torch.dtype) -> dict:
    """name -> (attn_mask or None, is_causal, block_q, block_k, visible (query, key) pairs over the batch and heads)."""
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    alibi = (slopes[:, None, None] * distance[None]).masked_fill(distance[None] > 0, float("-inf"))[None]
    t5 = (slopes[:, None, None] * distance.abs()[None] * -1.0)[None]  # finite everywhere: every block cut
    causal_pairs, all_pairs = b * h * n * (n + 1) // 2, b * h * n * n
    return {
        "no mask, causal": (None, True, None, None, causal_pairs),
        "no mask": (None, False, None, None, all_pairs),
        "bool causal (1,1,N,N)": (tril[None, None], False, None, None, causal_pairs),
        "float 0/-inf causal (1,1,N,N)": (torch.zeros(n, n).masked_fill(~tril, float("-inf"))[None, None], False,
                                          None, None, causal_pairs),
        "alibi f32 (1,H,N,N)": (alibi, False, None, None, causal_pairs),
        "alibi q-dtype (1,H,N,N)": (alibi.to(dtype), False, None, None, causal_pairs),
        "alibi f32, 128-key tiles": (alibi, False, None, 128, causal_pairs),
        "alibi f32, 256-key tiles": (alibi, False, None, 256, causal_pairs),
        "t5 f32 (1,H,N,N), no -inf": (t5, False, None, None, all_pairs),
        # the same biases, one copy per batch element: what each costs when no batch element can reuse another's rows
        "alibi f32 (B,H,N,N)": (alibi.expand(b, -1, -1, -1).contiguous(), False, None, None, causal_pairs),
        "t5 f32 (B,H,N,N), no -inf": (t5.expand(b, -1, -1, -1).contiguous(), False, None, None, all_pairs),
    }


def median_times(fns: dict, min_time: float) -> dict:
    for fn in fns.values():
        fn()
    samples = {name: [] for name in fns}
    start = time.perf_counter()
    while time.perf_counter() - start < min_time * len(fns) or min(len(s) for s in samples.values()) < 5:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,12,1024,64")
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--cases", default="", help="comma-separated prefixes of the case names (default: all)")
    parser.add_argument("--min-time", type=float, default=0.4)
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}, (B,H,N,d) = ({b},{h},{n},{d})")
    print("| case | dtype | threads | SDPA ms | ours ms | ×SDPA | ours ns per visible score |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(3))
        for name, (mask, causal, bq, bk, visible) in masks(b, h, n, dtype).items():
            if args.cases and not any(name.startswith(c) for c in args.cases.split(",")):
                continue
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal),
                       "ours": lambda: cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=causal, block_q=bq,
                                                          block_k=bk)}
                with torch.no_grad():
                    t = median_times(fns, args.min_time)
                print(f"| {name} | {dtype_name} | {threads} | {t['sdpa'] * 1e3:.2f} | {t['ours'] * 1e3:.2f} | "
                      f"{t['sdpa'] / t['ours']:.2f} | {t['ours'] / visible * 1e9 * threads:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
