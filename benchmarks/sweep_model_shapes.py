#!/usr/bin/env python3
"""The attention calls of popular models, ours against torch's SDPA, same run: where would a user who switches lose?

Issue 9's four shapes are square, with head_dim 32–128 and no mask. Real models also call attention with head_dim 40
(Stable Diffusion), 80 (Phi-2) or 256 (Gemma), sequence lengths that are no multiple of anything (ViT's 197, Whisper's
1500), GQA and MQA, cross-attention (queries ≠ keys), key-padding masks and additive biases. Each row below is one
such call, as the model makes it (q, k, v as (B, N, H·d) projections viewed as (B, H, N, d), i.e. strided), run
through `cs149gpt.scaled_dot_product_attention` and `torch.nn.functional.scaled_dot_product_attention` in
alternation (`--rounds` rounds, the median of each round's calls; ×SDPA is the median of the rounds' ratios).
Every row also says whether our kernel ran (`uses_our_kernel`) and how far our output is from torch's.

    python benchmarks/sweep_model_shapes.py [--threads 1,16] [--dtype float32,bfloat16] [--only bert,vit] [--rounds 3]
                                            [--backward] [--dropout P]

--backward times a training step's attention instead: the forward and `torch.autograd.grad` of q, k, v together
(the decode calls are left out). --dropout P passes dropout_p = P to both (training: ours draws its own keep mask,
so outputs are compared only without it).
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

# name: (B, Hq, Hkv, Nq, Nk, d, is_causal, mask) — mask: None, "padding" (the (B, 1, Nq, Nk) boolean mask
# transformers builds for a right-padded batch), "bias" (a (1, H, Nq, Nk) additive float bias, T5/ALiBi-style).
CALLS = {
    "bert-base 32x128 padded": (32, 12, 12, 128, 128, 64, False, "padding"),
    "bert-base 8x512": (8, 12, 12, 512, 512, 64, False, None),
    "vit-b16 32x197": (32, 12, 12, 197, 197, 64, False, None),
    "gpt2 prefill 4x1024": (4, 12, 12, 1024, 1024, 64, True, None),
    "llama3-8b prefill 2048": (1, 32, 8, 2048, 2048, 128, True, None),
    "qwen2-0.5b prefill 1024": (1, 14, 2, 1024, 1024, 64, True, None),
    "phi-2 prefill 1024": (1, 32, 32, 1024, 1024, 80, True, None),
    "gemma-2b prefill 1024": (1, 8, 1, 1024, 1024, 256, True, None),
    "sd1.5 self 2x4096": (2, 8, 8, 4096, 4096, 40, False, None),
    "sd1.5 cross 2x4096x77": (2, 8, 8, 4096, 77, 40, False, None),
    "whisper-base encoder 1500": (1, 8, 8, 1500, 1500, 64, False, None),
    "whisper-base cross decode": (1, 8, 8, 1, 1500, 64, False, None),
    "t5-base 8x512 bias": (8, 12, 12, 512, 512, 64, False, "bias"),
    "llama3-8b decode 4096": (1, 32, 8, 1, 4096, 128, False, None),
}


def make_call(B, Hq, Hkv, Nq, Nk, d, mask_kind, dtype, g):
    def proj(N, H):  # a (B, N, H·d) projection viewed as heads: strided, as models pass it
        return torch.randn(B, N, H, d, generator=g).to(dtype).transpose(1, 2)

    q, k, v = proj(Nq, Hq), proj(Nk, Hkv), proj(Nk, Hkv)
    mask = None
    if mask_kind == "padding":
        keep = torch.ones(B, Nk, dtype=torch.bool)
        for i in range(B):
            keep[i, Nk - (i * Nk) // (2 * B):] = False
        mask = keep[:, None, None, :].expand(B, 1, Nq, Nk).contiguous()
    elif mask_kind == "bias":
        mask = torch.randn(1, Hq, Nq, Nk, generator=g).to(dtype)
    return q, k, v, mask


def median_s(fn, min_time):
    samples, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(samples) < 3:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--only", default="", help="comma-separated substrings of the call names to keep")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=0.15, help="seconds per impl per round")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every call")
    args = parser.parse_args()
    keep = [s for s in args.only.split(",") if s]
    calls = {n: c for n, c in CALLS.items() if (not keep or any(s in n for s in keep))
             and not (args.backward and c[3] == 1)}
    print(f"# torch {torch.__version__}, cs149gpt isa {cs149gpt.isa()}, {args.rounds} interleaved rounds, "
          f"{args.min_time} s per impl per round, {'forward + backward' if args.backward else 'forward'}, "
          f"dropout_p {args.dropout}")
    print("| call | B,Hq/Hkv,Nq,Nk,d | causal | mask | dtype | threads | ours? | SDPA ms | ours ms | ×SDPA "
          "| min–max ×SDPA | max |ours − SDPA| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, (B, Hq, Hkv, Nq, Nk, d, causal, mask_kind) in calls.items():
            for dtype in (getattr(torch, n) for n in args.dtype.split(",")):
                q, k, v, mask = make_call(B, Hq, Hkv, Nq, Nk, d, mask_kind, dtype, g)
                kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=Hq != Hkv, dropout_p=args.dropout)
                if args.backward:
                    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                ours_ran = cs149gpt.uses_our_kernel(q, k, v, mask, args.dropout, causal, None, Hq != Hkv)
                grad_out = torch.randn(q.shape, generator=g).to(dtype)

                def step(sdpa):  # what the row times: the forward, and with --backward the gradients too
                    if not args.backward:
                        return sdpa(q, k, v, **kw), ()
                    out = sdpa(q, k, v, **kw)
                    return out, torch.autograd.grad(out, (q, k, v), grad_out)

                with torch.set_grad_enabled(args.backward):
                    (theirs_out, theirs_grads), (ours_out, ours_grads) = (step(F.scaled_dot_product_attention),
                                                                          step(cs149gpt.scaled_dot_product_attention))
                    diff = max((a.float() - b.float()).abs().max().item()
                               for a, b in zip((ours_out, *ours_grads), (theirs_out, *theirs_grads))) \
                        if args.dropout == 0 else float("nan")
                    ratios, t_sdpa, t_ours = [], [], []
                    for _ in range(args.rounds):
                        a = median_s(lambda: step(F.scaled_dot_product_attention), args.min_time)
                        b = median_s(lambda: step(cs149gpt.scaled_dot_product_attention), args.min_time)
                        t_sdpa.append(a)
                        t_ours.append(b)
                        ratios.append(a / b)
                shape = f"{B},{Hq}/{Hkv},{Nq},{Nk},{d}"
                print(f"| {name} | {shape} | {'yes' if causal else 'no'} | {mask_kind or '-'} | {str(dtype)[6:]} | "
                      f"{threads} | {'yes' if ours_ran else 'NO'} | {statistics.median(t_sdpa) * 1e3:.3f} | "
                      f"{statistics.median(t_ours) * 1e3:.3f} | {statistics.median(ratios):.2f} | "
                      f"{min(ratios):.2f}–{max(ratios):.2f} | {diff:.2g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
