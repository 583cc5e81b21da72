#!/usr/bin/env python3
"""How the one-pass backward's tasks should be cut when there are as many (batch, kv head) pairs as CPUs: one task per
pair (chunks 1), each pair's keys split into 2 or 4 runs (tasks of their
own, dynamically scheduled, partial dQ summed afterwards), or the two-pass kernel. With exactly one task per CPU a
single slow CPU holds up the call; more tasks let the others take up its work, for partial dQ buffers in memory.
Same process, interleaved rounds, torch SDPA's backward timed alongside; the peak memory of one backward each.

    python benchmarks/probe_backward_tasks.py --shapes 1,16,4096,128 --threads 16
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import peak_allocator_bytes, torch_threads  # noqa: E402

import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,16,4096,128"])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default=None, help="comma list (default: all)")
    args = parser.parse_args()
    m = _ext.load()
    dtype = getattr(torch, args.dtype)
    variants = {"sdpa": None, "auto": ("auto", 0), "chunks 1": ("one_pass", 1), "chunks 2": ("one_pass", 2),
                "chunks 4": ("one_pass", 4), "two pass": ("two_pass", 0)}
    if args.variants:
        variants = {name: variants[name] for name in ["sdpa"] + args.variants.split(",")}
    print(f"# {args.dtype}, {args.threads} threads, isa {cs149gpt.isa()}; backward alone (autograd.grad of a recorded "
          f"forward), min and median of {args.rounds} interleaved rounds")
    print("| shape | causal | variant | min ms | median ms | ×SDPA (min) | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for text in args.shapes:
        B, H, N, d = (int(x) for x in text.split(","))
        for causal in (False, True):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
            dout = torch.randn(B, H, N, d, generator=g, dtype=dtype)
            outs = {"sdpa": F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    "ours": cs149gpt.attention(q, k, v, is_causal=causal)}
            times = {name: [] for name in variants}
            peaks = {}
            with torch_threads(args.threads):
                def call(name):
                    out = outs["sdpa" if name == "sdpa" else "ours"]
                    if name != "sdpa":
                        m.set_backward_path(variants[name][0])
                        m.set_backward_key_chunks(variants[name][1])
                    try:
                        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    finally:
                        m.set_backward_path("auto")
                        m.set_backward_key_chunks(0)
                reference = call("sdpa")
                for name in variants:
                    got = call(name)
                    err = max((a - b).abs().max().item() for a, b in zip(got, reference))
                    assert err < 1e-2, f"{name}: gradients differ from SDPA's by {err}"
                    peaks[name] = peak_allocator_bytes(lambda: call(name), args.threads)
                for _ in range(args.rounds):
                    for name in variants:
                        start = time.perf_counter()
                        call(name)
                        times[name].append(time.perf_counter() - start)
            base = min(times["sdpa"])
            for name, t in times.items():
                peak = peaks[name]
                print(f"| {text} | {'yes' if causal else 'no'} | {name} | {min(t) * 1e3:.1f} | "
                      f"{statistics.median(t) * 1e3:.1f} | {base / min(t):.2f} | "
                      f"{'-' if peak is None else f'{peak / 2**20:.0f}'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
