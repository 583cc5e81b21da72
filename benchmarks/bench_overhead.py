#!/usr/bin/env python3
"""Per-call cost at tiny shapes: what the Python layer adds above the operator call, and where torch SDPA stands.

At a tiny shape (default: one query, 16 keys, 4 heads, d = 32) the kernel is a few hundred nanoseconds, so the
time per call is the call itself: argument checks, dispatch, allocation of the output. For each entry point the
median over rounds of many calls (µs per call), and the wrapper's cost above the bare operator it calls:

    op            torch.ops.cs149gpt.attention(q, k, v, "flash", ...)   (the C++ operator through the dispatcher,
                  called below the autograd layer: the least a Python call of it costs)
    attention     cs149gpt.attention(q, k, v)                            (the Python wrapper around it)
    sdpa_ours     cs149gpt.scaled_dot_product_attention(q, k, v)         (torch's signature, our kernel)
    torch_sdpa    torch.nn.functional.scaled_dot_product_attention(q, k, v)
    kv_op, kvcache  torch.ops.cs149gpt.attention_with_kvcache / cs149gpt.attention_with_kvcache
    masked        cs149gpt.scaled_dot_product_attention / torch's, with a (B, 1, 1, Nk) bool key-padding attn_mask
                  (what a padded batch's decoding step passes)

    python benchmarks/bench_overhead.py [--threads 1] [--keys 16] [--calls 20000]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402


def per_call_us(fn, calls: int, rounds: int = 7) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keys", default="16,128")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"cs149gpt {cs149gpt.isa()}, torch {torch.__version__}, {args.threads} thread(s); µs per call, median")
    ops = torch.ops.cs149gpt
    print("\n| shape (B,H,Nq,Nk,d) | dtype | op | attention | attention − op | sdpa_ours | sdpa_ours − op | "
          "torch_sdpa | kv_op | kvcache | kvcache − kv_op | masked sdpa_ours | masked torch_sdpa |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.keys.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            B, H, nq, d = 1, 4, 1, 32
            q = torch.randn(B, H, nq, d).to(dtype)
            k, v = torch.randn(B, H, n, d).to(dtype), torch.randn(B, H, n, d).to(dtype)
            seqlens = torch.full((B,), n, dtype=torch.int32)
            mask = torch.ones(B, 1, 1, n, dtype=torch.bool)
            mask[..., : n // 8] = False  # left padding
            with torch.inference_mode(False):
                fns = {
                    "op": lambda: ops.attention(q, k, v, "flash", None, "none", None, None),
                    "attention": lambda: cs149gpt.attention(q, k, v),
                    "sdpa_ours": lambda: cs149gpt.scaled_dot_product_attention(q, k, v),
                    "torch_sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                    "kv_op": lambda: ops.attention_with_kvcache(q, k, v, seqlens, None, None, None, None, False),
                    "kvcache": lambda: cs149gpt.attention_with_kvcache(q, k, v, seqlens, is_causal=False),
                    "masked_ours": lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                    "masked_torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                }
                us = {name: per_call_us(fn, args.calls) for name, fn in fns.items() if not name.endswith("op")}
                with torch._C._AutoDispatchBelowAutograd():  # the bare operators: no autograd layer to cross
                    us.update({name: per_call_us(fn, args.calls) for name, fn in fns.items() if name.endswith("op")})
            print(f"| {B},{H},{nq},{n},{d} | {str(dtype).replace('torch.', '')} | {us['op']:.2f} | "
                  f"{us['attention']:.2f} | {us['attention'] - us['op']:+.2f} | {us['sdpa_ours']:.2f} | "
                  f"{us['sdpa_ours'] - us['op']:+.2f} | {us['torch_sdpa']:.2f} | {us['kv_op']:.2f} | "
                  f"{us['kvcache']:.2f} | {us['kvcache'] - us['kv_op']:+.2f} | {us['masked_ours']:.2f} | "
                  f"{us['masked_torch']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
