#!/usr/bin/env python3
"""Where a training step's time goes, with our flash attention and with torch SDPA: torch.profiler over a few steps
of bench_train.py's loop (same model, weights and batch for both), the ops sorted by self CPU time, and the share
of the step spent in attention (forward and backward kernels, ours or torch's) and in the copies around it.

    python benchmarks/profile_train.py --config nano256 --precision fp32 --threads 16 --steps 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as fwd_bench  # noqa: E402  (repo root on sys.path)
import bench_train  # noqa: E402

# Profiler event names of the attention kernels: ours (the autograd node's forward holds the kernel's time, the
# backward op its own) and torch's CPU flash attention.
ATTENTION_EVENTS = ("cs149gpt::flash_attention", "cs149gpt::flash_attention_backward",
                    "aten::_scaled_dot_product_flash_attention_for_cpu",
                    "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="nano256", choices=list(bench_train.CONFIGS))
    parser.add_argument("--precision", default="fp32", choices=bench_train.PRECISIONS)
    parser.add_argument("--threads", type=fwd_bench.parse_threads, default=fwd_bench.usable_cpus())
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = bench_train.CONFIGS[args.config]
    models = bench_train.make_models(shape, args.precision)
    gen = torch.Generator().manual_seed(1)
    T, vocab = shape.config.block_size, shape.config.vocab_size
    x, y = (torch.randint(vocab, (shape.batch_size, T), generator=gen) for _ in range(2))
    for impl, (model, optimizer) in models.items():
        for _ in range(2):  # warm-up
            bench_train.train_step(model, optimizer, x, y, args.precision)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                bench_train.train_step(model, optimizer, x, y, args.precision)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        attention = sum(e.cpu_time_total for e in events if e.key in ATTENTION_EVENTS)
        print(f"===== {impl}: {args.config} {args.precision} t={args.threads}, {args.steps} steps, "
              f"{total / args.steps / 1e3:.1f} ms of self CPU time a step; attention kernels "
              f"{attention / args.steps / 1e3:.1f} ms a step ({100 * attention / total:.1f}%)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
