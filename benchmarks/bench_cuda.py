#!/usr/bin/env python3
"""Times the CUDA flash kernels against torch SDPA on the GPU, forward and backward, in the same run.

Rows, for every (dtype, shape, causal):
    ours         cs149gpt.attention (csrc/cuda/: FlashAttention-2 on mma.sync tensor cores)
    sdpa         torch.nn.functional.scaled_dot_product_attention, its default backend choice (cuDNN on H100)
    sdpa_fa2     the same under sdpa_kernel(SDPBackend.FLASH_ATTENTION): FlashAttention-2
TFLOP/s follow the FlashAttention papers: forward 4·B·Hq·Nq·Nk·d (half of it under the causal mask), backward
2.5× that. Times are medians of triton.testing.do_bench (CUDA events). GQA rows give SDPA k, v expanded to the
query heads beforehand (outside the timing) when a backend refuses enable_gqa.

Before timing each shape, ours and sdpa_fa2 are checked against float32 SDPA (forward and gradients): ours must
be within 2x (+ a small floor) of FlashAttention-2's own error.

    python benchmarks/bench_cuda.py                    # the full table (bf16 and fp16, d 64/128, N 2048-8192)
    python benchmarks/bench_cuda.py --quick            # a few rows
    python benchmarks/bench_cuda.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cs149gpt  # noqa: E402

TOKENS = 16384  # B·N per row, as FlashAttention's own benchmarks
MODEL_DIM = 2048  # Hq·d


def shapes(quick: bool):
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for n in ((4096,) if quick else (2048, 4096, 8192)):
                for causal in (False, True):
                    rows.append((dtype, TOKENS // n, MODEL_DIM // d, MODEL_DIM // d, n, d, causal))
        # GQA: 4 query heads per kv head
        for causal in (False, True):
            rows.append((dtype, 4, 16, 4, 4096, 128, causal))
        if quick:
            break
    return rows


def flops(B, Hq, N, d, causal):
    return 4 * B * Hq * N * N * d * (0.5 if causal else 1.0)


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=60, return_mode="median") * 1e-3


def sdpa_fn(backend, gqa):
    def attend(q, k, v, causal):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return attend


def ours(q, k, v, causal):
    return cs149gpt.attention(q, k, v, is_causal=causal)


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm()).item()


def run_row(dtype, B, Hq, Hkv, N, d, causal, results, check=True):
    g = torch.Generator(device="cuda").manual_seed(N + d)
    mk = lambda h: torch.randn(B, h, N, d, device="cuda", generator=g, dtype=torch.float32)  # noqa: E731
    q32, k32, v32, dout32 = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    q, k, v, dout = (t.to(dtype) for t in (q32, k32, v32, dout32))
    group = Hq // Hkv
    impls = {"ours": (ours, k, v)}
    for name, backend in (("sdpa", None), ("sdpa_fa2", SDPBackend.FLASH_ATTENTION)):
        fn = sdpa_fn(backend, group > 1)
        try:
            fn(q, k, v, causal)
            impls[name] = (fn, k, v)
        except RuntimeError:  # this backend does not take enable_gqa: expand k, v once, outside the timing
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            impls[name] = (sdpa_fn(backend, False), ke, ve)

    row = dict(dtype=str(dtype).replace("torch.", ""), B=B, Hq=Hq, Hkv=Hkv, N=N, d=d, causal=causal)
    if check:
        # Reference: float32 inputs (the same rounded values), SDPA's float32 path, forward and gradients.
        # (GQA: k, v expanded beforehand, so that SDPA keeps a fused float32 kernel; their gradients summed.)
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        ke, ve = (t.repeat_interleave(group, 1) for t in (kr, vr))
        ref = F.scaled_dot_product_attention(qr, ke, ve, is_causal=causal)
        ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
        for name in ("ours", "sdpa_fa2"):
            fn, kk, vv = impls[name]
            qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, kk, vv))
            out = fn(qi, ki, vi, causal)
            gq, gk, gv = torch.autograd.grad(out, (qi, ki, vi), dout)
            if ki.shape[1] != Hkv:  # expanded for SDPA: sum the group's gradients
                gk, gv = (t.unflatten(1, (Hkv, group)).sum(2) for t in (gk, gv))
            errs = [rel_err(out, ref)] + [rel_err(a, b) for a, b in zip((gq, gk, gv), ref_grads)]
            row[f"err_{name}"] = errs
        ok = all(e <= 2 * f + 2e-3 and e == e for e, f in zip(row["err_ours"], row["err_sdpa_fa2"]))
        row["correct"] = ok
        del qr, kr, vr, ke, ve, ref, ref_grads
    fl = flops(B, Hq, N, d, causal)
    for name, (fn, kk, vv) in impls.items():
        qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, kk, vv))
        t_fwd = bench(lambda: fn(qi, ki, vi, causal))
        out = fn(qi, ki, vi, causal)
        t_bwd = bench(lambda: torch.autograd.grad(out, (qi, ki, vi), dout, retain_graph=True))
        row[f"{name}_fwd_tflops"] = fl / t_fwd * 1e-12
        row[f"{name}_bwd_tflops"] = 2.5 * fl / t_bwd * 1e-12
        del out
    for p in ("fwd", "bwd"):
        row[f"{p}_vs_fa2"] = row[f"ours_{p}_tflops"] / row[f"sdpa_fa2_{p}_tflops"]
        row[f"{p}_vs_sdpa"] = row[f"ours_{p}_tflops"] / row[f"sdpa_{p}_tflops"]
    results.append(row)
    print(format_row(row), flush=True)


HEADER = (f"{'dtype':8} {'B':>2} {'Hq':>3} {'Hkv':>3} {'N':>5} {'d':>3} {'causal':6} | "
          f"{'fwd ours':>8} {'fa2':>5} {'cudnn':>5} {'/fa2':>5} {'/cudnn':>6} | "
          f"{'bwd ours':>8} {'fa2':>5} {'cudnn':>5} {'/fa2':>5} {'/cudnn':>6} | ok")


def format_row(r):
    return (f"{r['dtype']:8} {r['B']:>2} {r['Hq']:>3} {r['Hkv']:>3} {r['N']:>5} {r['d']:>3} {str(r['causal']):6} | "
            f"{r['ours_fwd_tflops']:8.0f} {r['sdpa_fa2_fwd_tflops']:5.0f} {r['sdpa_fwd_tflops']:5.0f} "
            f"{r['fwd_vs_fa2']:5.2f} {r['fwd_vs_sdpa']:6.2f} | "
            f"{r['ours_bwd_tflops']:8.0f} {r['sdpa_fa2_bwd_tflops']:5.0f} {r['sdpa_bwd_tflops']:5.0f} "
            f"{r['bwd_vs_fa2']:5.2f} {r['bwd_vs_sdpa']:6.2f} | {r.get('correct', '-')}")


def sweep_configs():
    """Times ours alone under each compiled tile configuration (CS149GPT_FWD_CONFIG / CS149GPT_BWD_CONFIG)."""
    import os

    print("# tile configurations (csrc/cuda/flash_launch.cuh), ours only, bf16, TFLOP/s")
    rows = [(torch.bfloat16, TOKENS // n, MODEL_DIM // d, MODEL_DIM // d, n, d, c)
            for d in (64, 128) for n in (2048, 8192) for c in (False, True)]
    out = []
    for pass_, configs in (("fwd", range(7)), ("bwd", range(4))):  # flash_launch.cuh: kFwdConfigs, kBwdConfigs
        for (dtype, B, Hq, Hkv, N, d, causal) in rows:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(B, h, N, d, device="cuda", generator=g, dtype=dtype)
                             for h in (Hq, Hkv, Hkv, Hq))
            q.requires_grad_()
            fl = flops(B, Hq, N, d, causal) * (1.0 if pass_ == "fwd" else 2.5)
            line = []
            for c in configs:
                os.environ[f"CS149GPT_{pass_.upper()}_CONFIG"] = str(c)
                if pass_ == "fwd":
                    t = bench(lambda: ours(q, k, v, causal))
                else:
                    o = ours(q, k, v, causal)
                    t = bench(lambda: torch.autograd.grad(o, (q,), dout, retain_graph=True))
                line.append(fl / t * 1e-12)
            os.environ.pop(f"CS149GPT_{pass_.upper()}_CONFIG")
            out.append(dict(pass_=pass_, B=B, H=Hq, N=N, d=d, causal=causal, tflops=line))
            print(f"{pass_} B={B} H={Hq} N={N} d={d} causal={causal!s:5}: " +
                  "  ".join(f"c{c} {x:5.0f}" for c, x in zip(configs, line)), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few rows only")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check of each row")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--configs", action="store_true", help="first sweep the compiled tile configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU")
    prop = torch.cuda.get_device_properties(0)
    print(f"# {prop.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"cuDNN {torch.backends.cudnn.version()}; TFLOP/s (fwd 4·B·H·N²·d, causal half; bwd 2.5x)")
    sweep = sweep_configs() if args.configs else None
    print(HEADER)
    results = []
    for s in shapes(args.quick):
        run_row(*s, results, check=not args.no_check)
        torch.cuda.empty_cache()
        if args.json:  # after every row, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(dict(device=prop.name, torch=torch.__version__, rows=results,
                                                 configs=sweep), indent=1))
    for p in ("fwd", "bwd"):
        fa2 = [r[f"{p}_vs_fa2"] for r in results]
        cud = [r[f"{p}_vs_sdpa"] for r in results]
        print(f"# {p}: ours / FA2 min {min(fa2):.2f} max {max(fa2):.2f}; ours / cuDNN min {min(cud):.2f} "
              f"max {max(cud):.2f}")
    print(f"# correct at every shape: {all(r.get('correct', True) for r in results)}")


if __name__ == "__main__":
    main()
