#!/usr/bin/env python3
"""How closely the software tiles (amx_emulated, csrc/isa/amx_emulation.h) follow the hardware's (amx): the same
calls under both, forward (bf16, fp16) and backward (bf16), and the count of elements whose bits differ. Needs a CPU
with AMX (the device host); elsewhere it says so and stops.

    python benchmarks/probe_amx_emulation.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cs149gpt  # noqa: E402
from cs149gpt import _ext  # noqa: E402


def run(isa, fn):
    m = _ext.load()
    m.set_isa(isa)
    return fn()


def main() -> int:
    m = _ext.load()
    if not m.cpu_supports("amx"):
        print("this CPU does not run the amx kernels: nothing to compare")
        return 0
    torch.manual_seed(0)
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for shape, causal in (((2, 4, 300, 64), False), ((1, 8, 513, 128), True), ((1, 4, 1024, 32), True)):
            q, k, v = (torch.randn(shape).to(dtype) for _ in range(3))
            cases.append((f"forward {str(dtype)[6:]} {shape} causal={causal}",
                          lambda q=q, k=k, v=v, c=causal: [cs149gpt.attention(q, k, v, is_causal=c)]))
    for shape, causal in (((2, 4, 300, 64), False), ((1, 8, 513, 128), True)):
        q, k, v = (torch.randn(shape).to(torch.bfloat16).requires_grad_() for _ in range(3))
        g = torch.randn(shape).to(torch.bfloat16)

        def backward(q=q, k=k, v=v, g=g, c=causal):
            out = cs149gpt.attention(q, k, v, is_causal=c)
            return list(torch.autograd.grad(out, (q, k, v), g))
        cases.append((f"backward bfloat16 {shape} causal={causal}", backward))
    for label, fn in cases:
        hw, sw = run("amx", fn), run("amx_emulated", fn)
        diffs = [int((a != b).sum()) for a, b in zip(hw, sw)]
        worst = max(float((a.double() - b.double()).abs().max()) for a, b in zip(hw, sw))
        # Units in the last place: bf16 and fp16 values of one sign are ordered as their 16-bit patterns.
        same_sign = all(bool(((a >= 0) == (b >= 0)).all()) for a, b in zip(hw, sw))
        ulps = max(int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max()) for a, b in zip(hw, sw))
        total = sum(a.numel() for a in hw)
        print(f"{label:50s} elements with other bits: {sum(diffs):7d} of {total:8d}   max |diff| {worst:.3g}   "
              f"max ulps {ulps if same_sign else 'n/a (a sign differs)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
