"""The cuda subcommand of bench.py: our CUDA flash kernels (csrc/cuda/) against each of torch SDPA's backends.

--suite picks the row groups (comma list; default plain):
  plain    the rows below: plain and causal attention, fwd and bwd, vs each backend;
  masked   masked attention, bf16, d 128, N 2048-8192: a (B, 1, 1, N) bool key padding mask and a (B, 1, N, N) padded
           causal mask, forward and forward+backward, ours vs torch SDPA's default backend given the same mask;
  varlen   packed sequences (16 of N/8..N, causal), forward and forward+backward: flash_attn_varlen_func vs our own
           padded call (key padding mask + is_causal) and vs cuDNN (else SDPA's default) on the padded batch with its
           (B, 1, N, N) mask;
  deterministic
           the backward under torch.use_deterministic_algorithms(True) (dQ added in key order) against our default
           backward and against cuDNN's and FlashAttention-2's under the same switch (a backend torch refuses there
           says skipped), the plain shapes; the note says whether two calls gave the same bits;
  decode   one query row per sequence against a KV cache (Hq 32, Hkv 8, d 128, bf16, 1k-32k cached keys, batch
           1-64): attention_with_kvcache vs torch SDPA's best backend (each that runs is timed, the fastest kept), and
           GB/s (K and V read once) as a share of a device-to-device copy's bandwidth measured in the same run, and
           the host's time a call (issuing calls back to back without waiting for the GPU).
A row whose kernel this build lacks says skipped, with the error.

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
import contextlib
import itertools
import os
import statistics
import sys
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from _timing import DTYPES, MATCH_TOLERANCE, Row, first_line, interleave, measured_rows

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


def backend_impls(names, q, k, v, causal: bool, group: int, impls: dict) -> dict:
    """impls[name] = (fn, k, v) for each backend that runs this case; returns {name: why} for the others. GQA: a backend
    that refuses enable_gqa gets k, v expanded to the query heads once, outside the timing."""
    skipped = {}
    for name in names:
        fn = backend_fn(name, group > 1)
        try:
            fn(q, k, v, causal)
            impls[name] = (fn, k, v)
            continue
        except RuntimeError:
            pass
        try:
            ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            fn = backend_fn(name, False)
            fn(q, ke, ve, causal)
            impls[name] = (fn, ke, ve)
        except RuntimeError as e:
            skipped[name] = first_line(e)
    torch.cuda.synchronize()
    return skipped


def matmul_peak() -> float:
    """TFLOP/s of a plain bf16 8192³ matrix product on this GPU: the ceiling each row is put against."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    times = interleave({"mm": lambda: a @ b}, 3, 0.5, sync=torch.cuda.synchronize)
    return 2.0 * 8192 ** 3 / times["mm"].median / 1e12


def rel_err(a, ref) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def case_inputs(dtype: str, shape: tuple, causal: bool, backends: Sequence[str]):
    """q, k, v, dout of a (B, Hq, Hkv, N, d) case, its label, and impls (ours and each backend that runs it: name ->
    (fn, k, v)) with {name: why} for the backends that do not."""
    b, hq, hkv, n, d = shape
    group = hq // hkv
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g).to(DTYPES[dtype]) for h in (hq, hkv, hkv, hq))
    case = f"({b},{hq}{'/' + str(hkv) if group > 1 else ''},{n},{d}){' causal' if causal else ''}"
    impls = {"ours": (lambda q, k, v, c: cs149gpt.attention(q, k, v, is_causal=c), k, v)}
    skipped = backend_impls(backends, q, k, v, causal, group, impls)
    return q, k, v, dout, case, impls, skipped


def case_rows(dtype: str, shape: tuple, causal: bool, args, peak: float) -> list[Row]:
    b, hq, hkv, n, d = shape
    group = hq // hkv
    q, k, v, dout, case, impls, skipped = case_inputs(dtype, shape, causal, args.backends)
    print(f"  cuda {case} {dtype} ...", file=sys.stderr, flush=True)

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


def _ours_or_skip(fn, bench: str, case: str, dtype: str, ours: str, peers: Sequence[str]) -> Optional[list[Row]]:
    """None if fn() (our kernel, once) runs; else a skipped row per peer saying why (a kernel this build lacks)."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (NotImplementedError of a missing CUDA kernel, a refusing check, ...)
        note = f"ours not available: {type(e).__name__}: {first_line(e)}"
        return [Row(bench, case, dtype, None, ours, peer, status="skipped", note=note) for peer in peers]


def _sync_rows(rows: list[Row], rate_of=None) -> list[Row]:
    """The rows measured_rows returned, their rate set by rate_of(row) where timed."""
    for row in rows:
        if rate_of is not None and row.ours_ms:
            row.rate = rate_of(row)
    return rows


def masked_rows(args, sizes: Sequence[int] = (), phases: Sequence[str] = ("fwd", "fwd+bwd")) -> list[Row]:
    """Masked prefill and training: ours vs torch SDPA's default backend given the same boolean mask, bf16, d 128; the
    forward, and the forward and backward (dV compared)."""
    rows = []
    sizes = sizes or ((2048,) if args.quick else (2048, 4096, 8192))
    for dtype in args.dtype or ["bfloat16"]:
        for n in sizes:
            b, h, d = max(TOKENS // n, 1), MODEL_DIM // 128, 128
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=g).to(DTYPES[dtype]) for _ in range(3))
            dout = torch.randn(b, h, n, d, device="cuda", generator=g).to(DTYPES[dtype])
            # Row i keeps its first lengths[i] keys: from all N down to N/2 (right padding, as a training batch).
            lengths = torch.linspace(n, n // 2, b, device="cuda").round().long()
            keys = torch.arange(n, device="cuda")
            padding = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, N)
            causal = keys[None, :] <= keys[:, None]
            for phase in phases:
                backward = phase == "fwd+bwd"
                for name, mask, work in (("key padding (B,1,1,N)", padding, 1.0),
                                         ("padded causal (B,1,N,N)", padding & causal, 0.5)):
                    case = f"masked {phase} ({b},{h},{n},{d}) {name}"
                    print(f"  cuda {case} {dtype} ...", file=sys.stderr, flush=True)
                    ours = lambda mask=mask: cs149gpt.attention(q, k, v, attn_mask=mask)  # noqa: E731
                    peer = lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
                    if backward:
                        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
                        grad_v = lambda f: lambda: torch.autograd.grad(f(), (q, k, v), dout)[2]  # noqa: E731
                        ours, peer = grad_v(ours), grad_v(peer)
                    skipped = _ours_or_skip(ours, "cuda", case, dtype, "ours", ["sdpa default"])
                    if skipped:
                        rows += skipped
                        continue
                    flop = 4.0 * b * h * n * n * d * work * (3.5 if backward else 1.0)
                    rows += _sync_rows(measured_rows("cuda", case, dtype, None, {"ours": ours}, ("sdpa default", peer),
                                                     args, unit="TFLOP/s", sync=torch.cuda.synchronize),
                                       lambda row, flop=flop: flop / (row.ours_ms * 1e-3) / 1e12)
                    for row in rows[-1:]:
                        row.add_note("TFLOP/s of the dense" + (" causal" if work < 1 else "") + " N² product")
                q.requires_grad_(False), k.requires_grad_(False), v.requires_grad_(False)
            del q, k, v, dout
            torch.cuda.empty_cache()
    return rows


def _packed_to_padded_rows(lengths: list[int], longest: int) -> torch.Tensor:
    """Row indices, into a (B·longest) flattening of the padded batch, of the packed tokens in order."""
    return torch.cat([b * longest + torch.arange(n) for b, n in enumerate(lengths)]).cuda()


def varlen_rows(args, sizes: Sequence[int] = ()) -> list[Row]:
    """Packed sequences (flash_attn_varlen_func, causal) vs the padded batch: ours padded, cuDNN (else SDPA default);
    the forward, and the forward and backward."""
    from bench_cpu import varlen_lengths

    rows = []
    sizes = sizes or ((2048,) if args.quick else (2048, 4096, 8192))
    for dtype in args.dtype or ["bfloat16"]:
        for n in sizes:
            h, d = MODEL_DIM // 128, 128
            lengths = varlen_lengths(16, n // 8, n)
            b, longest, total = len(lengths), max(lengths), sum(lengths)
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = (torch.randn(total, h, d, device="cuda", generator=g).to(DTYPES[dtype]) for _ in range(3))
            cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
            rows_of = _packed_to_padded_rows(lengths, longest)

            def padded(t):  # (total, H, d) -> (B, H, longest, d), zeros past each sequence
                out = t.new_zeros(b * longest, h, d)
                out[rows_of] = t
                return out.view(b, longest, h, d).transpose(1, 2)

            keys = torch.arange(longest, device="cuda")
            keep = (keys[None, :] < torch.tensor(lengths, device="cuda")[:, None])[:, None, None, :]  # (B, 1, 1, L)
            full = keep & (keys[None, :] <= keys[:, None])  # (B, 1, L, L): padding and causal in one mask

            def unpadded(out):  # (B, H, L, d) -> (total, H, d)
                return out.transpose(1, 2).reshape(b * longest, h, d)[rows_of]

            for phase in ("fwd", "fwd+bwd"):
                rows += _varlen_phase_rows(args, phase, dtype, lengths, (q, k, v), cu, padded, unpadded, keep, full)
            del q, k, v, full
            torch.cuda.empty_cache()
    return rows


def _varlen_phase_rows(args, phase, dtype, lengths, packed, cu, padded, unpadded, keep, full) -> list[Row]:
    """One phase of varlen_rows' case: "fwd", or "fwd+bwd" (its dV compared on the sequences' rows)."""
    from cs149gpt.flash_attn import flash_attn_varlen_func
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, longest, total = len(lengths), max(lengths), sum(lengths)
    h, d = packed[0].shape[1:]
    case = f"varlen {phase} {b} seqs {min(lengths)}..{longest} ({total} tokens, H {h}, d {d}) causal"
    print(f"  cuda {case} {dtype} ...", file=sys.stderr, flush=True)
    backward = phase == "fwd+bwd"
    q, k, v = (t.detach().requires_grad_(backward) for t in packed)
    qp, kp, vp = (padded(t.detach()).requires_grad_(backward) for t in packed)
    dout = torch.randn_like(q)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=full)

    calls = {"varlen": lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True),
             "ours padded": lambda: cs149gpt.attention(qp, kp, vp, attn_mask=keep, is_causal=True),
             "sdpa cudnn": cudnn,
             "sdpa default": lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=full)}
    if backward:  # (packed) dV of the forward and backward
        grad_of = lambda f, xs, g: lambda: torch.autograd.grad(f(), xs, g)[2]  # noqa: E731
        dout_padded = padded(dout)
        calls = {name: grad_of(f, (q, k, v), dout) if name == "varlen" else grad_of(f, (qp, kp, vp), dout_padded)
                 for name, f in calls.items()}
    skipped = _ours_or_skip(calls["varlen"], "cuda", case, dtype, "varlen", ["ours padded", "sdpa cudnn"])
    if skipped:
        return skipped
    check = lambda out, ref: (out.float() - unpadded(ref).float()).abs().max().item()  # noqa: E731
    tol = 4 * MATCH_TOLERANCE[DTYPES[dtype]] if backward else None
    flop = sum(4.0 * h * m * m * d * 0.5 for m in lengths) * (3.5 if backward else 1.0)
    rate = lambda row: flop / (row.ours_ms * 1e-3) / 1e12  # noqa: E731
    ours = {"varlen": calls["varlen"]}
    rows = []
    if _ours_or_skip(calls["ours padded"], "cuda", case, dtype, "varlen", ["ours padded"]) is None:
        rows += _sync_rows(measured_rows("cuda", case, dtype, None, ours, ("ours padded", calls["ours padded"]), args,
                                         unit="TFLOP/s", check=check, tolerance=tol, sync=torch.cuda.synchronize),
                           rate)
    else:
        rows.append(Row("cuda", case, dtype, None, "varlen", "ours padded", status="skipped",
                        note="our padded masked call is not available in this build"))
    peer = "sdpa cudnn"
    try:
        calls[peer]()
    except RuntimeError:  # cuDNN refuses this mask or shape here: SDPA's own choice of backend
        peer = "sdpa default"
    rows += _sync_rows(measured_rows("cuda", case, dtype, None, ours, (peer, calls[peer]), args, unit="TFLOP/s",
                                     check=check, tolerance=tol, sync=torch.cuda.synchronize), rate)
    return rows


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy of 2 GiB (read + write counted): the bandwidth decode is put against."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    times = interleave({"copy": lambda: dst.copy_(src)}, 3, 0.5, sync=torch.cuda.synchronize)
    return 2 * src.numel() * src.element_size() / times["copy"].median / 1e9


def host_seconds(fn, calls: int = 200, repeats: int = 5) -> float:
    """Seconds of host work a call: the time to issue `calls` calls back to back without waiting for the GPU (the
    launch queue holds them), the median of `repeats` such blocks."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def decode_rows(args, bandwidth: float, cases: Sequence[tuple] = ()) -> list[Row]:
    """attention_with_kvcache, one query row per sequence, vs torch SDPA's fastest backend on the same cache."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = 32, 8, 128
    cases = cases or ([(1, 1024), (8, 8192)] if args.quick else
             [(1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (8, 32768), (64, 1024), (64, 8192),
              (64, 16384)])
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    rows = []
    for dtype in args.dtype or ["bfloat16"]:
        for b, n in cases:
            g = torch.Generator(device="cuda").manual_seed(b * n)
            q = torch.randn(b, hq, 1, d, device="cuda", generator=g).to(DTYPES[dtype])
            k_cache, v_cache = (torch.randn(b, hkv, n, d, device="cuda", generator=g).to(DTYPES[dtype])
                                for _ in range(2))
            seqlens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            case = f"decode B {b}, {n} keys (Hq {hq}, Hkv {hkv}, d {d})"
            print(f"  cuda {case} {dtype} ...", file=sys.stderr, flush=True)
            ours = lambda: cs149gpt.attention_with_kvcache(q, k_cache, v_cache, seqlens)  # noqa: E731
            skipped = _ours_or_skip(ours, "cuda", case, dtype, "ours kvcache", ["sdpa best"])
            if skipped:
                rows += skipped
                continue
            calls, errors, expanded = {"ours": ours}, {}, []
            reference = F.scaled_dot_product_attention(q.float(), k_cache.float(), v_cache.float(), enable_gqa=True)
            for name, backend in backends.items():
                def attend(backend=backend, k=k_cache, v=v_cache, gqa=True):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                try:
                    attend()
                    calls[name] = attend
                except RuntimeError as e:  # a backend without enable_gqa: the cache expanded once, beforehand
                    if name == "math":
                        errors[name] = first_line(e)
                        continue
                    if not expanded:
                        expanded += [t.repeat_interleave(hq // hkv, 1) for t in (k_cache, v_cache)]
                    ke, ve = expanded
                    try:
                        attend(k=ke, v=ve, gqa=False)
                        calls[name] = lambda attend=attend, ke=ke, ve=ve: attend(k=ke, v=ve, gqa=False)
                    except RuntimeError as e2:
                        errors[name] = first_line(e2)
            err = (ours().float() - reference).abs().max().item()
            times = interleave(calls, args.rounds, args.seconds, sync=torch.cuda.synchronize)
            best = min((name for name in calls if name != "ours"), key=lambda name: times[name].median)
            t, tb = times["ours"], times[best]
            row = Row("cuda", case, dtype, None, "ours kvcache", f"sdpa best ({best})", t.median * 1e3,
                      tb.median * 1e3, tb.median / t.median, unit="GB/s", err=err)
            kv_bytes = 2 * b * hkv * n * d * k_cache.element_size()
            row.rate = kv_bytes / t.median / 1e9
            row.add_note(f"{100 * row.rate / bandwidth:.0f}% of the {bandwidth:.0f} GB/s copy; host "
                         f"{host_seconds(ours) * 1e6:.1f} us a call; sdpa " +
                         ", ".join(f"{name} {times[name].median * 1e3:.3f} ms" for name in calls if name != "ours"))
            if errors:
                row.add_note("refused: " + ", ".join(errors))
            if not err <= MATCH_TOLERANCE[DTYPES[dtype]]:
                row.status = "wrong"
                row.add_note(f"WRONG: error {err:.3g} against float32 SDPA")
            for who, tt in (("ours", t), (best, tb)):
                if tt.noisy:
                    row.add_note(f"noisy: {who} IQR {100 * tt.iqr / tt.median:.0f}% of median")
            rows.append(row)
            del q, k_cache, v_cache, calls, expanded
            torch.cuda.empty_cache()
    return rows


SUITES = ("plain", "masked", "varlen", "deterministic", "decode")


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """torch.use_deterministic_algorithms(on) inside, the switch as it was after."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def deterministic_rows(dtype: str, shape: tuple, causal: bool, args) -> list[Row]:
    """Our backward in torch's deterministic mode vs our default backward and vs cuDNN's and FlashAttention-2's in
    that mode, timed in the same rounds (a backward of a forward recorded once). The backends are probed and their
    forwards recorded in the mode, where torch picks a backend (cuDNN's backward is not deterministic: torch refuses
    it there). The mode also fills every new tensor (torch.utils.deterministic.fill_uninitialized_memory): part of
    its cost."""
    b, hq, hkv, n, d = shape
    with deterministic_mode(True):
        q, k, v, dout, case, impls, skipped = case_inputs(dtype, shape, causal, ("cudnn", "flash"))
        case = f"bwd {case}"
        print(f"  cuda deterministic {case} {dtype} ...", file=sys.stderr, flush=True)
        grads = {}
        for name, (fn, kk, vv) in impls.items():
            qi, ki, vi = (t.detach().clone().requires_grad_() for t in (q, kk, vv))
            out = fn(qi, ki, vi, causal)
            grads[name] = lambda out=out, qi=qi, ki=ki, vi=vi: torch.autograd.grad(out, (qi, ki, vi), dout,
                                                                                  retain_graph=True)
    calls = {"ours default": grads["ours"]}
    for name, grad in grads.items():
        def in_mode(grad=grad):
            with deterministic_mode(True):
                return grad()
        try:
            first = in_mode()
        except RuntimeError as e:  # a backend without a deterministic backward (ours has one: its error propagates)
            if name == "ours":
                raise
            skipped[name] = f"deterministic mode: {first_line(e)}"
            continue
        calls[name] = in_mode
        if name == "ours":
            repeat = all(torch.equal(a, c) for a, c in zip(first, in_mode()))
            spread = max(rel_err(a, c.float()) for a, c in zip(first, grads["ours"]()))
    times = interleave(calls, args.rounds, args.seconds, sync=torch.cuda.synchronize)
    work = 2.5 * flops(b, hq, n, d, causal)
    ours = times["ours"]
    rows = []
    for peer, label in (("ours default", "ours default"), ("cudnn", "sdpa cudnn deterministic"),
                        ("flash", "sdpa flash deterministic")):
        row = Row("cuda", case, dtype, None, "ours deterministic", label, unit="TFLOP/s")
        if peer in skipped:
            row.status, row.note = "skipped", skipped[peer]
            rows.append(row)
            continue
        t = times[peer]
        row.ours_ms, row.peer_ms, row.ratio = ours.median * 1e3, t.median * 1e3, t.median / ours.median
        row.rate = work / ours.median / 1e12
        row.add_note(f"peer {work / t.median / 1e12:.0f} TFLOP/s")
        if peer == "ours default":
            row.err = spread
            row.add_note(f"two deterministic calls {'bitwise equal' if repeat else 'DIFFER'}; rel. difference from "
                         f"the default's {spread:.1e}")
            if not repeat:
                row.status = "wrong"
        for who, tt in (("ours", ours), (peer, t)):
            if tt.noisy:
                row.add_note(f"noisy: {who} IQR {100 * tt.iqr / tt.median:.0f}% of median")
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


def run_cuda(args) -> list[Row]:
    if not torch.cuda.is_available():
        print("cuda: skipped: no CUDA GPU here (torch.cuda.is_available() is False; this torch is "
              f"{torch.__version__})", file=sys.stderr)
        return [Row("cuda", "all", "", None, "ours", "sdpa", status="skipped", note="no CUDA GPU on this machine")]
    if args.configs:
        return config_rows(args)
    rows = []
    causals = {"off": [False], "on": [True], "both": [False, True]}[args.causal or "both"]
    if "plain" in args.suite:
        peak = matmul_peak()
        print(f"cuda: a bf16 8192³ matmul runs at {peak:.0f} TFLOP/s on this GPU", file=sys.stderr)
        rows += [row for dtype in args.dtype or ["bfloat16"] for shape in shapes(args) for causal in causals
                 for row in case_rows(dtype, shape, causal, args, peak)]
    if "masked" in args.suite:
        rows += masked_rows(args)
    if "varlen" in args.suite:
        rows += varlen_rows(args)
    if "deterministic" in args.suite:
        rows += [row for dtype in args.dtype or ["bfloat16"] for shape in shapes(args) for causal in causals
                 for row in deterministic_rows(dtype, shape, causal, args)]
    if "decode" in args.suite:
        bandwidth = copy_bandwidth()
        print(f"cuda: a device-to-device copy runs at {bandwidth:.0f} GB/s on this GPU", file=sys.stderr)
        rows += decode_rows(args, bandwidth)
    return rows


def parse_suites(text: str) -> list[str]:
    names = text.split(",")
    for name in names:
        if name not in SUITES:
            raise argparse.ArgumentTypeError(f"unknown suite {name!r}: choose among {', '.join(SUITES)}")
    return names


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("cuda", parents=[common], help="the CUDA kernels vs each torch SDPA backend (fwd, bwd)")
    p.set_defaults(run=run_cuda)
    p.add_argument("--backends", type=lambda t: t.split(","), default=list(BACKENDS),
                   help=f"comma list of {','.join(BACKENDS)}")
    p.add_argument("--configs", action="store_true", help="time each compiled tile configuration of ours instead")
    p.add_argument("--suite", type=parse_suites, default=["plain"],
                   help=f"comma list of row groups: {','.join(SUITES)} (default plain; the module docstring says each)")
