#!/usr/bin/env python3
"""float32 flash forward vs torch SDPA on one thread, with flush-to-zero/denormals-are-zero off and on
(torch.set_flush_denormal), alternating in one process: does any instruction of either kernel produce or read a
subnormal (on the device host's Xeon each such AVX-512 instruction costs a ~95 ns microcode assist)?

    python benchmarks/probe_f32_denormal.py --shapes 1,12,1024,64 1,4,2048,128
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


def once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1,12,1024,64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# isa {cs149gpt.isa()}, {args.threads} thread(s), float32, non-causal; medians of {args.rounds} rounds")
    print("| shape | flush | SDPA ms | ours ms | ×SDPA |")
    print("|---|---|---:|---:|---:|")
    for text in args.shapes:
        B, H, N, d = (int(x) for x in text.split(","))
        q, k, v = (torch.randn(B, H, N, d) for _ in range(3))
        times = {}
        for _ in range(args.rounds):
            for flush in (False, True):
                torch.set_flush_denormal(flush)
                times.setdefault((flush, "sdpa"), []).append(once(lambda: F.scaled_dot_product_attention(q, k, v)))
                times.setdefault((flush, "ours"), []).append(once(lambda: cs149gpt.attention(q, k, v, impl="flash")))
        torch.set_flush_denormal(False)
        for flush in (False, True):
            s, o = (statistics.median(times[(flush, name)]) * 1e3 for name in ("sdpa", "ours"))
            print(f"| {text} | {'on' if flush else 'off'} | {s:.2f} | {o:.2f} | {s / o:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
