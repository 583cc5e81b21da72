#!/usr/bin/env python3
"""One decode step of a static-cache generate, alone: ours against torch's SDPA, with the cache's mask and without.

transformers' static cache keeps K and V at their full capacity and passes a boolean (B, 1, 1, capacity) mask on
every step: left padding and the slots not yet written are False. bench_models.py's Llama (8 query heads, 2 kv heads,
d = 64, batch 4 left-padded by 0, 1/8, 2/8, 3/8 of 512 tokens, 16 new tokens: capacity 528) at the step where 520
keys are filled. The unmasked call attends to the first 520 keys only (the dynamic cache's call, without padding).

    python benchmarks/probe_masked_decode.py --threads 1,16 --dtype bfloat16
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import per_call_us  # noqa: E402  (it put the repo root on sys.path)
import cs149gpt  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    batch, heads, kv_heads, d, capacity, filled, prompt = 4, 8, 2, 64, 528, 520, 512
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, capacity, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, capacity, dtype=torch.bool)
    for b in range(batch):
        mask[b, ..., (b * prompt) // (2 * batch):filled] = True
    k_filled, v_filled = k[:, :, :filled], v[:, :, :filled]
    print(f"# torch {torch.__version__}, isa {cs149gpt.isa()}, {args.dtype}, q {tuple(q.shape)}, k/v "
          f"{tuple(k.shape)}, mask {tuple(mask.shape)} bool ({filled} of {capacity} slots filled, left padding)")
    print("| threads | call | SDPA µs | cs149gpt µs | ×SDPA |")
    print("|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        cases = {
            "static cache (mask)": (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                                    lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                  enable_gqa=True)),
            "filled keys, no mask": (lambda: F.scaled_dot_product_attention(q, k_filled, v_filled, enable_gqa=True),
                                     lambda: cs149gpt.scaled_dot_product_attention(q, k_filled, v_filled,
                                                                                   enable_gqa=True)),
        }
        for name, (theirs, ours) in cases.items():
            torch.testing.assert_close(ours(), theirs(), atol=2e-2, rtol=2e-2)
            t_sdpa, t_ours = per_call_us(theirs, args.calls), per_call_us(ours, args.calls)
            print(f"| {threads} | {name} | {t_sdpa:.1f} | {t_ours:.1f} | {t_sdpa / t_ours:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
