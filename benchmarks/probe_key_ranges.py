#!/usr/bin/env python3
"""What taking a padding mask as per-row key ranges buys, in one process: the same right-padding mask (B, 1, N, N)
as transformers builds it, passed contiguous (module.cpp turns it into key ranges) and with its keys strided (read
as a mask, block by block), and no mask at all, in alternating rounds. Medians of 30 calls each.

    python benchmarks/probe_key_ranges.py --threads 1,16
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cs149gpt  # noqa: E402
from probe_small_calls import sentence_batch  # noqa: E402


def median_ms(fn, calls=30):
    fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["32,8,128,64", "4,8,512,64", "8,12,256,64"])
    parser.add_argument("--threads", default="1")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}; ms per call, two rounds")
    print("| B,H,N,d | dtype | threads | key ranges | mask read | no mask | mask / ranges |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for shape in args.shapes:
            B, H, N, d = (int(x) for x in shape.split(","))
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v, runs = sentence_batch(B, H, N, d, dtype, g)
                wide = torch.zeros(B, 1, N, 2 * N, dtype=torch.bool)
                wide[..., ::2] = runs
                strided = wide[..., ::2]  # the same mask; keys 2 bytes apart: not taken as ranges
                rounds = []
                with torch.no_grad():
                    for _ in range(2):
                        rounds.append([median_ms(lambda m=m: cs149gpt.scaled_dot_product_attention(
                            q, k, v, attn_mask=m)) for m in (runs, strided, None)])
                r, m, n = (statistics.median(x) for x in zip(*rounds))
                print(f"| {shape} | {str(dtype)[6:]} | {threads} | {r:.3f} | {m:.3f} | {n:.3f} | {m / r:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
