#!/usr/bin/env python3
"""Per-call time of small attention calls (an encoder's sentence batches: many short sequences), ours against
torch's SDPA, same run: unmasked, and with the (B, 1, N, N) boolean key-padding mask transformers builds for a
right-padded batch (BERT). Run it once per ISA (CS149GPT_ISA=amx, avx512_bf16, ...) to see what the AMX path costs
at a shape where there is little arithmetic per call.

    python benchmarks/probe_small_calls.py --threads 1,16 --dtype bfloat16,float32
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


def median_ms(fn, min_time=0.3):
    fn()
    fn()
    samples, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(samples) < 5:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def sentence_batch(B, H, N, d, dtype, g):
    """q, k, v as a model makes them — (B, N, H·d) projections viewed as (B, H, N, d) — and the (B, 1, N, N) boolean
    mask transformers' sdpa_mask builds for a right-padded batch (sequence i padded by i·N / 2B keys)."""
    q, k, v = (torch.randn(B, N, H, d, generator=g).to(dtype).transpose(1, 2) for _ in range(3))
    keep = torch.ones(B, N, dtype=torch.bool)
    for i in range(B):
        keep[i, N - (i * N) // (2 * B):] = False
    return q, k, v, keep[:, None, None, :].expand(B, 1, N, N).contiguous()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["32,8,128,64", "4,8,512,64", "8,12,256,64"])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--dtype", default="bfloat16,float32")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}")
    print("| B,H,N,d | dtype | threads | mask | SDPA ms | ours ms | ×SDPA |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape in args.shapes:
            B, H, N, d = (int(x) for x in shape.split(","))
            for dtype in (getattr(torch, name) for name in args.dtype.split(",")):
                q, k, v, padding = sentence_batch(B, H, N, d, dtype, g)
                for name, mask in (("none", None), ("key padding (B,1,N,N)", padding)):
                    with torch.no_grad():
                        theirs = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                        ours = median_ms(lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                    print(f"| {shape} | {str(dtype)[6:]} | {threads} | {name} | {theirs:.3f} | {ours:.3f} | "
                          f"{theirs / ours:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
