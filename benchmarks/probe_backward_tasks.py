#!/usr/bin/env python3
"""How the one-pass backward's tasks should be cut when there are as many (batch, kv head) pairs as CPUs: one task per
pair (chunks 1), each pair's keys split into 2 or 4 runs (tasks of their
own, dynamically scheduled, partial dQ summed afterwards), or the two-pass kernel. With exactly one task per CPU a
single slow CPU holds up the call; more tasks let the others take up its work, for partial dQ buffers in memory.
Same process, interleaved rounds, torch SDPA's backward timed alongside; the peak memory of one backward each.

    python benchmarks/probe_backward_tasks.py --shapes 1,16,4096,128 --threads 16
    python benchmarks/probe_backward_tasks.py --shapes 1,8/1,1024,256 --dtype bfloat16 --threads 1,16 \
        --variants auto,two_pass,chunks_4,chunks_8_bk128

A shape B,Hq/Hkv,N,d has Hkv kv heads (GQA); a variant "chunks_C_bkK_pP" forces the one-pass kernel with C key runs,
key tiles of K (given to the forward, which keeps them for the backward) and, float32, each kv head's query heads in
P parts (default 1; "auto" leaves all three to module.cpp).
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
    parser.add_argument("--threads", default="16", help="comma list")
    parser.add_argument("--causal", default="no,yes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default=None, help="comma list (default: all)")
    args = parser.parse_args()
    m = _ext.load()
    dtype = getattr(torch, args.dtype)
    def variant(name):  # (path, key chunks, key tile, head parts)
        if name == "auto":
            return ("auto", 0, None, 0)
        if name == "two_pass":
            return ("two_pass", 0, None, 0)
        fields = name.split("_")  # chunks_C[_bkK][_pP]
        tile = next((int(f[2:]) for f in fields[2:] if f.startswith("bk")), None)
        head_parts = next((int(f[1:]) for f in fields[2:] if f.startswith("p")), 1)
        return ("one_pass", int(fields[1]), tile, head_parts)

    names = (args.variants or "auto,chunks_1,chunks_2,chunks_4,two_pass").split(",")
    variants = {"sdpa": None, **{name: variant(name) for name in names}}
    print(f"# {args.dtype}, isa {cs149gpt.isa()}; backward alone (autograd.grad of a recorded forward), min and "
          f"median of {args.rounds} interleaved rounds")
    print("| shape | causal | threads | variant | min ms | median ms | ×SDPA (min) | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for text in args.shapes:
        B, heads, N, d = text.split(",")
        Hq, Hkv = (int(x) for x in (heads.split("/") if "/" in heads else (heads, heads)))
        B, N, d = int(B), int(N), int(d)
        for causal, threads in ((c == "yes", int(t)) for c in args.causal.split(",") for t in args.threads.split(",")):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(B, Hq, N, d, generator=g).to(dtype).requires_grad_()
            k, v = (torch.randn(B, Hkv, N, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
            dout = torch.randn(B, Hq, N, d, generator=g).to(dtype)
            outs = {"sdpa": F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv)}
            for name, spec in variants.items():
                if spec is not None and spec[2] not in outs:
                    outs[spec[2]] = cs149gpt.attention(q, k, v, is_causal=causal, block_k=spec[2])
            times = {name: [] for name in variants}
            peaks = {}
            with torch_threads(threads):
                def call(name):
                    out = outs["sdpa" if name == "sdpa" else variants[name][2]]
                    if name != "sdpa":
                        m.set_backward_path(variants[name][0])
                        m.set_backward_key_chunks(variants[name][1])
                        m.set_backward_head_parts(variants[name][3])
                    try:
                        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                    finally:
                        m.set_backward_path("auto")
                        m.set_backward_key_chunks(0)
                        m.set_backward_head_parts(0)
                reference = call("sdpa")
                for name in variants:
                    got = call(name)
                    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, reference))
                    assert err < (1e-2 if dtype == torch.float32 else 0.5), f"{name}: gradients differ from SDPA's by {err}"
                    peaks[name] = peak_allocator_bytes(lambda: call(name), threads)
                for _ in range(args.rounds):
                    for name in variants:
                        start = time.perf_counter()
                        call(name)
                        times[name].append(time.perf_counter() - start)
            base = min(times["sdpa"])
            for name, t in times.items():
                peak = peaks[name]
                print(f"| {text} | {'yes' if causal else 'no'} | {threads} | {name} | {min(t) * 1e3:.1f} | "
                      f"{statistics.median(t) * 1e3:.1f} | {base / min(t):.2f} | "
                      f"{'-' if peak is None else f'{peak / 2**20:.0f}'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
