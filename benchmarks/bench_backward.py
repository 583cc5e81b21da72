#!/usr/bin/env python3
"""Times the flash backward pass against PyTorch's scaled_dot_product_attention backward, in the same run.

For every (shape, causal, threads) it measures, for ours (cs149gpt.attention, impl="flash") and for SDPA:
    fwd       the forward alone
    bwd       the backward alone: torch.autograd.grad of a forward recorded once (retain_graph)
    fwd+bwd   a training step's attention: forward, then backward
interleaved (sdpa, ours, ours, sdpa, ...) with torch.utils.benchmark, and prints ms, GFLOP/s, the ratio to SDPA
(SDPA time / our time: > 1 means faster) and the peak extra memory of one backward. Rows where an implementation's
backward alone took longer than its forward + backward are marked "noisy" (and "noisy": true in the JSON).

FLOPs follow the FlashAttention papers: the backward does 2.5× the forward's 4·B·H·pairs·d (five matrix
products against two), recomputing P included in neither count.

    python benchmarks/bench_backward.py                         # the forward benchmark's quick shapes
    python benchmarks/bench_backward.py --shapes 1,12,1024,64 --threads 1,all --causal both --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as fwd_bench  # noqa: E402  (shares the shapes, FLOP count, machine info, memory probe)
from bench_attention import Shape, attention_flops, machine_info, peak_allocator_bytes, torch_threads  # noqa: E402

import cs149gpt  # noqa: E402  (bench_attention put the repo root on sys.path)

PHASES = ("fwd", "bwd", "fwd+bwd")
PHASE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
QUICK_SHAPES = (Shape(1, 4, 1024, 32), Shape(1, 12, 1024, 64), Shape(4, 12, 2048, 64))


def make_phase(attend: Callable, q, k, v, dout, phase: str) -> Callable[[], object]:
    inputs = (q, k, v)
    if phase == "fwd":
        return lambda: attend(*inputs)
    if phase == "fwd+bwd":
        return lambda: torch.autograd.grad(attend(*inputs), inputs, dout)
    out = attend(*inputs)  # recorded once; each timed call walks the same graph again
    return lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)


def time_call(fn: Callable[[], object], threads: int, min_run_time: float) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median


def run(shape: Shape, causal: bool, threads: int, args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq_len, shape.head_dim, generator=gen,
                           dtype=args.dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(q.shape, generator=gen, dtype=args.dtype)
    attends = {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "flash": lambda q, k, v: cs149gpt.attention(q, k, v, impl="flash", is_causal=causal),
    }
    rows = []
    with torch_threads(threads):
        # The gradients must agree before their speed means anything.
        grads = {name: torch.autograd.grad(a(q, k, v), (q, k, v), dout) for name, a in attends.items()}
        error = max((a - b).abs().max().item() for a, b in zip(grads["flash"], grads["sdpa"]))
        for phase in PHASES:
            calls = {name: make_phase(a, q, k, v, dout, phase) for name, a in attends.items()}
            times = {name: [] for name in calls}
            order = list(calls)
            for _ in range(args.rounds):  # interleaved, each round reversed
                for name in order:
                    times[name].append(time_call(calls[name], threads, args.min_run_time))
                order.reverse()
            best = {name: min(t) for name, t in times.items()}
            flops = attention_flops(shape, causal) * PHASE_FLOP_FACTOR[phase]
            for name in attends:
                rows.append(dict(shape=str(shape), causal=causal, dtype=str(args.dtype).replace("torch.", ""),
                                 threads=threads, impl=name, phase=phase, ms=best[name] * 1e3,
                                 gflops=flops / best[name] * 1e-9, vs_sdpa=best["sdpa"] / best[name],
                                 max_grad_diff=error))
        # A backward alone slower than a forward plus that backward can only be noise (another process, a clock
        # change during one phase): said on the rows, since one noisy phase flips a ratio.
        for name in attends:
            ms = {r["phase"]: r["ms"] for r in rows if r["impl"] == name}
            if ms["bwd"] > ms["fwd+bwd"]:
                for r in rows:
                    if r["impl"] == name and r["phase"] in ("bwd", "fwd+bwd"):
                        r["noisy"] = True
        if args.memory:
            for name, a in attends.items():
                out = a(q, k, v)
                peak = peak_allocator_bytes(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                            threads)
                for row in rows:
                    if row["impl"] == name and row["phase"] == "bwd":
                        row["bwd_peak_mib"] = None if peak is None else peak / 2**20
    return rows


def markdown(rows: Sequence[dict], memory: bool) -> str:
    head = ["shape (B,H,N,d)", "causal", "dtype", "threads", "phase", "impl", "ms", "GFLOP/s", "×SDPA"]
    if memory:
        head.append("bwd peak MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], "yes" if r["causal"] else "no", r["dtype"], str(r["threads"]), r["phase"], r["impl"],
                 f"{r['ms']:.2f}", f"{r['gflops']:.1f}", f"{r['vs_sdpa']:.2f}"]
        if memory:
            peak = r.get("bwd_peak_mib")
            cells.append("" if peak is None else f"{peak:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", type=fwd_bench.parse_shape, default=list(QUICK_SHAPES),
                        metavar="B,H,N,d")
    parser.add_argument("--threads", type=lambda t: fwd_bench.parse_list(t, fwd_bench.parse_threads),
                        default=[1, fwd_bench.usable_cpus()], help="comma list; 'all' = every usable CPU")
    parser.add_argument("--causal", choices=("off", "on", "both"), default="both")
    parser.add_argument("--dtype", type=fwd_bench.parse_dtype, default=torch.float32)
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="also the peak extra memory of one backward")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    machine = machine_info()
    print(f"# {machine.get('cpu_model')}, {machine.get('usable_cpus')} CPUs, torch {torch.__version__}, "
          f"cs149gpt ISA {cs149gpt.isa()}", flush=True)
    rows = []
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal]
    for threads in args.threads:
        for shape in args.shapes:
            for causal in causals:
                new = run(shape, causal, threads, args)
                for r in new:
                    print(f"{r['shape']:>14} causal={r['causal']:d} t={r['threads']:<2} {r['phase']:>7} "
                          f"{r['impl']:>5} {r['ms']:9.2f} ms {r['gflops']:7.1f} GFLOP/s x{r['vs_sdpa']:.2f}"
                          + (f" peak {r['bwd_peak_mib']:.1f} MiB" if r.get("bwd_peak_mib") is not None else "")
                          + (" noisy: bwd > fwd+bwd" if r.get("noisy") else ""),
                          flush=True)
                rows += new
    print()
    print(markdown(rows, args.memory))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
