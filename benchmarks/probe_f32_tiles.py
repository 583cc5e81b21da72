#!/usr/bin/env python3
"""float32 forward on AMX: float32 FMAs (flash.cpp) against the bf16 tiles with every operand in three bf16 parts
(flash_bf16.cpp), and torch's SDPA, same run, interleaved rounds — to place flash_bf16.cpp's kFloat32MinHeadDim.

    python benchmarks/probe_f32_tiles.py --shapes 1,12,1024,64 1,8,2048,96 1,16,2048,128 --threads 1,16
    python benchmarks/probe_f32_tiles.py --shapes 1,16,2048,128 --threads 1 --tiles 128x512 128x256 64x128
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
from cs149gpt import _ext  # noqa: E402


def seconds(fn, min_time: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time or calls < 2:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def sweep(args) -> int:
    m = _ext.load()
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}; ms = median of {args.rounds} interleaved rounds; "
          "fma and 'default' at the kernels' default tiles")
    print("| shape | causal | threads | tiles | ms | ×fma |")
    print("|---|---|---|---|---|---|")
    try:
        for shape in args.shapes:
            b, h, n, d = (int(x) for x in shape.split(","))
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
            for causal in {"off": [False], "on": [True], "both": [False, True]}[args.causal]:
                for threads in (int(t) for t in args.threads.split(",")):
                    torch.set_num_threads(threads)
                    configs = ["fma", "default", *args.tiles]
                    times = {c: [] for c in configs}
                    for _ in range(args.rounds):
                        for c in configs:
                            m.set_float32_products("fma" if c == "fma" else "bf16_tiles")
                            bq, bk = (None, None) if c in ("fma", "default") else (int(x) for x in c.split("x"))
                            times[c].append(seconds(lambda: cs149gpt.attention(q, k, v, is_causal=causal, block_q=bq,
                                                                               block_k=bk), args.min_time))
                    ms = {c: statistics.median(t) * 1e3 for c, t in times.items()}
                    for c in configs:
                        print(f"| {shape} | {'yes' if causal else 'no'} | {threads} | {c} | {ms[c]:.2f} | "
                              f"{ms['fma'] / ms[c]:.2f} |", flush=True)
    finally:
        m.set_float32_products("auto")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,12,1024,64", "1,8,2048,96", "1,16,2048,128"])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--causal", choices=("off", "on", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--tiles", nargs="*", default=[],
                        help="instead: the bf16 tiles path alone at these tiles (block_q x block_k), against fma")
    args = parser.parse_args()
    if args.tiles:
        return sweep(args)
    m = _ext.load()
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}; ms = median of {args.rounds} interleaved rounds")
    print("| shape | causal | threads | SDPA ms | fma ms | bf16_tiles ms | fma ×SDPA | tiles ×SDPA | tiles ×fma |")
    print("|---|---|---|---|---|---|---|---|---|")
    causal_modes = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    try:
        for shape in args.shapes:
            b, h, n, d = (int(x) for x in shape.split(","))
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
            for causal in causal_modes:
                for threads in (int(t) for t in args.threads.split(",")):
                    torch.set_num_threads(threads)
                    times = {"sdpa": [], "fma": [], "bf16_tiles": []}
                    for _ in range(args.rounds):
                        for how in times:
                            if how == "sdpa":
                                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                            else:
                                m.set_float32_products(how)
                                fn = lambda: cs149gpt.attention(q, k, v, is_causal=causal)  # noqa: E731
                            times[how].append(seconds(fn, args.min_time))
                    ms = {how: statistics.median(t) * 1e3 for how, t in times.items()}
                    print(f"| {shape} | {'yes' if causal else 'no'} | {threads} | {ms['sdpa']:.2f} | {ms['fma']:.2f} | "
                          f"{ms['bf16_tiles']:.2f} | {ms['sdpa'] / ms['fma']:.2f} | {ms['sdpa'] / ms['bf16_tiles']:.2f} | "
                          f"{ms['fma'] / ms['bf16_tiles']:.2f} |", flush=True)
    finally:
        m.set_float32_products("auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
