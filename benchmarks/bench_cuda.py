"""The cuda subcommand of bench.py: our CUDA flash kernels (csrc/cuda/) against each of torch SDPA's backends.

For every (dtype, shape, causal) and pass (fwd, bwd: the backward of a forward recorded once), ours and every
backend this torch and GPU offer (cuDNN, flash = FlashAttention-2, efficient = memory-efficient, math) are timed in
the same interleaved rounds; a row per backend gives the ratio backend time / our time. TFLOP/s: forward
4·B·Hq·N²·d (half under the causal mask), backward 2.5× that. GQA: a backend that refuses enable_gqa gets k, v
expanded to the query heads beforehand, outside the timing.

Before timing, ours and each backend are checked against float32 SDPA (forward output and gradients, relative
error): ours must be within 2× (+ 2e-3) of the best backend's own error, else the row is marked WRONG.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from _timing import DTYPES, Row, first_line, interleave

import cs149gpt

TOKENS, MODEL_DIM = 16384, 2048  # B·N and Hq·d of each shape, as FlashAttention's own benchmarks
BACKENDS = ("cudnn", "flash", "efficient", "math")


def shapes(args) -> list[tuple]:
    """(B, Hq, Hkv, N, d)"""
    if args.shapes:
        return [(b, h, h, n, d) for b, h, n, d in args.shapes]
    if args.quick:
        return [(TOKENS // 4096, MODEL_DIM // 128, MODEL_DIM // 128, 4096, 128)]
    rows = [(TOKENS // n, MODEL_DIM // d, MODEL_DIM // d, n, d) for d in (64, 128) for n in (2048, 4096, 8192, 16384)]
    return rows + [(4, 16, 4, 4096, 128)]  # GQA: 4 query heads per kv head


def flops(b, hq, n, d, causal) -> float:
    return 4.0 * b * hq * n * n * d * (0.5 if causal else 1.0)


def backend_fn(name: str, gqa: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]

    def attend(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return attend


def matmul_peak() -> float:
    """TFLOP/s of a plain bf16 8192³ matrix product on this GPU: the ceiling each row is put against."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = interleave({"mm": lambda: a @ b}, 3, 0.5, sync=torch.cuda.synchronize)
    return 2.0 * 8192 ** 3 / times["mm"].median / 1e12


def rel_err(a, ref) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def case_rows(dtype: str, shape: tuple, causal: bool, args, peak: float) -> list[Row]:
    b, hq, hkv, n, d = shape
    group = hq // hkv
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g).to(DTYPES[dtype]) for h in (hq, hkv, hkv, hq))
    case = f"({b},{hq}{'/' + str(hkv) if group > 1 else ''},{n},{d}){' causal' if causal else ''}"
    print(f"  cuda {case} {dtype} ...", file=sys.stderr, flush=True)
    impls = {"ours": (lambda q, k, v, c: cs149gpt.attention(q, k, v, is_causal=c), k, v)}
    skipped = {}
    for name in args.backends:
        fn = backend_fn(name, group > 1)
        try:
            fn(q, k, v, causal)
            impls[name] = (fn, k, v)
            continue
        except RuntimeError:
            pass
        try:  # no enable_gqa in this backend: k, v expanded once, outside the timing
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            fn = backend_fn(name, False)
            fn(q, ke, ve, causal)
            impls[name] = (fn, ke, ve)
        except RuntimeError as e:
            skipped[name] = first_line(e)
    torch.cuda.synchronize()

    # The check: float32 inputs (the same rounded values) through SDPA's float32 math, forward and gradients.
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1),
                                         is_causal=causal)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
    errors = {}
    for name, (fn, kk, vv) in list(impls.items()):
        qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, kk, vv))
        try:
            out = fn(qi, ki, vi, causal)
            gq, gk, gv = torch.autograd.grad(out, (qi, ki, vi), dout)
        except RuntimeError as e:
            if name == "ours":
                raise
            skipped[name] = f"backward: {first_line(e)}"  # a backend without this backward: a row says so
            del impls[name]
            continue
        if ki.shape[1] != hkv:  # expanded: sum each group's gradients
            gk, gv = (t.unflatten(1, (hkv, group)).sum(2) for t in (gk, gv))
        errors[name] = max([rel_err(out, ref)] + [rel_err(a, r) for a, r in zip((gq, gk, gv), ref_grads)])
    del qr, kr, vr, ref, ref_grads
    best = min((e for name, e in errors.items() if name != "ours"), default=float("inf"))
    wrong = not errors["ours"] <= 2 * best + 2e-3

    rows = []
    work = flops(b, hq, n, d, causal)
    for phase, factor in (("fwd", 1.0), ("bwd", 2.5)):
        calls = {}
        for name, (fn, kk, vv) in impls.items():
            qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, kk, vv))
            if phase == "fwd":
                calls[name] = lambda fn=fn, qi=qi, ki=ki, vi=vi: fn(qi, ki, vi, causal)
            else:
                out = fn(qi, ki, vi, causal)
                calls[name] = (lambda out=out, qi=qi, ki=ki, vi=vi:
                               torch.autograd.grad(out, (qi, ki, vi), dout, retain_graph=True))
        times = interleave(calls, args.rounds, args.seconds, sync=torch.cuda.synchronize)
        ours = times["ours"]
        for name in args.backends:
            row = Row("cuda", f"{phase} {case}", dtype, None, "ours", f"sdpa {name}", unit="TFLOP/s")
            if name in skipped:
                row.status, row.note = "skipped", f"sdpa {name} refuses: {skipped[name]}"
                rows.append(row)
                continue
            t = times[name]
            row.ours_ms, row.peer_ms, row.ratio = ours.median * 1e3, t.median * 1e3, t.median / ours.median
            row.rate = factor * work / ours.median / 1e12
            row.err = errors["ours"]
            row.add_note(f"peer {factor * work / t.median / 1e12:.0f} TFLOP/s; ours {100 * row.rate / peak:.0f}% of "
                         f"the bf16 matmul's {peak:.0f}")
            if wrong:
                row.status = "wrong"
                row.add_note(f"WRONG: rel. error {errors['ours']:.3g} vs the backends' best {best:.3g}")
            for who, tt in (("ours", ours), (name, t)):
                if tt.noisy:
                    row.add_note(f"noisy: {who} IQR {100 * tt.iqr / tt.median:.0f}% of median")
            rows.append(row)
        del calls
    torch.cuda.empty_cache()
    return rows


def config_rows(args) -> list[Row]:
    """Ours under each compiled tile configuration (csrc/cuda/flash_launch.cuh: kFwdConfigs, kBwdConfigs, chosen by
    CS149GPT_FWD_CONFIG / CS149GPT_BWD_CONFIG) against ours with the default choice."""
    rows = []
    for dtype in args.dtype or ["bfloat16"]:
        for b, hq, hkv, n, d in shapes(args):
            for causal in {"off": [False], "on": [True], "both": [False, True]}[args.causal or "both"]:
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g).to(DTYPES[dtype])
                                 for h in (hq, hkv, hkv, hq))
                q.requires_grad_()
                for phase, count in (("fwd", 7), ("bwd", 4)):
                    var = f"CS149GPT_{phase.upper()}_CONFIG"
                    out = cs149gpt.attention(q, k, v, is_causal=causal)

                    def call(config=None, out=out):
                        if config is None:
                            os.environ.pop(var, None)
                        else:
                            os.environ[var] = str(config)
                        if phase == "fwd":
                            return cs149gpt.attention(q, k, v, is_causal=causal)
                        return torch.autograd.grad(out, (q,), dout, retain_graph=True)

                    calls = {"default": call}
                    calls.update({f"config {c}": lambda c=c: call(c) for c in range(count)})
                    times = interleave(calls, args.rounds, args.seconds, sync=torch.cuda.synchronize)
                    os.environ.pop(var, None)
                    work = flops(b, hq, n, d, causal) * (1.0 if phase == "fwd" else 2.5)
                    for name, t in times.items():
                        if name == "default":
                            continue
                        rows.append(Row("cuda", f"{phase} ({b},{hq},{n},{d}){' causal' if causal else ''}", dtype,
                                        None, f"ours {name}", "ours default", t.median * 1e3,
                                        times["default"].median * 1e3, times["default"].median / t.median,
                                        work / t.median / 1e12, "TFLOP/s"))
    return rows


def run_cuda(args) -> list[Row]:
    if not torch.cuda.is_available():
        print("cuda: skipped: no CUDA GPU here (torch.cuda.is_available() is False; this torch is "
              f"{torch.__version__})", file=sys.stderr)
        return [Row("cuda", "all", "", None, "ours", "sdpa", status="skipped", note="no CUDA GPU on this machine")]
    if args.configs:
        return config_rows(args)
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal or "both"]
    peak = matmul_peak()
    print(f"cuda: a bf16 8192³ matmul runs at {peak:.0f} TFLOP/s on this GPU", file=sys.stderr)
    return [row for dtype in args.dtype or ["bfloat16"] for shape in shapes(args) for causal in causals
            for row in case_rows(dtype, shape, causal, args, peak)]


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cuda", parents=[common], help="the CUDA kernels vs each torch SDPA backend (fwd, bwd)")
    p.set_defaults(run=run_cuda)
    p.add_argument("--backends", type=lambda t: t.split(","), default=list(BACKENDS),
                   help=f"comma list of {','.join(BACKENDS)}")
    p.add_argument("--configs", action="store_true", help="time each compiled tile configuration of ours instead")
