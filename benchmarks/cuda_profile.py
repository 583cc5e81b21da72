#!/usr/bin/env python3
"""One forward and one backward of ours and of SDPA's FlashAttention-2 backend, for Nsight Compute to profile.

    ncu --kernel-name regex:'flash_fwd_kernel|flash_bwd_kernel|flash_bwd_dq_dk_dv' python benchmarks/cuda_profile.py

Shape: bf16, B=4, H=16, N=4096 (--d, --causal); nothing is timed here.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cs149gpt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--causal", action="store_true")
args = ap.parse_args()
B, H, N, d = 4, 2048 // args.d, 4096, args.d
q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for name in ("ours", "fa2"):
    qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
    if name == "ours":
        out = cs149gpt.attention(qi, ki, vi, is_causal=args.causal)
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=args.causal)
    torch.autograd.grad(out, (qi, ki, vi), dout)
torch.cuda.synchronize()
print("profiled: ours and FA2, forward and backward, d", d, "causal", args.causal)
