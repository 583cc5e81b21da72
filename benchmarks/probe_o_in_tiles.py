#!/usr/bin/env python3
"""A/B of the bf16 AMX forward's two paths (flash_bf16.cpp): O in tile registers (the default at head_dim <= 64) and
the general path (O in memory, set_o_in_tiles(False)), beside torch SDPA, in the same process: each round times
sdpa, on, off, then the next round in reverse order. Prints min and median per variant and the ratio to SDPA of
the medians, and of each round's own pair (median over rounds).

    python benchmarks/probe_o_in_tiles.py --shapes 1,12,1024,64 --threads 1,16 --rounds 5
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import torch_threads  # noqa: E402

import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,4,1024,32", "1,12,1024,64", "4,12,2048,64"])
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--min-run-time", type=float, default=0.15)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    m = _ext.load()
    dtype = getattr(torch, args.dtype)
    print(f"# {args.dtype}, isa {cs149gpt.isa()}, {args.rounds} rounds of blocked_autorange({args.min_run_time} s)")
    print("| shape | causal | threads | sdpa ms | O in tiles ms | general ms | ×SDPA tiles | ×SDPA general | "
          "O in tiles speed-up (per round) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for text in args.shapes:
        B, H, N, d = (int(x) for x in text.split(","))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, N, d, generator=g).to(dtype) for _ in range(3))
        for threads in (int(t) for t in args.threads.split(",")):
            for causal in (False, True):
                calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                         "on": lambda: cs149gpt.attention(q, k, v, is_causal=causal),
                         "off": lambda: cs149gpt.attention(q, k, v, is_causal=causal)}
                times = {name: [] for name in calls}
                with torch_threads(threads):
                    want = calls["sdpa"]().float()
                    for name in ("on", "off"):
                        m.set_o_in_tiles(name == "on")
                        err = (calls[name]().float() - want).abs().max().item()
                        assert err < 0.05, f"{name}: differs from SDPA by {err}"
                    order = list(calls)
                    for r in range(args.rounds):
                        for name in (order if r % 2 == 0 else order[::-1]):
                            m.set_o_in_tiles(name != "off")
                            timer = benchmark.Timer(stmt="fn()", globals={"fn": calls[name]}, num_threads=threads)
                            times[name].append(timer.blocked_autorange(min_run_time=args.min_run_time).median)
                    m.set_o_in_tiles(True)
                med = {name: statistics.median(t) for name, t in times.items()}
                pair = statistics.median(a / b for a, b in zip(times["off"], times["on"]))
                print(f"| {text} | {'yes' if causal else 'no'} | {threads} | {med['sdpa'] * 1e3:.2f} | "
                      f"{med['on'] * 1e3:.2f} | {med['off'] * 1e3:.2f} | {med['sdpa'] / med['on']:.2f} | "
                      f"{med['sdpa'] / med['off']:.2f} | {pair:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
