"""The flash backward pass and the PyTorch integration around it, against float64 autograd.

Covered: gradients of cs149gpt.attention(impl="flash") in q, k, v against float64 autograd of a reference
written from the definition (itself checked against torch's SDPA autograd): CS336's (4, 128, 64), odd 4-D
shapes, 2-D to 6-D inputs, Nq != Nk both ways, GQA/MQA (dk/dv summed per group), both causal alignments,
explicit scales, odd tiles, strided inputs (gradients land in the base tensor) and strided dout; k, v laid out
fused or with an odd row stride give the bits of contiguous ones; bf16/fp16 gradients; rows that see no key;
bitwise independence of the thread count; a float32 central finite-difference check; torch.library.opcheck of
the three operators; torch.compile(fullgraph=True); the SDPA-signature wrapper (our path and every fallback);
what autograd saves (O(N): q, k, v, out, lse); and argument errors of flash_attention_backward. Each main
gradient test runs on every ISA (the `isa` fixture).

Inputs come from fixed seeds. Loops collect every mismatch and report them all at once.
"""
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import cs149gpt
from tests._helpers import (BF16_DOT_ISAS, backward_path, gen, isa, module, randn, scaled_scores,  # noqa: F401
                            visible_mask)  # (isa, backward_path: fixtures)

# Max abs error of float32 out/dq/dk/dv against float64 autograd, for unit-scale (randn) q, k, v and dout
# and the default scale (grad_tol() widens it for sharper explicit scales). Measured on every ISA over the
# shapes below: <= 2.4e-6 (gradient entries up to ~6 in magnitude; scale 2.5: <= 6e-5 of grad_tol's 2.1e-4).
# A backward that dropped a term, a scale or a group's contribution is off by O(0.1..1), and one that
# scaled dq by (1 + 3e-5) already fails.
GRAD_TOL = 2e-5

# Norm-relative error of bf16/fp16 gradients against float64 autograd on the same (upcast) inputs.
# The backward computes in float32 (error ~1e-6, negligible here) and rounds each of dq, dk, dv once to the
# input dtype: <= u = 2^-p relative per element (p = 8 significand bits for bf16, 11 for fp16). One more
# rounding enters through the saved out, itself rounded to the dtype, which the backward uses for
# D_i = rowsum(dO_i * O_i): another <= u relative in D, and so in dS = P * (dP - D). Hence 2u. Measured
# (randn, Nq up to 512, causal or not, GQA): <= 2.1e-3 for bf16 (2u = 7.8e-3) and <= 2.6e-4 for fp16
# (2u = 9.8e-4), i.e. the roundings themselves; the worst case is a 64-element bf16 dk of
# test_fully_masked_rows at 3.4e-3, where cancellation in dP - D weighs the rounding of out more.
LOW_PRECISION = (torch.bfloat16, torch.float16)
GRAD_REL_TOL = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}

CAUSAL_MODES = [False, True, "bottom_right"]


# ---------------------------------------------------------------------------------------------------------
# The reference: softmax(scale · q kᵀ, masked) v in float64, differentiable by torch's autograd. A query row
# that sees no key gets out = 0 (the kernel's documented behaviour), hence zero gradient through that row.
# ---------------------------------------------------------------------------------------------------------
def ref_forward(q, k, v, scale=None, is_causal=False):
    """float64 q, k, v (..., N, d), GQA on dim -3 (repeat_interleave, so autograd sums dk/dv per group)."""
    s, v = scaled_scores(q, k, v, scale)
    mask = visible_mask(q.shape[-2], k.shape[-2], is_causal)
    if mask is None:
        return torch.softmax(s, dim=-1) @ v
    seen = mask.any(-1)
    # A row that sees nothing is left unmasked (a finite softmax, no NaN in autograd) and then zeroed.
    s = s.masked_fill(~mask & seen[:, None], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v) * seen[:, None].to(s.dtype)


def ref_grads(q, k, v, dout, *, scale=None, is_causal=False, **_tiles):
    """(out, dq, dk, dv) by float64 autograd of ref_forward on float64 leaf copies of q, k, v."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = ref_forward(*leaves, scale=scale, is_causal=is_causal)
    out.backward(dout.double())
    return (out.detach(), *(t.grad for t in leaves))


def our_grads(q, k, v, dout, **kwargs):
    """(out, dq, dk, dv) of cs149gpt.attention(impl="flash") by autograd, on leaf copies of q, k, v."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = cs149gpt.attention(*leaves, **kwargs)
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


NAMES = ("out", "dq", "dk", "dv")


def grad_tol(d, scale=None):
    """GRAD_TOL for logits of unit scale. The float32 error of P = exp(s - lse) grows with |s|, which for randn
    inputs is ~scale·sqrt(d) (1 for the default scale), so a sharper explicit scale gets proportionally more."""
    return GRAD_TOL * max(1.0, (scale if scale is not None else 1 / math.sqrt(d)) * math.sqrt(d))


def grad_problems(ours, want, like, label, *, scale=None):
    """What is wrong with (out, dq, dk, dv) against the float64 `want`, as a list of lines. `like` gives the
    expected shapes and dtype: (q, k, v); `scale` the scale used (None: the default)."""
    found = []
    q, k, v = like
    tol = grad_tol(q.shape[-1], scale)
    for name, got, ref, shape in zip(NAMES, ours, want, (q.shape, q.shape, k.shape, v.shape)):
        if got is None:
            found.append(f"{label} {name}: None")
            continue
        if got.shape != shape or got.dtype != q.dtype:
            found.append(f"{label} {name}: shape {tuple(got.shape)} dtype {got.dtype}, expected {tuple(shape)} "
                         f"{q.dtype}")
            continue
        g = got.double()
        if not torch.isfinite(g).all():
            found.append(f"{label} {name}: non-finite values")
            continue
        if q.dtype == torch.float32:
            err = (g - ref).abs().max().item()
            if not err <= tol:
                found.append(f"{label} {name}: max abs error {err:.3g} > {tol:g}")
        else:
            diff, size = (g - ref).norm().item(), ref.norm().item()
            rel = diff / size if size > 0 else (0.0 if diff == 0 else math.inf)  # exact 0 (e.g. Nk = 1): exact
            if not rel <= GRAD_REL_TOL[q.dtype]:
                found.append(f"{label} {name}: norm-relative error {rel:.3g} > {GRAD_REL_TOL[q.dtype]:.3g}")
    return found


def check_grads(q, k, v, dout, failures, label, want=None, **kwargs):
    """Appends to `failures` what is wrong with our gradients; `want`: ref_grads(...) if already computed."""
    ours = our_grads(q, k, v, dout, **kwargs)
    if want is None:
        want = ref_grads(q, k, v, dout, **kwargs)
    failures += grad_problems(ours, want, (q, k, v), f"{label} {kwargs}", scale=kwargs.get("scale"))
    return ours


def inputs(q_shape, kv_shape, g, dtype=torch.float32):
    """q, k, v, dout from randn."""
    return tuple(randn(*s, gen=g).to(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))


def test_reference_gradients_match_torch_sdpa():
    """ref_forward and its float64 gradients are torch's: SDPA with is_causal (top-left), causal_lower_right
    (bottom-right, Nq <= Nk so no row is empty), enable_gqa and an explicit scale."""
    g = gen(700)
    for hq, hkv, n_q, n_k, d in [(3, 3, 9, 9, 8), (6, 2, 5, 12, 16), (6, 1, 12, 5, 7), (2, 2, 1, 7, 4)]:
        q, k, v, dout = (t.double() for t in inputs((2, hq, n_q, d), (2, hkv, n_k, d), g))
        for scale in (None, 0.3):
            for mode in CAUSAL_MODES:
                if mode == "bottom_right" and n_q > n_k:
                    continue
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if mode == "bottom_right":
                    kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in leaves[1:])  # CausalBias: no GQA
                    want = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=causal_lower_right(n_q, n_k),
                                                          scale=scale)
                else:
                    want = F.scaled_dot_product_attention(*leaves, is_causal=mode, scale=scale,
                                                          enable_gqa=hq != hkv)
                want.backward(dout)
                got = ref_grads(q, k, v, dout, scale=scale, is_causal=mode)
                for name, a, b in zip(NAMES, got, (want.detach(), *(t.grad for t in leaves))):
                    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{name} {hq}/{hkv} {mode}")


# ---------------------------------------------------------------------------------------------------------
# float32 gradients against float64 autograd
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backward_path", ["one_pass", "two_pass"], indirect=True)
@pytest.mark.parametrize("is_causal", [False, True])
def test_cs336_shape(isa, is_causal, backward_path):
    """(4, 128, 64) 3-D tensors, as in CS336's FlashAttention-2 assignment."""
    g = gen(701)
    q, k, v, dout = inputs((4, 128, 64), (4, 128, 64), g)
    failures = []
    check_grads(q, k, v, dout, failures, "(4, 128, 64)", is_causal=is_causal)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backward_path", ["one_pass", "two_pass"], indirect=True)
def test_4d_odd_shapes_gqa_and_causal_alignments(isa, backward_path):
    """(B, H, N, d) with sizes no vector width or tile divides, Nq != Nk both ways, GQA (Hq=6 over 2 and 1
    kv heads), every causal mode, explicit scales."""
    g = gen(702)
    failures = []
    cases = [((2, 3, 37, 17), (2, 3, 37, 17)), ((2, 3, 23, 17), (2, 3, 41, 17)), ((2, 3, 41, 17), (2, 3, 23, 17)),
             ((2, 6, 29, 16), (2, 2, 29, 16)), ((2, 6, 19, 8), (2, 2, 33, 8)), ((1, 6, 33, 20), (1, 1, 19, 20)),
             ((2, 3, 1, 24), (2, 3, 30, 24))]
    for q_shape, kv_shape in cases:
        q, k, v, dout = inputs(q_shape, kv_shape, g)
        for mode, scale in [(False, None), (True, None), ("top_left", 0.3), ("bottom_right", None),
                            ("bottom_right", 0.3), (False, 2.5)]:
            check_grads(q, k, v, dout, failures, f"{q_shape}/{kv_shape}", is_causal=mode, scale=scale)
    assert not failures, "\n".join(failures)


def test_dq_summed_in_the_gradient(isa, backward_path):
    """With the keys split into runs, each run's dQ is merged into its kv head's sum in the order of the runs, the
    sum kept in dq itself for float32 (flash_backward_onepass.cpp). GQA; q laid out (B, N, H, d), so that dq's rows
    are H·d apart and its heads d apart; Nq 50, 73 and 24 (whole and partial row groups); every causal mode."""
    g = gen(704)
    failures = []
    for b, hq, hkv, n_q, n_k, d in [(2, 6, 2, 50, 300, 32), (1, 4, 4, 73, 73, 64), (1, 2, 1, 24, 40, 16)]:
        q = randn(b, n_q, hq, d, gen=g).transpose(1, 2)  # (B, H, N, d) viewed out of (B, N, H, d)
        k, v = randn(b, hkv, n_k, d, gen=g), randn(b, hkv, n_k, d, gen=g)
        dout = randn(b, hq, n_q, d, gen=g)
        for mode in CAUSAL_MODES:
            ours = check_grads(q, k, v, dout, failures, f"{(b, hq, n_q, d)}/{(b, hkv, n_k, d)}", is_causal=mode)
            assert ours[1].stride() == q.stride(), ours[1].stride()
    assert not failures, "\n".join(failures)


def test_odd_tile_sizes(isa, backward_path):
    """block_q / block_k in {1, 3, 17, 50}: tiles of one row, tiles no length divides, tiles longer than the
    sequence; with masks cutting tiles and with GQA."""
    g = gen(703)
    failures = []
    blocks = [(1, 3), (3, 1), (17, 50), (50, 17), (1, 50), (17, 3), (50, 50)]
    for q_shape, kv_shape in [((1, 2, 37, 16), (1, 2, 45, 16)), ((1, 4, 45, 9), (1, 2, 37, 9))]:
        q, k, v, dout = inputs(q_shape, kv_shape, g)
        for mode in CAUSAL_MODES:
            want = ref_grads(q, k, v, dout, is_causal=mode)
            for block_q, block_k in blocks:
                check_grads(q, k, v, dout, failures, f"{q_shape}/{kv_shape}", want, is_causal=mode,
                            block_q=block_q, block_k=block_k)
    assert not failures, "\n".join(failures)


def test_any_number_of_leading_dims():
    """2-D (N, d), 3-D (also GQA: (H, N, d) with fewer kv heads), 5-D and 6-D with GQA on dim -3; gradients have
    the inputs' shapes."""
    g = gen(704)
    failures = []
    for q_shape, kv_shape in [((19, 8), (27, 8)), ((5, 13, 8), (5, 21, 8)), ((6, 13, 8), (2, 21, 8)),
                              ((2, 2, 6, 15, 12), (2, 2, 3, 22, 12)),
                              ((2, 1, 3, 4, 9, 5), (2, 1, 3, 2, 9, 5))]:
        q, k, v, dout = inputs(q_shape, kv_shape, g)
        for mode in CAUSAL_MODES:
            check_grads(q, k, v, dout, failures, f"{q_shape}/{kv_shape}", is_causal=mode)
    assert not failures, "\n".join(failures)


def _strided_cases(g):
    """(name, bases, views): views(*bases) -> (q, k, v), views of the bases that are not contiguous."""
    B, N, Nk, H, d = 2, 21, 26, 4, 16
    yield ("transposed (B, N, H, d)", [randn(B, N, H, d, gen=g), randn(B, Nk, H, d, gen=g), randn(B, Nk, H, d, gen=g)],
           lambda q, k, v: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    # One fused projection output (B, N, 3, H, d), as a GPT block makes it; q, k, v are slices of one tensor.
    yield ("fused qkv", [randn(B, N, 3, H, d, gen=g)],
           lambda qkv: (qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)))
    # GQA: fused (B, N, Hq + 2 Hkv, d) with Hq = 4, Hkv = 2.
    yield ("fused qkv, GQA", [randn(B, N, H + 4, d, gen=g)],
           lambda x: (x[:, :, :H].transpose(1, 2), x[:, :, H:H + 2].transpose(1, 2), x[:, :, H + 2:].transpose(1, 2)))
    # 3-D: columns of one (H, N, 3d) tensor, rows of stride 3d.
    yield ("column slices (H, N, 3d)", [randn(H, N, 3 * d, gen=g)],
           lambda x: (x[..., :d], x[..., d:2 * d], x[..., 2 * d:]))
    # The head dim itself strided (the one case the module copies).
    yield ("last dim strided", [randn(B, H, d, N, gen=g), randn(B, H, d, Nk, gen=g), randn(B, H, d, Nk, gen=g)],
           lambda q, k, v: (q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2)))


@pytest.mark.parametrize("backward_path", ["one_pass", "two_pass"], indirect=True)
def test_strided_inputs_grad_lands_in_base(isa, backward_path):
    """q, k, v are non-contiguous views of tensors that require grad; base.grad equals float64 autograd
    through the same views."""
    g = gen(705)
    failures = []
    for name, bases, views in _strided_cases(g):
        for mode in CAUSAL_MODES:
            leaves = [b.clone().requires_grad_() for b in bases]
            q, k, v = views(*leaves)
            assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous()), name
            dout = randn(*q.shape, gen=g)
            cs149gpt.attention(q, k, v, is_causal=mode).backward(dout)
            leaves64 = [b.double().requires_grad_() for b in bases]
            ref_forward(*views(*leaves64), is_causal=mode).backward(dout.double())
            for i, (ours, ref) in enumerate(zip(leaves, leaves64)):
                err = (ours.grad.double() - ref.grad).abs().max().item()
                if not err <= GRAD_TOL:
                    failures.append(f"{name} causal={mode}: base {i} grad max abs error {err:.3g}")
            for b, b0 in zip(leaves, bases):
                if not torch.equal(b.detach(), b0):
                    failures.append(f"{name}: an input was modified")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backward_path", ["one_pass", "two_pass"], indirect=True)
def test_strided_dout(isa, backward_path):
    """dout as autograd may hand it over: expanded (out.sum(): all strides 0), broadcast over batch and heads,
    transposed, head dim strided. Same bits as with a contiguous dout, and correct."""
    g = gen(706)
    B, H, N, Nk, d = 2, 3, 20, 27, 12
    q, k, v, _ = inputs((B, H, N, d), (B, H, Nk, d), g)
    douts = {
        "ones expanded (out.sum())": torch.ones(()).expand(B, H, N, d),
        "broadcast (N, d)": randn(N, d, gen=g).expand(B, H, N, d),
        "transposed (B, N, H, d)": randn(B, N, H, d, gen=g).transpose(1, 2),
        "head dim strided": randn(B, H, d, N, gen=g).transpose(-1, -2),
    }
    failures = []
    for name, dout in douts.items():
        assert not dout.is_contiguous()
        for mode in (False, "bottom_right"):
            ours = our_grads(q, k, v, dout, is_causal=mode)
            contiguous = our_grads(q, k, v, dout.contiguous(), is_causal=mode)
            if not all(torch.equal(a, b) for a, b in zip(ours, contiguous)):
                failures.append(f"{name} causal={mode}: gradients differ from those with dout.contiguous()")
            failures += grad_problems(ours, ref_grads(q, k, v, dout, is_causal=mode), (q, k, v),
                                      f"{name} causal={mode}")
    # The common case end to end: loss = out.sum() (dout all strides 0).
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cs149gpt.attention(*leaves, is_causal=True).sum().backward()
    want = ref_grads(q, k, v, torch.ones(B, H, N, d), is_causal=True)
    out = cs149gpt.attention(q, k, v, is_causal=True)
    failures += grad_problems((out, *(t.grad for t in leaves)), want, (q, k, v), "out.sum().backward()")
    assert not failures, "\n".join(failures)


def test_partial_requires_grad_and_lse_not_differentiable():
    """Only some inputs requiring grad: those get the right gradients, the others none. out requires grad,
    lse (return_lse=True) does not; the gradients are contiguous, with the inputs' shapes and dtype."""
    g = gen(707)
    q, k, v, dout = inputs((2, 4, 13, 8), (2, 2, 17, 8), g)
    want = ref_grads(q, k, v, dout, is_causal="bottom_right")
    for which in [(0,), (1,), (2,), (0, 2)]:
        leaves = [t.clone().requires_grad_(i in which) for i, t in enumerate((q, k, v))]
        out, lse = cs149gpt.attention(*leaves, is_causal="bottom_right", return_lse=True)
        assert out.requires_grad and not lse.requires_grad
        out.backward(dout)
        for i, t in enumerate(leaves):
            if i in which:
                assert t.grad.shape == t.shape and t.grad.dtype == t.dtype and t.grad.is_contiguous()
                err = (t.grad.double() - want[i + 1]).abs().max().item()
                assert err <= GRAD_TOL, f"requires_grad on {which}: {NAMES[i + 1]} error {err:.3g}"
            else:
                assert t.grad is None
    with torch.no_grad():
        assert not cs149gpt.attention(*(t.clone().requires_grad_() for t in (q, k, v))).requires_grad


# ---------------------------------------------------------------------------------------------------------
# bf16 / fp16
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backward_path", ["one_pass", "two_pass"], indirect=True)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_low_precision_gradients(isa, dtype, backward_path):
    """Gradients in the input dtype, within 2u (norm-relative) of float64 autograd on the same inputs."""
    g = gen(708)
    failures = []
    for q_shape, kv_shape, mode in [((4, 128, 64), (4, 128, 64), False), ((4, 128, 64), (4, 128, 64), True),
                                    ((2, 6, 37, 17), (2, 2, 45, 17), "bottom_right"),
                                    ((2, 6, 45, 17), (2, 3, 37, 17), True)]:
        q, k, v, dout = inputs(q_shape, kv_shape, g, dtype)
        check_grads(q, k, v, dout, failures, f"{dtype} {q_shape}/{kv_shape}", is_causal=mode)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backward_path", ["one_pass", "one_pass_chunked"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_key_layout_does_not_change_the_bits(isa, dtype, backward_path):
    """Gradients of k and v given as views of a fused (B, N, 3, H, d) tensor (rows 3·H·d apart), as views with an odd
    row stride (d + 1), as views with rows 4 KB apart (a (B, N, H, d) buffer with H·d = 4096 bytes: Llama-sized heads),
    and as contiguous tensors are torch.equal, and within tolerance of float64 autograd. The one-pass kernels read K
    (float32) or whole 32-key strips of K and V (bf16) in place where the rows allow and pack them otherwise (an odd
    bf16 stride, the keys of a last partial strip): the values multiplied are the same either way. Key tiles of 256 and 96 (key counts not a multiple of 32) and the default; causal and not; GQA."""
    g = gen(712)
    failures = []
    for (b, hq, hkv, nq, nk, d), causal in [((1, 4, 2, 150, 300, 64), False), ((1, 2, 2, 200, 270, 128), True),
                                            ((2, 2, 1, 77, 130, 32), "bottom_right")]:
        q, dout = (randn(b, hq, nq, d, gen=g).to(dtype) for _ in range(2))
        fused = randn(b, nk, 3, hkv, d, gen=g).to(dtype)
        k_fused, v_fused = fused[:, :, 1].transpose(1, 2), fused[:, :, 2].transpose(1, 2)
        k, v = k_fused.contiguous(), v_fused.contiguous()
        want = ref_grads(q, k, v, dout, is_causal=causal)
        for tiles in [(None, None), (64, 256), (64, 96)]:
            label = f"{dtype} {(b, hq, hkv, nq, nk, d)} causal={causal} tiles={tiles}"
            kwargs = dict(is_causal=causal, block_q=tiles[0], block_k=tiles[1])
            base = check_grads(q, k, v, dout, failures, label, want=want, **kwargs)
            for layout in ("fused", "odd stride", "4 KB stride"):
                # views of leaves, so that the kernels see their strides (our_grads' clones would be contiguous)
                if layout == "fused":
                    leaf = fused.detach().clone().requires_grad_()
                    kl, vl = leaf[:, :, 1].transpose(1, 2), leaf[:, :, 2].transpose(1, 2)
                elif layout == "odd stride":
                    padded = [torch.zeros(b, hkv, nk, d + 1, dtype=dtype) for _ in range(2)]
                    for t, src in zip(padded, (k, v)):
                        t[..., :d] = src
                    kl, vl = (t.requires_grad_()[..., :d] for t in padded)
                else:
                    heads = 4096 // (d * dtype.itemsize)  # of d values each: rows 4 KB apart
                    wide = [torch.zeros(b, nk, heads, d, dtype=dtype) for _ in range(2)]
                    for t, src in zip(wide, (k, v)):
                        t[:, :, :hkv] = src.transpose(1, 2)
                    kl, vl = (t.requires_grad_()[:, :, :hkv].transpose(1, 2) for t in wide)
                row_stride = {"fused": 3 * hkv * d, "odd stride": d + 1}.get(layout, 4096 // dtype.itemsize)
                assert kl.stride(-2) == row_stride, layout
                ql = q.detach().clone().requires_grad_()
                out = cs149gpt.attention(ql, kl, vl, **kwargs)
                got = (out.detach(), *torch.autograd.grad(out, (ql, kl, vl), dout))
                for name, a, c in zip(NAMES, got, base):
                    if not torch.equal(a, c):
                        failures.append(f"{label}: {name} with k, v {layout} differs from contiguous "
                                        f"(max diff {(a.double() - c.double()).abs().max().item():.3g})")
    assert not failures, "\n".join(failures)


def test_bf16_gradients_no_further_from_float64_than_torch(isa, backward_path):
    """bf16 dq, dk, dv: max abs error against float64 autograd (on the same bf16 inputs) at most 1.5x that of
    torch's own bf16 SDPA backward, per gradient. The bf16 one-pass kernel multiplies in bf16 on the dot-product
    instructions (amx, avx512_bf16) and rounds P and dS to bf16, as torch does, but accumulates dq, dk, dv in float32
    across all tiles. Measured on avx512_bf16: ratios 0.3-1.0 (dq equal to torch's: both are the float64 value
    rounded once to bf16 at the largest entry)."""
    g = gen(711)
    failures = []
    for shape, causal in [((1, 4, 256, 64), False), ((1, 4, 256, 64), True), ((2, 3, 300, 32), True),
                          ((1, 2, 200, 128), False)] + ([((1, 1, 2100, 128), True)] if isa in BF16_DOT_ISAS else []):
        # (the last, on the bf16 kernel's ISAs: Qᵀ and dOᵀ beyond its kMaxCachedQuery, packed per tile pair)
        q, k, v, dout = (randn(*shape, gen=g).to(torch.bfloat16) for _ in range(4))
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(F.scaled_dot_product_attention(*leaves64, is_causal=causal), leaves64,
                                   dout.double())

        def errors(attend):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            got = torch.autograd.grad(attend(*leaves), leaves, dout)
            return [(a.double() - b).abs().max().item() for a, b in zip(got, want)]

        theirs = errors(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal))
        ours = errors(lambda a, b, c: cs149gpt.attention(a, b, c, is_causal=causal))
        for name, e_ours, e_torch in zip(("dq", "dk", "dv"), ours, theirs):
            if not e_ours <= 1.5 * e_torch:
                failures.append(f"{shape} causal={causal} {name}: max error {e_ours:.3g} > 1.5 x torch's {e_torch:.3g}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# Rows that see no key (bottom-right with Nq > Nk)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fully_masked_rows(isa, dtype, backward_path):
    """Query i sees keys j <= i + Nk - Nq: the first Nq - Nk rows see nothing. Their out rows and dq rows are
    exactly 0, nothing is NaN, and dk/dv (fed by the other rows only) are correct."""
    g = gen(709)
    failures = []
    for q_shape, kv_shape in [((2, 3, 40, 16), (2, 3, 25, 16)), ((1, 4, 9, 8), (1, 2, 4, 8)), ((3, 30, 5), (3, 1, 5))]:
        q, k, v, dout = inputs(q_shape, kv_shape, g, dtype)
        dead = q_shape[-2] - kv_shape[-2]
        want = ref_grads(q, k, v, dout, is_causal="bottom_right")
        for block_q, block_k in [(None, None), (3, 5), (1, 1), (50, 2)]:
            label = f"{q_shape}/{kv_shape} tiles {block_q}x{block_k}"
            out, dq, dk, dv = ours = check_grads(q, k, v, dout, failures, label, want, is_causal="bottom_right",
                                                 block_q=block_q, block_k=block_k)
            for name, t in zip(NAMES, ours):
                if torch.isnan(t).any():
                    failures.append(f"{label}: NaN in {name}")
            if not (out[..., :dead, :] == 0).all():
                failures.append(f"{label}: out rows that see no key are not 0")
            if not (dq[..., :dead, :] == 0).all():
                failures.append(f"{label}: dq rows of queries that see no key are not 0")
            if not (out[..., dead:, :] != 0).any(-1).all():
                failures.append(f"{label}: a row that sees keys came out 0")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backward_path", ["auto", "one_pass", "one_pass_chunked", "two_pass"], indirect=True)
def test_backward_bits_do_not_depend_on_thread_count(isa, restore_threads, backward_path, dtype):
    """dq, dk, dv are torch.equal for 1, 2, 3 threads and more threads than CPUs (including GQA, where dk/dv sum over
    a group of query heads, tiles that give several tasks per thread, and key runs that wait for each other's merge
    on threads the OS may not be running), and for two runs on the same thread count: for each backward algorithm,
    and for the one heuristics.h picks (which must not depend on the thread count); float32, and bf16 (its own
    one-pass kernel on amx and avx512_bf16, whose key runs add their dQ to a shared sum in turn)."""
    g = gen(710)
    failures = []
    for q_shape, kv_shape, tiles in [((2, 4, 130, 32), (2, 4, 130, 32), (None, None)),
                                     ((2, 8, 100, 32), (2, 2, 121, 32), (None, None)),
                                     ((1, 6, 90, 24), (1, 1, 77, 24), (7, 20)),
                                     # 32-key tiles: several runs per kv head on every ISA's default tiles too (amx's
                                     # 256-key tile would give the shapes above one run each), two kv heads merging
                                     ((2, 8, 100, 32), (2, 2, 121, 32), (None, 32))]:
        q, k, v, dout = inputs(q_shape, kv_shape, g, dtype)
        for mode in CAUSAL_MODES:
            runs = []
            counts = (1, 2, 3, 2, 2 * (os.cpu_count() or 1) + 1)
            for threads in counts:
                torch.set_num_threads(threads)
                runs.append(our_grads(q, k, v, dout, is_causal=mode, block_q=tiles[0], block_k=tiles[1]))
            for threads, run in zip(counts[1:], runs[1:]):
                for name, a, b in zip(NAMES, run, runs[0]):
                    if not torch.equal(a, b):
                        failures.append(f"{q_shape}/{kv_shape} causal={mode}: {name} on {threads} threads differs "
                                        f"from 1 thread (max diff {(a - b).abs().max().item():.3g})")
            failures += grad_problems(runs[0], ref_grads(q, k, v, dout, is_causal=mode), (q, k, v),
                                      f"{q_shape}/{kv_shape} causal={mode}")
    assert not failures, "\n".join(failures)


def test_float32_head_parts(isa, restore_threads):
    """float32 one pass with a kv head's query heads split into parts (MQA/GQA on few kv heads, heuristics.h's
    head_parts): each part's dk, dv shares are added into dk, dv in part order, key tile by key tile, and with key runs
    too each (kv head, part)'s dq sum takes its runs in order. Against float64 for 1, 2, 4 and 8 parts (8 query heads
    on 1 kv head; 6 on 2, where 4 parts become gcd(4, 3) = 1 and 2 parts none: 3 is odd), with and without 3 key runs,
    every causal alignment; the bits equal for 1 and 3 threads and for more threads than CPUs (a part waiting for
    its predecessor's share on a thread the OS may not be running)."""
    m = module()
    g = gen(731)
    failures = []
    m._testing.set_backward_path("one_pass")
    try:
        for q_shape, kv_shape in [((1, 8, 70, 16), (1, 1, 90, 16)), ((2, 6, 50, 24), (2, 2, 61, 24))]:
            q, k, v, dout = inputs(q_shape, kv_shape, g)
            for mode in CAUSAL_MODES:
                want = ref_grads(q, k, v, dout, is_causal=mode)
                for parts in (1, 2, 4, 8):
                    for chunks in (1, 3):
                        m._testing.set_backward_head_parts(parts)
                        m._testing.set_backward_key_chunks(chunks)
                        runs = []
                        for threads in (1, 3, 2 * (os.cpu_count() or 1) + 1):
                            torch.set_num_threads(threads)
                            runs.append(our_grads(q, k, v, dout, is_causal=mode, block_k=32))
                        label = f"{q_shape}/{kv_shape} causal={mode} parts={parts} chunks={chunks}"
                        for run in runs[1:]:
                            if not all(torch.equal(a, b) for a, b in zip(run, runs[0])):
                                failures.append(f"{label}: bits depend on the thread count")
                        failures += grad_problems(runs[0], want, (q, k, v), label)
    finally:
        m._testing.set_backward_path("auto")
        m._testing.set_backward_head_parts(0)
        m._testing.set_backward_key_chunks(0)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("isa", BF16_DOT_ISAS, indirect=True)
def test_bf16_key_runs_on_one_thread_share_one_dq_sum(isa, restore_threads, ops):
    """bf16 backward, 4 key runs per kv head, one thread: the runs go kv head by kv head and one float32 dQᵀ sum
    serves them all, so the call's extra memory stays below a float32 dQ of every head (what one sum per kv head
    took: (1,12,1024,64) on one thread then peaked over torch's backward). Extra memory = every allocation the
    profiler sees in the call, less the three bf16 gradients it returns."""
    from torch.profiler import ProfilerActivity, profile

    g = gen(720)
    q, k, v, dout = inputs((1, 12, 512, 64), (1, 12, 512, 64), g, torch.bfloat16)
    out, lse = ops.flash_attention(q, k, v, None, "none", None, None)
    m = module()
    torch.set_num_threads(1)
    m._testing.set_backward_path("one_pass")
    m._testing.set_backward_key_chunks(4)
    try:
        ops.flash_attention_backward(dout, q, k, v, out, lse, None, "none", None, None)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            grads = ops.flash_attention_backward(dout, q, k, v, out, lse, None, "none", None, None)
    finally:
        m._testing.set_backward_path("auto")
        m._testing.set_backward_key_chunks(0)
    allocated = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes() > 0)
    extra = allocated - sum(t.numel() * t.element_size() for t in grads)
    all_heads_dq_f32 = q.numel() * 4
    assert 0 < extra < all_heads_dq_f32, (extra, all_heads_dq_f32)
    failures = grad_problems((out, *grads), ref_grads(q, k, v, dout), (q, k, v), "one thread, 4 key runs")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# Finite differences: our gradient against our own forward
# ---------------------------------------------------------------------------------------------------------
def test_central_finite_differences():
    """float32 central differences of L = <attention(q, k, v), w> along random directions (q, k, v one at a
    time and all together) match <grad L, u>. With eps = 3e-3 the truncation error (~eps²·L''') and the float32
    round-off of L (~1e-7 / eps) are both ~1e-4 (measured <= 1.2e-4); tolerance 1e-3·(1 + |<grad, u>|)."""
    g = gen(711)
    eps = 3e-3
    failures = []
    for q_shape, kv_shape, mode in [((1, 1, 4, 3), (1, 1, 4, 3), False), ((1, 1, 4, 3), (1, 1, 6, 3), True),
                                    ((1, 2, 5, 3), (1, 1, 3, 3), "bottom_right")]:
        q, k, v, w = inputs(q_shape, kv_shape, g)
        w = w.double()

        def loss(a, b, c):
            return (cs149gpt.attention(a, b, c, is_causal=mode).double() * w).sum()

        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(loss(*leaves), leaves)
        for which in (0, 1, 2, None):
            for _ in range(2):
                us = [randn(*t.shape, gen=g) if which in (None, i) else torch.zeros_like(t)
                      for i, t in enumerate((q, k, v))]
                plus = loss(*(t + eps * u for t, u in zip((q, k, v), us)))
                minus = loss(*(t - eps * u for t, u in zip((q, k, v), us)))
                fd = ((plus - minus) / (2 * eps)).item()
                analytic = sum((gr.double() * u.double()).sum() for gr, u in zip(grads, us)).item()
                if not abs(fd - analytic) <= 1e-3 * (1 + abs(analytic)):
                    failures.append(f"{q_shape}/{kv_shape} causal={mode} direction on "
                                    f"{'qkv'[which] if which is not None else 'q, k, v'}: finite difference "
                                    f"{fd:.6f} vs <grad, u> {analytic:.6f}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# The operators: direct calls, opcheck, what autograd saves, argument errors
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ops():
    cs149gpt.ops._load()
    return torch.ops.cs149gpt


def test_backward_operator_direct(ops):
    """flash_attention_backward on a real forward's out and lse gives autograd's gradients, bitwise."""
    g = gen(712)
    q, k, v, dout = inputs((2, 6, 21, 10), (2, 3, 29, 10), g)
    out, lse = ops.flash_attention(q, k, v, 0.4, "bottom_right", 5, 7)
    dq, dk, dv = ops.flash_attention_backward(dout, q, k, v, out, lse, 0.4, "bottom_right", 5, 7)
    ours = our_grads(q, k, v, dout, scale=0.4, is_causal="bottom_right", block_q=5, block_k=7)
    for name, a, b in zip(NAMES, (out, dq, dk, dv), ours):
        assert torch.equal(a, b), name
    failures = grad_problems((out, dq, dk, dv), ref_grads(q, k, v, dout, scale=0.4, is_causal="bottom_right"),
                             (q, k, v), "direct", scale=0.4)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("causal", ["none", "top_left"])
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_opcheck_attention(ops, impl, causal):
    g = gen(713)
    q, k, v, _ = inputs((2, 4, 7, 5), (2, 2, 9, 5), g)
    torch.library.opcheck(ops.attention.default, (q, k, v, impl, None, causal, None, None))


@pytest.mark.parametrize("causal, dtype", [("none", torch.float32), ("bottom_right", torch.float32),
                                           ("top_left", torch.bfloat16)], ids=["none-f32", "bottom_right-f32",
                                                                               "top_left-bf16"])
def test_opcheck_flash_attention(ops, causal, dtype):
    """With requires_grad inputs, so the registered autograd is exercised (test_aot_dispatch_dynamic compares
    its gradients with AOT autograd's). bottom_right with Nq > Nk has rows that see no key (lse = -inf)."""
    g = gen(714)
    q, k, v, _ = inputs((2, 4, 9, 5), (2, 2, 6, 5), g, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops.flash_attention.default, (q, k, v, None, causal, 3, None))


def test_opcheck_flash_attention_backward(ops):
    g = gen(715)
    q, k, v, dout = inputs((2, 4, 9, 5), (2, 2, 11, 5), g)
    out, lse = ops.flash_attention(q, k, v, 0.5, "top_left", None, None)
    torch.library.opcheck(ops.flash_attention_backward.default,
                          (dout, q, k, v, out, lse, 0.5, "top_left", None, None))


def test_gradients_laid_out_like_fused_qkv_inputs(ops):
    """q, k, v viewed out of one (B, N, 3, H, d) projection (heads inside tokens): dq, dk, dv come back laid out
    (B, N, H, d) in memory, as torch's CPU attention lays its gradients out (the views' autograd then copies them
    densely), bitwise equal to the gradients of contiguous copies; opcheck checks the fake's strides against them.
    Contiguous inputs keep contiguous gradients."""
    g = gen(719)
    B, N, H, d = 2, 13, 3, 8
    qkv = randn(B, N, 3, H, d, gen=g)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, d), head stride d, row stride 3·H·d
    dout = randn(B, H, N, d, gen=g)
    out, lse = ops.flash_attention(q, k, v, None, "top_left", None, None)
    grads = ops.flash_attention_backward(dout, q, k, v, out, lse, None, "top_left", None, None)
    q_c, k_c, v_c = (t.contiguous() for t in (q, k, v))
    want = ops.flash_attention_backward(dout, q_c, k_c, v_c, out, lse, None, "top_left", None, None)
    for name, got, ref in zip(NAMES[1:], grads, want):
        assert got.shape == ref.shape and got.stride() == (N * H * d, d, H * d, 1), (name, got.stride())
        assert ref.is_contiguous(), name
        assert torch.equal(got, ref), name
    torch.library.opcheck(ops.flash_attention_backward.default, (dout, q, k, v, out, lse, None, "top_left", None, None))


def test_saved_for_backward_is_o_of_n(ops):
    """Autograd keeps exactly q, k, v (the inputs themselves, not copies or GQA expansions), out and lse:
    O(N) memory, no N x N tensor."""
    g = gen(716)
    q, k, v, _ = inputs((1, 4, 512, 16), (1, 2, 512, 16), g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, lse = cs149gpt.attention(q, k, v, is_causal=True, return_lse=True)
    assert sum(t.numel() for t in saved) == q.numel() + k.numel() + v.numel() + out.numel() + lse.numel()
    assert max(t.numel() for t in saved) < 512 * 512
    ptrs = sorted((t.data_ptr(), tuple(t.shape)) for t in saved)
    assert ptrs == sorted((t.data_ptr(), tuple(t.shape)) for t in (q, k, v, out, lse))


def _backward_args(ops, dtype=torch.float32):
    g = gen(717)
    q, k, v, dout = inputs((2, 3, 6, 4), (2, 3, 6, 4), g, dtype)
    out, lse = ops.flash_attention(q, k, v, None, "none", None, None)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


@pytest.mark.parametrize("arg, bad, error, message", [
    pytest.param("dout", lambda a: a["dout"][..., :-1, :], ValueError, r"dout must have the shape of q",
                 id="dout-short"),
    pytest.param("dout", lambda a: a["dout"].unsqueeze(0), ValueError, r"dout must have the shape of q",
                 id="dout-extra-dim"),
    pytest.param("dout", lambda a: a["dout"].to(torch.bfloat16), TypeError, r"dout must have the dtype of q",
                 id="dout-bf16"),
    pytest.param("dout", lambda a: a["dout"].double(), TypeError, r"dout must have the dtype of q", id="dout-f64"),
    pytest.param("out", lambda a: a["out"][..., :-1], ValueError, r"out must have the shape of q", id="out-short"),
    pytest.param("out", lambda a: a["out"].half(), TypeError, r"out must have the dtype of q", id="out-f16"),
    pytest.param("lse", lambda a: a["lse"][..., :-1], ValueError, r"lse must have shape", id="lse-short"),
    pytest.param("lse", lambda a: a["lse"][..., None], ValueError, r"lse must have shape", id="lse-extra-dim"),
    pytest.param("lse", lambda a: a["lse"].double(), TypeError, r"lse must be float32", id="lse-f64"),
    pytest.param("lse", lambda a: a["lse"].to(torch.bfloat16), TypeError, r"lse must be float32", id="lse-bf16"),
])
def test_backward_rejects_bad_arguments(ops, arg, bad, error, message):
    args = _backward_args(ops)
    args[arg] = bad(args)
    with pytest.raises(error, match=message):
        ops.flash_attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], None,
                                     "none", None, None)


def test_backward_rejects_low_precision_mismatch(ops):
    """For bf16 q, dout and out must be bf16 too (float32 is rejected, not silently reinterpreted); lse stays
    float32."""
    args = _backward_args(ops, torch.bfloat16)
    assert args["lse"].dtype == torch.float32 and args["out"].dtype == torch.bfloat16
    dq, dk, dv = ops.flash_attention_backward(*args.values(), None, "none", None, None)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dout must have the dtype of q"):
        ops.flash_attention_backward(args["dout"].float(), *list(args.values())[1:], None, "none", None, None)
    with pytest.raises(TypeError, match="out must have the dtype of q"):
        ops.flash_attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"].float(), args["lse"],
                                     None, "none", None, None)


# ---------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _eager_and_compiled(fn, *tensors):
    """(out, grads) of fn eagerly and under torch.compile(fullgraph=True), loss <out, w>."""
    results = []
    w = torch.randn(fn(*tensors).shape, generator=gen(718))
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = f(*leaves)
        (out * w).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    return results, w


def test_compile_attention(fresh_dynamo):
    """torch.compile(fullgraph=True) through cs149gpt.attention (fake impls, registered autograd): the same
    out and gradients as eager (the same kernels run), and correct."""
    g = gen(719)
    q, k, v, _ = inputs((2, 4, 11, 8), (2, 2, 14, 8), g)

    def fn(q, k, v):
        return cs149gpt.attention(q, k, v, is_causal="bottom_right", scale=0.3, block_q=3)

    (eager, compiled), w = _eager_and_compiled(fn, q, k, v)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    failures = grad_problems((eager[0], *eager[1]), ref_grads(q, k, v, w, scale=0.3, is_causal="bottom_right"),
                             (q, k, v), "eager", scale=0.3)
    assert not failures, "\n".join(failures)


def test_compile_sdpa_wrapper_takes_our_kernel(fresh_dynamo):
    """torch.compile(fullgraph=True) of cs149gpt.scaled_dot_product_attention on the supported path: the
    graph calls our operator (not torch's SDPA), and out/gradients equal eager."""
    g = gen(720)
    q, k, v, _ = inputs((2, 6, 10, 8), (2, 2, 10, 8), g)

    def fn(q, k, v):
        return cs149gpt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=capture)(q, k, v)
    assert len(graphs) == 1 and "cs149gpt.flash_attention" in graphs[0]
    assert "scaled_dot_product_attention" not in graphs[0]
    (eager, compiled), _ = _eager_and_compiled(fn, q, k, v)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# cs149gpt.scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------------------
def _sdpa_both(q, k, v, **kwargs):
    """(ours, torch's) out and gradients for loss <out, w>; float64 torch for the float32 comparison."""
    w = torch.randn(q.shape, generator=gen(721))
    results = []
    for f, cast in ((cs149gpt.scaled_dot_product_attention, lambda t: t),
                    (F.scaled_dot_product_attention, lambda t: t.double())):
        leaves = [cast(t).clone().requires_grad_() for t in (q, k, v)]
        out = f(*leaves, **kwargs)
        (out * cast(w)).sum().backward()
        results.append((out.detach(), *(t.grad for t in leaves)))
    return results


@pytest.mark.parametrize("q_shape, kv_shape, kwargs", [
    ((2, 3, 17, 8), (2, 3, 17, 8), {}),
    ((2, 3, 17, 8), (2, 3, 25, 8), dict(is_causal=True)),
    ((2, 3, 25, 8), (2, 3, 17, 8), dict(is_causal=True, scale=0.2)),
    ((4, 33, 16), (4, 33, 16), dict(is_causal=True)),
    ((2, 6, 15, 8), (2, 2, 21, 8), dict(enable_gqa=True)),
    ((2, 6, 21, 8), (2, 1, 15, 8), dict(enable_gqa=True, is_causal=True)),
    ((2, 4, 9, 8), (2, 4, 9, 8), dict(enable_gqa=True)),
])
def test_sdpa_supported_path(q_shape, kv_shape, kwargs):
    """Our kernel: bitwise cs149gpt.attention(impl="flash"), out and gradients; and torch's SDPA semantics
    (is_causal top-left with Nq != Nk, scale, enable_gqa), against torch in float64."""
    g = gen(722)
    q, k, v, _ = inputs(q_shape, kv_shape, g)
    assert cs149gpt.uses_our_kernel(q, k, v, enable_gqa=kwargs.get("enable_gqa", False))
    ours, theirs = _sdpa_both(q, k, v, **kwargs)
    w = torch.randn(q.shape, generator=gen(721))
    flash = our_grads(q, k, v, w, is_causal=kwargs.get("is_causal", False), scale=kwargs.get("scale"))
    for name, a, b, c in zip(NAMES, ours, flash, theirs):
        assert torch.equal(a, b), f"{name} differs from cs149gpt.attention(impl='flash')"
        err = (a.double() - c).abs().max().item()
        tol = grad_tol(q.shape[-1], kwargs.get("scale"))
        assert err <= tol, f"{name} differs from torch's SDPA by {err:.3g} > {tol:g}"


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_sdpa_low_precision_is_ours(dtype):
    g = gen(723)
    q, k, v, dout = inputs((2, 4, 19, 16), (2, 4, 19, 16), g, dtype)
    assert cs149gpt.uses_our_kernel(q, k, v)
    assert torch.equal(cs149gpt.scaled_dot_product_attention(q, k, v, is_causal=True),
                       cs149gpt.attention(q, k, v, is_causal=True))


def _fallback_cases():
    g = gen(724)
    q, k, v, _ = inputs((2, 4, 9, 8), (2, 4, 12, 8), g)
    bool_mask = torch.rand(9, 12, generator=g) > 0.3
    # (masks torch takes run ours: tests/test_masks.py)
    yield "float64 attn_mask", (q, k, v), dict(attn_mask=randn(2, 1, 9, 12, gen=g).double())
    # (dropout_p in (0, 1) runs ours: tests/test_dropout.py)
    yield "dropout_p = 1", (q, k, v), dict(dropout_p=1.0)
    yield "attn_mask with dropout_p = 1", (q, k, v), dict(attn_mask=bool_mask, dropout_p=1.0, is_causal=True)
    yield "v head dim differs", (q, k, randn(2, 4, 12, 5, gen=g)), dict(is_causal=True)
    yield "float64", (q.double(), k.double(), v.double()), dict(is_causal=True)
    yield "k/v batch broadcast", (q, k[:1], v[:1]), {}
    yield "Hq != Hkv without enable_gqa", (randn(2, 6, 9, 8, gen=g), k[:, :2], v[:, :2]), {}
    yield "Hq not a multiple of Hkv", (randn(2, 5, 9, 8, gen=g), k[:, :2], v[:, :2]), dict(enable_gqa=True)
    yield "mixed dtypes", (q, k.bfloat16(), v), {}
    yield "k, v head dim differs from q", (q, randn(2, 4, 12, 6, gen=g), randn(2, 4, 12, 6, gen=g)), {}


@pytest.mark.parametrize("name, tensors, kwargs", [pytest.param(*c, id=c[0]) for c in _fallback_cases()])
def test_sdpa_fallback_is_torch(name, tensors, kwargs):
    """Arguments our kernel does not take go to torch's SDPA: the same result bitwise (dropout under the same
    seed), or the same exception type and message."""
    uses = cs149gpt.uses_our_kernel(*tensors, attn_mask=kwargs.get("attn_mask"),
                                    dropout_p=kwargs.get("dropout_p", 0.0), enable_gqa=kwargs.get("enable_gqa", False))
    assert uses is False
    results = []
    for f in (cs149gpt.scaled_dot_product_attention, F.scaled_dot_product_attention):
        torch.manual_seed(1234)
        try:
            results.append(f(*tensors, **kwargs))
        except Exception as e:  # noqa: BLE001 - compared below
            results.append(e)
    ours, theirs = results
    if isinstance(theirs, Exception):
        assert type(ours) is type(theirs) and str(ours) == str(theirs), f"ours {ours!r}, torch {theirs!r}"
    else:
        assert isinstance(ours, torch.Tensor), f"ours raised {ours!r}, torch did not"
        assert torch.equal(ours, theirs)


def test_double_backward_is_refused():
    g = gen(726)
    q, k, v, _ = inputs((1, 1, 4, 3), (1, 1, 4, 3), g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dq, = torch.autograd.grad((cs149gpt.attention(q, k, v) ** 2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(dq.sum(), k, allow_unused=True)


@pytest.mark.parametrize("impl", ["naive", "blocked", "fused"])
def test_non_differentiable_impls_do_not_fake_gradients(impl):
    g = gen(727)
    q, k, v, _ = inputs((1, 2, 5, 4), (1, 2, 5, 4), g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = cs149gpt.attention(q, k, v, impl=impl)
    if out.requires_grad:  # then backward must refuse, not leave the gradients None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="not differentiable"):
                out.sum().backward()


def test_sdpa_is_causal_must_be_bool_like_torch():
    g = gen(728)
    q, k, v, _ = inputs((1, 1, 6, 4), (1, 1, 9, 4), g)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")
    with pytest.raises(TypeError):
        cs149gpt.scaled_dot_product_attention(q, k, v, is_causal="bottom_right")


def test_compile_fullgraph_as_the_first_call_in_a_fresh_process():
    """Inference code compiled before any eager call: loading the kernels must not happen inside the trace."""
    code = (
        "import torch, cs149gpt\n"
        "q = torch.randn(1, 2, 9, 8)\n"
        "f = torch.compile(lambda q: cs149gpt.attention(q, q, q, is_causal=True), fullgraph=True)\n"
        "with torch.no_grad():\n"
        "    out = f(q)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)\n"
        "print((out.double() - ref).abs().max().item())\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 1e-5
