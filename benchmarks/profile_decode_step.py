#!/usr/bin/env python3
"""Where a decoding step's time goes: torch.profiler over D decode steps of the shipped GPT (or the Llama-shaped
model of bench_generate.py), the model's attention SDPA and then ours, the same steps.

Prints, for each implementation, the time per token and the operators by self CPU time (µs per token), so that
attention's share of a token is read off directly: what our kernel can win end to end is at most that share.

    python benchmarks/profile_decode_step.py                      # shakes1024, 1 thread, 64 steps
    python benchmarks/profile_decode_step.py --context 2048 --threads 16
    python benchmarks/profile_decode_step.py --llama --context 4096 --steps 8
"""
import argparse
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
import cs149gpt  # noqa: E402
from cs149gpt.model import load_pretrained  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from bench_generate import LLAMA, filled_caches, llama_model  # noqa: E402


@torch.inference_mode()
def decode_steps(model, tokens, steps, impl, fill, profile=False):
    """Seconds per decode step over the last `steps` tokens (and the profiler, if asked)."""
    model.set_attention(impl)
    if fill:
        caches = filled_caches(model, tokens.size(0), tokens.size(1) - steps)
    else:
        caches = model.new_kv_caches(tokens.size(0))
        model(tokens[:, :-steps], kv_caches=caches)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    if prof:
        prof.__enter__()
    start = time.perf_counter()
    for t in range(tokens.size(1) - steps, tokens.size(1)):
        model(tokens[:, t:t + 1], kv_caches=caches)
    seconds = (time.perf_counter() - start) / steps
    if prof:
        prof.__exit__(None, None, None)
    return seconds, prof


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rows", type=int, default=12, help="operators listed per implementation")
    parser.add_argument("--llama", action="store_true", help="bench_generate's Llama-shaped bf16 model (random "
                        "caches, no prefill)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.llama:
        model, vocab_size = llama_model(args.context, 2), LLAMA["vocab_size"]
    else:
        model, vocab = load_pretrained(f"shakes{args.context}")
        vocab_size = len(vocab)
    tokens = torch.randint(vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    print(f"cs149gpt {cs149gpt.isa()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"{'Llama-shaped' if args.llama else 'shakes'}{args.context}, {args.steps} decode steps")
    for impl in ("sdpa", "flash", "sdpa", "flash"):  # warm-up rounds, then the timed ones
        decode_steps(model, tokens, args.steps, impl, args.llama)
    for impl in ("sdpa", "flash"):
        plain, _ = decode_steps(model, tokens, args.steps, impl, args.llama)
        profiled, prof = decode_steps(model, tokens, args.steps, impl, args.llama, profile=True)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / args.steps
        print(f"\n## {impl}: {plain * 1e6:.0f} µs per token ({profiled * 1e6:.0f} under the profiler; "
              f"its operators' self time {total:.0f} µs per token)\n")
        print("| operator | calls per token | self µs per token | share |")
        print("|---|---:|---:|---:|")
        for e in events[:args.rows]:
            per_token = e.self_cpu_time_total / args.steps
            print(f"| {e.key} | {e.count / args.steps:.1f} | {per_token:.1f} | {100 * per_token / total:.0f} % |")


if __name__ == "__main__":
    main()
