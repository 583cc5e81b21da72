#!/usr/bin/env python3
"""Training-step throughput of cs149gpt/model.py with our flash attention against torch SDPA, in the same run,
and the peak backward memory of attention alone.

1. Training step. For each model config, precision and thread count, two copies of one model (same weights,
   same batches) train a few steps each, interleaved (sdpa, flash, flash, sdpa, ...): forward, cross-entropy,
   backward, gradient clipping, AdamW — the loop of cs149gpt/train.py. Prints the median step time, tokens/s
   (batch · block_size / step time) and the ratio flash / sdpa in tokens/s (> 1: ours trains faster).
   Precisions: float32; bf16 autocast (torch.autocast("cpu", torch.bfloat16): float32 weights, the Linear
   layers and so q, k, v and attention in bf16); bf16 weights (the whole model in bf16, AdamW included).
   The first step's losses of the two copies are printed as a sanity check (they must agree to rounding).

2. Attention backward memory (--memory). For each shape (B, H, N, d), dtype and causal mode, the peak bytes
   torch's CPU allocator holds during one torch.autograd.grad of attention's output (out, q, k, v alive
   beforehand, so not counted; dq, dk, dv, every workspace and temporary counted), for ours and SDPA.
   Method: bench_attention.peak_allocator_bytes — torch.profiler(profile_memory=True)'s raw allocation
   events, summed in time order; the maximum of that running sum is the peak. Our kernels take their
   workspace from torch's allocator (csrc/module.cpp), so it is counted; memory taken by malloc behind torch's
   back (MKL, oneDNN scratch) is not, for either side.

    python benchmarks/bench_train.py                                   # both parts, quick
    python benchmarks/bench_train.py --configs shipped,nano256 --threads 1,all --precisions fp32,autocast
    python benchmarks/bench_train.py --no-train --memory --shapes 4,12,2048,64
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as fwd_bench  # noqa: E402  (repo root on sys.path, machine info, memory probe)
from bench_attention import Shape, machine_info, peak_allocator_bytes, torch_threads  # noqa: E402

import cs149gpt  # noqa: E402
from cs149gpt.model import GPT, GPTConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TrainShape:
    name: str
    config: GPTConfig
    batch_size: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.config.block_size


CONFIGS = {
    # The shipped model's pretraining stage (cs149gpt/train.py's defaults): 4 layers, 4 heads of 32, T = 256.
    "shipped": TrainShape("shipped", GPTConfig(), 16),
    # Its extension stage: T = 2048, batch 2.
    "shipped2048": TrainShape("shipped2048", GPTConfig(block_size=2048), 2),
    # nanoGPT's Shakespeare-char model: 6 layers, 6 heads of 64 (n_embd 384), T = 256 (and 512).
    "nano256": TrainShape("nano256", GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384), 16),
    "nano512": TrainShape("nano512", GPTConfig(block_size=512, n_layer=6, n_head=6, n_embd=384), 8),
}
PRECISIONS = ("fp32", "autocast", "bf16")
MEMORY_SHAPES = (Shape(1, 4, 1024, 32), Shape(1, 12, 1024, 64), Shape(4, 12, 2048, 64), Shape(1, 16, 4096, 128))


def make_models(shape: TrainShape, precision: str) -> dict[str, tuple[GPT, torch.optim.Optimizer]]:
    torch.manual_seed(0)
    base = GPT(dataclasses.replace(shape.config))
    if precision == "bf16":
        base = base.to(torch.bfloat16)
    models = {}
    for impl in ("sdpa", "flash"):
        model = copy.deepcopy(base).set_attention(impl).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=precision != "bf16")
        models[impl] = (model, optimizer)
    return models


def train_step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               precision: str) -> float:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    with autocast:
        _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def bench_training(shape: TrainShape, precision: str, threads: int, args) -> dict:
    models = make_models(shape, precision)
    gen = torch.Generator().manual_seed(1)
    T, vocab = shape.config.block_size, shape.config.vocab_size
    batches = [(torch.randint(vocab, (shape.batch_size, T), generator=gen),
                torch.randint(vocab, (shape.batch_size, T), generator=gen)) for _ in range(args.steps + args.warmup)]
    times = {impl: [] for impl in models}
    first_loss = {}
    with torch_threads(threads):
        order = list(models)
        for step, (x, y) in enumerate(batches):
            for impl in order:  # interleaved, each step reversed: drift hits both alike
                model, optimizer = models[impl]
                start = time.perf_counter()
                loss = train_step(model, optimizer, x, y, precision)
                elapsed = time.perf_counter() - start
                if step == 0:
                    first_loss[impl] = loss
                if step >= args.warmup:
                    times[impl].append(elapsed)
            order.reverse()
    median = {impl: statistics.median(t) for impl, t in times.items()}
    tokens_per_s = {impl: shape.tokens / m for impl, m in median.items()}
    return dict(config=shape.name, precision=precision, threads=threads, batch=shape.batch_size, T=T,
                layers=shape.config.n_layer, heads=shape.config.n_head,
                head_dim=shape.config.n_embd // shape.config.n_head,
                sdpa_ms=median["sdpa"] * 1e3, flash_ms=median["flash"] * 1e3,
                sdpa_tokens_per_s=tokens_per_s["sdpa"], flash_tokens_per_s=tokens_per_s["flash"],
                ratio=tokens_per_s["flash"] / tokens_per_s["sdpa"],
                first_loss_sdpa=first_loss["sdpa"], first_loss_flash=first_loss["flash"])


def bench_memory(shape: Shape, dtype: torch.dtype, causal: bool, threads: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seq_len, shape.head_dim, generator=gen)
               .to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    attends = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "flash": lambda: cs149gpt.attention(q, k, v, impl="flash", is_causal=causal),
    }
    peaks = {}
    with torch_threads(threads):
        for name, attend in attends.items():
            out = attend()
            peaks[name] = peak_allocator_bytes(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                               threads)
            del out
    grads_mib = 3 * q.numel() * q.element_size() / 2**20
    mib = {name: None if p is None else p / 2**20 for name, p in peaks.items()}
    return dict(shape=str(shape), dtype=str(dtype).replace("torch.", ""), causal=causal, threads=threads,
                grads_mib=grads_mib, sdpa_mib=mib["sdpa"], flash_mib=mib["flash"],
                ratio=None if None in mib.values() else mib["flash"] / mib["sdpa"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", type=lambda t: fwd_bench.parse_list(t, str), default=["shipped", "nano256"],
                        help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--precisions", type=lambda t: fwd_bench.parse_list(t, str), default=list(PRECISIONS),
                        help=f"comma list of {', '.join(PRECISIONS)}")
    parser.add_argument("--threads", type=lambda t: fwd_bench.parse_list(t, fwd_bench.parse_threads),
                        default=[1, fwd_bench.usable_cpus()], help="comma list; 'all' = every usable CPU")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-train", action="store_true", help="skip the training steps")
    parser.add_argument("--memory", action="store_true", help="also attention's peak backward memory")
    parser.add_argument("--shapes", nargs="+", type=fwd_bench.parse_shape, default=list(MEMORY_SHAPES),
                        metavar="B,H,N,d", help="shapes of the memory part")
    parser.add_argument("--memory-threads", type=fwd_bench.parse_threads, default=fwd_bench.usable_cpus())
    args = parser.parse_args(argv)
    for name in args.configs:
        if name not in CONFIGS:
            parser.error(f"unknown config {name!r}: choose among {', '.join(CONFIGS)}")
    for name in args.precisions:
        if name not in PRECISIONS:
            parser.error(f"unknown precision {name!r}: choose among {', '.join(PRECISIONS)}")

    machine = machine_info()
    print(f"# {machine.get('cpu_model')}, {machine.get('usable_cpus')} CPUs, torch {torch.__version__}, "
          f"cs149gpt ISA {cs149gpt.isa()}", flush=True)
    if not args.no_train:
        print("# training step: median of", args.steps, "steps after", args.warmup, "warm-up; ratio = flash/sdpa "
              "tokens/s", flush=True)
        for threads in args.threads:
            for name in args.configs:
                for precision in args.precisions:
                    r = bench_training(CONFIGS[name], precision, threads, args)
                    print(f"train {r['config']:>11} ({r['layers']}L {r['heads']}x{r['head_dim']} B={r['batch']} "
                          f"T={r['T']}) {r['precision']:>8} t={threads:<2} sdpa {r['sdpa_ms']:8.1f} ms "
                          f"{r['sdpa_tokens_per_s']:9.0f} tok/s | flash {r['flash_ms']:8.1f} ms "
                          f"{r['flash_tokens_per_s']:9.0f} tok/s | x{r['ratio']:.2f}  "
                          f"(first loss {r['first_loss_sdpa']:.4f} / {r['first_loss_flash']:.4f})", flush=True)
    if args.memory:
        print(f"# attention backward peak memory (torch.profiler allocation events), {args.memory_threads} threads; "
              "dq+dk+dv = the gradients themselves", flush=True)
        for shape in args.shapes:
            for dtype in (torch.float32, torch.bfloat16):
                for causal in (False, True):
                    r = bench_memory(shape, dtype, causal, args.memory_threads)
                    fmt = lambda x: "   n/a" if x is None else f"{x:7.1f}"  # noqa: E731
                    ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"
                    print(f"memory {r['shape']:>14} {r['dtype']:>8} causal={causal:d} dq+dk+dv {r['grads_mib']:7.1f} "
                          f"MiB | sdpa {fmt(r['sdpa_mib'])} MiB | flash {fmt(r['flash_mib'])} MiB | "
                          f"flash/sdpa {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
