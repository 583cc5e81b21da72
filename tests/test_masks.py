"""attn_mask in the flash kernel (forward and backward, every dtype and ISA) and in the SDPA drop-in, against a
float64 reference written from the definition: softmax(scale · q kᵀ + M) v, M = 0 / −inf for a bool mask
(True = the key takes part), the mask itself for an additive one, −inf past the causal mask when is_causal is set.

Covered: every broadcast shape of the mask ((Nq, Nk), (B, 1, 1, Nk), (B, 1, Nq, Nk), (1, Hq, Nq, Nk),
(B, Hq, Nq, Nk)), bool and additive (float32 and the input dtype), with and without is_causal (both alignments),
GQA, odd tiles (blocks fully hidden, fully visible and cut), one query row (decoding), non-contiguous masks read in
place, rows with no visible key (torch's answer: 0, zero gradient), −inf, +inf and NaN entries (torch's answer),
a NaN in the k or v of a hidden key (never read), the thread count, opcheck, torch.compile, and
cs149gpt.scaled_dot_product_attention against torch's SDPA (which path, which result).

Inputs come from fixed seeds. Loops collect every mismatch and report them all at once.
"""
import sys
import pytest
import torch
import torch.nn.functional as F

import cs149gpt
from tests._helpers import (backward_path, f32_products, gen, isa, randn, scaled_scores,  # noqa: F401  (fixtures:
                            visible_mask)  # isa, f32_products, backward_path)

NEG_INF = float("-inf")
# float32 out and gradients against float64 (test_flash.TOL, test_backward.GRAD_TOL).
TOL = 1e-4
GRAD_TOL = 2e-5
# Norm-relative error of bf16/fp16 gradients: two roundings to the dtype (test_backward.GRAD_REL_TOL).
GRAD_REL_TOL = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def mask_shapes(b, hq, n_q, n_k):
    return [(n_q, n_k), (b, 1, 1, n_k), (b, 1, n_q, n_k), (1, hq, n_q, n_k), (b, hq, n_q, n_k)]


def random_bool_mask(shape, g, *, p_keep=0.7, dead_rows=True):
    """True with probability p_keep; with dead_rows, every third query row (where there is one) hides all keys."""
    m = torch.rand(shape, generator=g) < p_keep
    if dead_rows and len(shape) >= 2 and shape[-2] > 1:
        m[..., ::3, :] = False
    return m


def random_run_mask(shape, g):
    """Each row shows one run of consecutive keys [lo, hi) at a random place (a padded batch's rows, with or without
    a causal pattern, are such runs): the kernels take these as key ranges (mask_ranges.cpp, key_ranges_of); every third
    row (where there is one) shows none, every fifth all."""
    n_k = shape[-1]
    lo = torch.randint(0, n_k, shape[:-1], generator=g)
    hi = torch.minimum(lo + torch.randint(1, n_k + 1, shape[:-1], generator=g), torch.tensor(n_k))
    keys = torch.arange(n_k)
    m = (keys >= lo[..., None]) & (keys < hi[..., None])
    if len(shape) >= 2 and shape[-2] > 1:
        m[..., ::3, :] = False
        m[..., 1::5, :] = True
    return m


def random_additive_mask(shape, g, dtype=torch.float32):
    """Finite offsets of a few units, −inf where a bool mask would hide the key."""
    hide = ~random_bool_mask(shape, g)
    return (2 * torch.randn(shape, generator=g)).masked_fill(hide, NEG_INF).to(dtype)


def random_run_additive_mask(shape, g, dtype=torch.float32):
    """random_run_mask as an additive mask of 0 and −inf (some zeros negative): it hides what the bool mask hides,
    and the kernels take it as the same key ranges."""
    m = random_run_mask(shape, g)
    zero = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
    return zero.masked_fill(~m, NEG_INF).to(dtype)


def random_biased_run_mask(shape, g, dtype=torch.float32):
    """random_run_mask's runs adding a bias (ALiBi's or T5's position bias under a causal or padding mask): the kernels
    take the runs beside the mask and read it inside them only (mask_ranges.cpp, key_ranges_of)."""
    m = random_run_mask(shape, g)
    return (2 * torch.randn(shape, generator=g)).masked_fill(~m, NEG_INF).to(dtype)


def bias_of(mask, scores_shape):
    """The mask as float64 offsets of the logits, broadcast to the scores."""
    if mask.dtype == torch.bool:
        return torch.zeros(scores_shape, dtype=torch.float64).masked_fill(~mask, NEG_INF)
    return mask.double().expand(scores_shape)


def ref_masked(q, k, v, mask, *, scale=None, is_causal=False):
    """(out, lse) in float64, differentiable in q, k, v: a row that sees no key gets out 0 (zero gradient) and
    lse −inf; a key hidden by the mask (offset −inf) or the causal mask drops out even when its logit is NaN."""
    s, v = scaled_scores(q, k, v, scale)
    bias = bias_of(mask, s.shape) if mask is not None else torch.zeros(s.shape, dtype=torch.float64)
    causal = visible_mask(q.shape[-2], k.shape[-2], is_causal)
    if causal is not None:
        bias = bias.masked_fill(~causal, NEG_INF)
    hidden = bias == NEG_INF
    seen = (~hidden).any(-1, keepdim=True)
    s = torch.where(hidden, NEG_INF, s + bias)
    s = torch.where(seen, s, 0.0)  # a row that sees nothing: a finite softmax, zeroed below
    lse = torch.where(seen[..., 0], torch.logsumexp(s, dim=-1), NEG_INF)
    return (torch.softmax(s, dim=-1) @ v) * seen, lse


def inputs(q_shape, kv_shape, g, dtype=torch.float32):
    return tuple(randn(*s, gen=g).to(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))


def out_problems(out, lse, q, k, v, mask, *, is_causal=False, scale=None, tag=""):
    want, want_lse = ref_masked(q.double(), k.double(), v.double(), mask, scale=scale, is_causal=is_causal)
    found = []
    if out.shape != q.shape or out.dtype != q.dtype:
        return [f"{tag}: out shape {tuple(out.shape)} dtype {out.dtype}"]
    o = out.double()
    dead = torch.isneginf(want_lse)
    if not torch.equal(torch.isneginf(lse), dead):
        found.append(f"{tag}: lse is -inf in {int(torch.isneginf(lse).sum())} rows, expected {int(dead.sum())}")
    if dead.any() and not (o[dead] == 0).all():
        found.append(f"{tag}: rows that see no key are not 0")
    err = (o - want).abs().max().item()
    if q.dtype == torch.float32:
        bar = TOL
    else:  # our error against torch's own SDPA in that dtype (the bf16 dot path rounds P as torch does)
        gqa = k.shape[-3] != q.shape[-3]
        torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=_with_causal(mask, q, k, is_causal),
                                                   scale=scale, enable_gqa=gqa).double()
        torch_err = (torch_out - want).abs().max().item()
        bar = max(1.5 * torch_err, UNIT_ROUNDOFF[q.dtype] * want.abs().max().item()) + 1e-5
    if not err <= bar:
        found.append(f"{tag}: max abs error {err:.3g} > {bar:.3g}")
    live = ~dead
    if live.any():
        lse_err = (lse.double() - want_lse)[live].abs().max().item()
        if not lse_err <= 1e-4 * max(1.0, want_lse[live].abs().max().item()):
            found.append(f"{tag}: lse error {lse_err:.3g}")
    return found


def _with_causal(mask, q, k, is_causal):
    """mask with the causal mask folded in (bool masks AND, additive −inf), for torch's SDPA."""
    causal = visible_mask(q.shape[-2], k.shape[-2], is_causal)
    if causal is None:
        return mask
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, NEG_INF)


SHAPES = [  # (B, Hq, Hkv, Nq, Nk, d)
    (2, 4, 2, 37, 53, 24),
    (1, 2, 2, 70, 45, 16),
]
TILES = [(None, None), (17, 24), (1, 3)]


def make_mask(kind, shape, g, dtype=torch.float32):
    if kind == "bool":
        return random_bool_mask(shape, g)
    if kind == "runs":
        return random_run_mask(shape, g)
    if kind == "additive runs":
        return random_run_additive_mask(shape, g, dtype)
    if kind == "biased runs":
        return random_biased_run_mask(shape, g, dtype)
    return random_additive_mask(shape, g, dtype)


@pytest.mark.parametrize("kind", ["bool", "runs", "additive", "additive runs", "biased runs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_every_mask_shape(isa, f32_products, dtype, kind):
    """out and lse for every broadcast shape of the mask, with each causal mode and tile size."""
    g = gen(1100)
    failures = []
    for b, hq, hkv, n_q, n_k, d in SHAPES if dtype == torch.float32 else SHAPES[:1]:
        q, k, v, _ = inputs((b, hq, n_q, d), (b, hkv, n_k, d), g, dtype)
        for shape in mask_shapes(b, hq, n_q, n_k):
            mask = make_mask(kind, shape, g, torch.float32 if shape[-1] % 2 else dtype)
            for is_causal in (False, True, "bottom_right"):
                for block_q, block_k in TILES if is_causal is False else TILES[:2]:
                    out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=is_causal, block_q=block_q,
                                                  block_k=block_k, return_lse=True)
                    failures += out_problems(out, lse, q, k, v, mask, is_causal=is_causal,
                                             tag=f"{isa} {kind} mask {shape} {mask.dtype} causal={is_causal} "
                                                 f"tiles=({block_q}, {block_k}) q {tuple(q.shape)}")
    assert not failures, "\n".join(failures[:20])


def test_masks_of_one_run_per_row_become_key_ranges():
    """A mask whose every row shows one run of keys and hides the rest — boolean, or additive of only 0 and −inf in
    float32, bfloat16 or float16 — reaches the kernels as (first, end) per distinct row (the broadcast dims kept at
    1), computed here from the definition; with a bias inside the runs (a value, NaN, +inf) the same runs come beside
    the mask where each of its rows serves 4 (batch, head) pairs or more; a row of two runs, a bias over every key, or
    strided keys leave the mask as it is."""
    from cs149gpt import _ext

    g = gen(1112)
    q = torch.zeros(2, 4, 9, 8)
    key_ranges_of = _ext.load()._testing.key_ranges_of
    for shape in mask_shapes(2, 4, 9, 13):
        mask = random_run_mask(shape, g)
        m4 = mask.expand(2, 4, 9, 13)
        kept = [slice(None) if m4.stride(d) != 0 else slice(0, 1) for d in range(3)]
        rows = m4[kept[0], kept[1], kept[2]]
        keys = torch.arange(13)
        shown = rows.any(-1)
        first = torch.where(shown, torch.where(rows, keys, 13).min(-1).values, 0)
        end = torch.where(shown, torch.where(rows, keys + 1, 0).max(-1).values, 0)
        want = torch.stack((first, end), -1)
        zero = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
        for form in (mask, *(zero.masked_fill(~mask, NEG_INF).to(dt) for dt in (torch.float32, torch.bfloat16,
                                                                                 torch.float16))):
            ranges, plain = key_ranges_of(form, q, 13)
            assert plain and torch.equal(ranges, want), (shape, form.dtype)
            # a bias inside the runs: the same runs, beside the mask (which the kernels then read inside them only),
            # where each mask row serves 4 (batch, head) pairs or more; else the kernels read the mask alone
            if form.dtype != torch.bool:
                biased = torch.where(torch.isinf(form), form, form + torch.rand(shape, generator=g).to(form.dtype) + 0.5)
                found = key_ranges_of(biased, q, 13)
                if 2 * 4 >= 4 * rows.shape[0] * rows.shape[1]:
                    assert found is not None and not found[1] and torch.equal(found[0], want), (shape, form.dtype)
                else:
                    assert found is None, (shape, form.dtype)
    two_runs = torch.ones(2, 1, 9, 13, dtype=torch.bool)
    two_runs[1, 0, 4, 5] = False
    assert key_ranges_of(two_runs, q, 13) is None
    assert key_ranges_of(two_runs[:, :, :, ::2], q, 7) is None  # keys strided: read in place
    one_run = torch.zeros(2, 1, 9, 13)
    one_run[..., 10:] = NEG_INF
    assert key_ranges_of(one_run, q, 13)[1]
    for other in (0.5, float("nan"), float("inf"), -1e30):  # a bias (NaN and +inf too), not a hidden key
        biased = one_run.clone()
        biased[0, 0, 3, 2] = other
        for form in (biased, biased.bfloat16()):
            ranges, plain = key_ranges_of(form, q, 13)
            assert not plain and torch.equal(ranges[0, 0, 3], torch.tensor([0, 10])), other
        biased[0, 0, 3, 11] = other  # past the run: two runs
        assert key_ranges_of(biased, q, 13) is None, other
    # A bias over every key (T5's encoder): its runs would skip nothing, so the mask is left to the kernels unscanned.
    assert key_ranges_of(torch.randn(2, 1, 9, 13), q, 13) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_rows_with_a_padding_mask(isa, dtype):
    """A few query rows against a long cache with a key-padding mask (B, 1, 1, Nk) or (B, 1, Nq, Nk), as
    generation with a padded batch passes: the decode kernel takes them (test_mask_decode.py tests it further)."""
    g = gen(1101)
    failures = []
    for n_q in (1, 3):
        q, k, v, _ = inputs((3, 4, n_q, 32), (3, 2, 700, 32), g, dtype)
        pad = torch.zeros(3, 1, 1, 700, dtype=torch.bool)
        for i, first in enumerate((0, 130, 699)):  # left padding: keys before `first` are padding
            pad[i, ..., first:] = True
        for mask in (pad, pad.expand(3, 1, n_q, 700), torch.zeros(pad.shape).masked_fill(~pad, NEG_INF)):
            out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, return_lse=True)
            failures += out_problems(out, lse, q, k, v, mask, tag=f"{isa} n_q={n_q} mask {tuple(mask.shape)}")
    assert not failures, "\n".join(failures)


def test_non_contiguous_masks_are_read_in_place():
    """Masks that are transposed, sliced with a step, or expanded views: read through their strides."""
    g = gen(1102)
    q, k, v, _ = inputs((2, 3, 40, 16), (2, 3, 50, 16), g)
    base = random_bool_mask((2, 3, 50, 80), g)
    masks = {
        "transposed": random_bool_mask((2, 3, 50, 40), g).transpose(-1, -2),       # (2, 3, 40, 50)
        "step": random_bool_mask((2, 3, 40, 100), g)[..., ::2],                   # last-dim stride 2
        "expanded": random_bool_mask((2, 1, 1, 50), g).expand(2, 3, 40, 50),      # stride 0 on heads and rows
        "additive transposed": random_additive_mask((50, 40), g).t(),             # (40, 50), column-major
    }
    failures = []
    for name, mask in masks.items():
        assert not mask.is_contiguous(), name
        out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, return_lse=True)
        failures += out_problems(out, lse, q, k, v, mask, tag=name)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_are_torchs(isa, f32_products, dtype):
    """Rows whose mask hides every key (bool False, or additive −inf): out 0, lse −inf, zero gradient — torch
    SDPA's answer on the CPU; equal to torch's output."""
    g = gen(1103)
    q, k, v, dout = inputs((2, 2, 30, 16), (2, 2, 40, 16), g, dtype)
    bool_mask = random_bool_mask((2, 1, 30, 40), g)
    bool_mask[1, :, 5:9] = False
    for mask in (bool_mask, torch.zeros(bool_mask.shape, dtype=dtype).masked_fill(~bool_mask, NEG_INF)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = cs149gpt.attention(*leaves, attn_mask=mask, return_lse=True)
        out.backward(dout)
        dead = ~bool_mask.expand(2, 2, 30, 40).any(-1)
        assert (out.detach()[dead] == 0).all() and torch.isneginf(lse[dead]).all()
        assert (leaves[0].grad[dead] == 0).all()
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (out.detach().double() - want.double()).abs().max().item() <= tol


def test_non_finite_mask_entries_follow_torch():
    """An additive mask's NaN or +inf at a visible key turns the row NaN (as torch's SDPA); at a key the causal
    mask hides it has no effect; −inf hides the key."""
    g = gen(1104)
    q, k, v, _ = inputs((1, 2, 6, 8), (1, 2, 6, 8), g)
    for bad in (float("nan"), float("inf")):
        mask = torch.zeros(6, 6)
        mask[2, 4] = bad  # row 2 sees key 4 without causal; causal hides it
        ours = cs149gpt.attention(q, k, v, attn_mask=mask)
        torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.isnan(ours[..., 2, :]).all() and torch.isnan(torch_out[..., 2, :]).all()
        others = [0, 1, 3, 4, 5]
        assert torch.allclose(ours[..., others, :], torch_out[..., others, :], atol=1e-6)
        causal = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=True)
        want, _ = ref_masked(q.double(), k.double(), v.double(), torch.zeros(6, 6), is_causal=True)
        assert (causal.double() - want).abs().max().item() <= TOL


@pytest.mark.parametrize("block_k", [None, 1, 4, 5])
def test_hidden_keys_are_never_read(isa, f32_products, block_k):
    """NaN in the k and v of keys the mask hides (a padded batch's padding) leaves every row finite and
    correct, whether the hidden key sits in a block the mask hides whole or in one it cuts. (Gradients:
    test_hidden_keys_never_reach_the_gradients.)"""
    g = gen(1105)
    q, k, v, dout = inputs((2, 2, 9, 8), (2, 2, 12, 8), g)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., :5] = False   # left padding of 5
    mask[1, ..., 10:] = False  # right padding of 2
    k_bad, v_bad = k.clone(), v.clone()
    hidden = ~mask[:, 0, 0]  # (B, Nk)
    k_bad[hidden[:, None, :].expand(2, 2, 12)] = float("nan")
    v_bad[hidden[:, None, :].expand(2, 2, 12)] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = q.to(dtype), k_bad.to(dtype), v_bad.to(dtype)
        out, lse = cs149gpt.attention(qd, kd, vd, attn_mask=mask, block_k=block_k, return_lse=True)
        assert torch.isfinite(out).all(), (dtype, block_k)
        assert not out_problems(out, lse, qd, k.to(dtype), v.to(dtype), mask, tag="nan in hidden keys")


@pytest.mark.parametrize("kind", ["padding", "bool", "strip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_keys_never_reach_the_gradients(isa, backward_path, dtype, kind):
    """NaN in the k and v of keys the mask hides: dq and dv stay finite and equal float64 autograd's with those keys
    left out (dk's hidden rows are 0 · NaN there). A padding mask is one run of keys a row (the kernels take it as
    key ranges); "bool" hides a scattered key as well (a mask the kernels read, in blocks it cuts); "strip" hides keys
    32-63 from every row, NaN in their v only, in 96-key tiles (the bf16 kernel's 32-key strips: one hidden whole
    in a tile whose K is finite, whose dS must still be 0 in dq's product)."""
    g = gen(1124)
    n_k = 96 if kind == "strip" else 45
    q, k, v, dout = (t.to(dtype) for t in inputs((2, 2, 40, 16), (2, 2, n_k, 16), g))
    mask = torch.ones(2, 1, 1, n_k, dtype=torch.bool)
    mask[0, ..., :7] = False   # left padding
    mask[1, ..., 31:] = False  # right padding
    if kind == "bool":
        mask[:, ..., 20] = False
    if kind == "strip":
        mask = torch.ones(2, 1, 1, n_k, dtype=torch.bool)
        mask[..., 32:64] = False
    hidden = (~mask[:, 0, 0])[:, None, :, None].expand(2, 2, n_k, 16)
    k_bad = k if kind == "strip" else k.masked_fill(hidden, float("nan"))
    v_bad = v.masked_fill(hidden, float("nan"))
    leaves = [t.clone().requires_grad_() for t in (q, k_bad, v_bad)]
    cs149gpt.attention(*leaves, attn_mask=mask, block_q=16, block_k=96 if kind == "strip" else 16).backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_masked(*ref_leaves, mask)[0].backward(dout.double())
    tol = GRAD_TOL if dtype == torch.float32 else 0.05
    for name, a, b in (("dq", leaves[0], ref_leaves[0]), ("dv", leaves[2], ref_leaves[2])):
        assert torch.isfinite(a.grad).all(), (name, kind)
        assert (a.grad.double() - b.grad).abs().max().item() <= tol, (name, kind)


GRAD_SHAPES = [  # (B, Hq, Hkv, Nq, Nk, d)
    (2, 4, 2, 29, 41, 16),
    (1, 3, 1, 50, 27, 8),
]


def grad_problems(q, k, v, dout, mask, *, tag, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = cs149gpt.attention(*leaves, attn_mask=mask, **kwargs)
    out.backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_kwargs = {key: val for key, val in kwargs.items() if key in ("scale", "is_causal")}
    want, _ = ref_masked(*ref_leaves, mask, **ref_kwargs)
    want.backward(dout.double())
    found = []
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in leaves)),
                              (want.detach(), *(t.grad for t in ref_leaves))):
        g = got.double()
        if not torch.isfinite(g).all():
            found.append(f"{tag} {name}: non-finite")
        elif q.dtype == torch.float32:
            err = (g - ref).abs().max().item()
            if not err <= (TOL if name == "out" else GRAD_TOL):
                found.append(f"{tag} {name}: max abs error {err:.3g}")
        elif name != "out":
            rel = ((g - ref).norm() / ref.norm()).item() if ref.norm() > 0 else g.abs().max().item()
            if not rel <= GRAD_REL_TOL[q.dtype]:
                found.append(f"{tag} {name}: norm-relative error {rel:.3g} > {GRAD_REL_TOL[q.dtype]:.3g}")
    return found


@pytest.mark.parametrize("kind", ["bool", "runs", "additive", "additive runs", "biased runs"])
def test_gradients_every_mask_shape(isa, kind, backward_path):
    """dq, dk, dv (GQA: summed per group) against float64 autograd, for every broadcast shape of the mask, each
    causal mode and odd tiles; the mask gets no gradient. Runs (one run of keys a row) reach the kernels as key
    ranges; the others are read a tile at a time."""
    g = gen(1106)
    failures = []
    for b, hq, hkv, n_q, n_k, d in GRAD_SHAPES:
        q, k, v, dout = inputs((b, hq, n_q, d), (b, hkv, n_k, d), g)
        for shape in mask_shapes(b, hq, n_q, n_k):
            mask = make_mask(kind, shape, g)
            for is_causal in (False, True, "bottom_right"):
                for block_q, block_k in ((None, None), (7, 5)) if is_causal is False else ((None, None),):
                    failures += grad_problems(q, k, v, dout, mask, is_causal=is_causal, block_q=block_q,
                                              block_k=block_k, tag=f"{isa} {kind} {shape} causal={is_causal} "
                                                                   f"tiles=({block_q}, {block_k}) q {(b, hq, n_q, d)}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_alibi_bias_shared_by_the_batch(isa, f32_products, dtype):
    """A causal ALiBi bias (1, H, N, N) shared by a batch of 4, and the same with left padding per batch element
    (B, 1, N, N) shared by the heads: each row one run of keys adding a bias, which the kernels take as key ranges
    beside the mask, over several key tiles and the default ones (mask_ranges.cpp key_ranges_of, bias_pays). out and lse
    against float64, and the gradients."""
    from cs149gpt import _ext

    g = gen(1131)
    b, h, n, d = 4, 4, 160, 16
    q, k, v, dout = inputs((b, h, n, d), (b, h, n, d), g, dtype)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).float()
    alibi = (slopes[:, None, None] * distance[None]).masked_fill(distance[None] > 0, NEG_INF)[None]
    pad = torch.tensor([0, 17, 90, 159])[:, None, None, None]  # left padding of each batch element
    # the bias in the last rows only: the blocks above them add nothing inside the runs, yet their rows' runs differ
    bias = 0.01 * distance.abs() * (torch.arange(n)[:, None] >= 130)
    padded = bias.expand(b, 1, n, n).masked_fill((torch.arange(n) < pad) | (distance > 0), NEG_INF)
    for mask in (alibi, padded.to(dtype)):
        ranges = _ext.load()._testing.key_ranges_of(mask, q, n)
        assert ranges is not None and not ranges[1]  # runs beside the mask
        failures = []
        for block_q, block_k in ((None, None), (32, 48)):
            out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, block_q=block_q, block_k=block_k, return_lse=True)
            failures += out_problems(out, lse, q, k, v, mask, tag=f"{isa} {tuple(mask.shape)} ({block_q}, {block_k})")
        if dtype == torch.float32:
            failures += grad_problems(q, k, v, dout, mask, tag=f"{isa} {tuple(mask.shape)} backward")
        assert not failures, "\n".join(failures[:10])


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known: the backward recomputes P from a float32 lse that loses log N beside "
                                       "an offset of 1e8 or more (README, Limitations); torch's CPU flash does too")
def test_uniform_huge_offset_row_gradients():
    """A row whose visible keys all carry the offset −1e30: the forward averages them (weights 1/N, as float64 does),
    and the gradient of v through that row must be 1/N per key, not 1 (found by tests/test_fuzz.py)."""
    g = gen(1132)
    n, d = 8, 4
    q, k, v = (randn(1, 1, n, d, gen=g).requires_grad_() for _ in range(3))
    mask = torch.zeros(n, n)
    mask[-1, :] = -1e30
    out = cs149gpt.attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out[0, 0, -1], v[0, 0].mean(0), atol=1e-6)
    dout = torch.zeros(1, 1, n, d)
    dout[0, 0, -1] = 1.0
    (dv,) = torch.autograd.grad(out, v, dout)
    assert torch.allclose(dv[0, 0], torch.full((n, d), 1.0 / n), atol=1e-5), dv[0, 0, :, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_finite_mask_offsets_keep_gradients_finite(isa, backward_path, dtype):
    """An additive mask of finfo(dtype).min, as eager-style code builds it, on rows that see ordinary keys too and on
    rows where it is every key's offset (torch averages those rows' values): out and the gradients are finite, and
    equal float64 autograd's where a row sees an ordinary key — given a dout that is 0 on the rows the mask covers
    whole, as a model's loss leaves padding. (Base-2 exponents of lse ≈ −3.4e38 overflow; the bf16 one-pass
    backward sums them in natural units first.)"""
    g = gen(1125)
    q, k, v, dout = inputs((2, 2, 30, 16), (2, 2, 30, 16), g, dtype)
    keep = torch.rand(2, 1, 30, 30, generator=g) < 0.6
    keep[..., 5:, 0] = True   # every row from 5 on sees key 0
    keep[..., :5, :] = False  # rows 0-4 see none: every offset finfo.min
    mask = torch.zeros(2, 1, 30, 30, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    dout[..., :5, :] = 0
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cs149gpt.attention(*leaves, attn_mask=mask)
    out.backward(dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want, _ = ref_masked(*ref_leaves, mask)
    want.backward(dout.double())
    assert torch.isfinite(out).all()
    seen = (slice(None), slice(None), slice(5, None))
    err = (out[seen].double() - want[seen]).abs().max().item()
    assert err <= (TOL if dtype == torch.float32 else 0.03), err
    for name, a, b in zip("qkv", leaves, ref_leaves):
        assert torch.isfinite(a.grad).all(), name
        if dtype == torch.float32:
            assert (a.grad.double() - b.grad).abs().max().item() <= GRAD_TOL, name
        else:
            rel = ((a.grad.double() - b.grad).norm() / b.grad.norm()).item()
            assert rel <= GRAD_REL_TOL[dtype], (name, rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_gradients(isa, dtype, backward_path):
    g = gen(1107)
    q, k, v, dout = inputs((2, 4, 45, 32), (2, 2, 60, 32), g, dtype)
    failures = []
    for mask in (random_bool_mask((2, 1, 45, 60), g), random_additive_mask((2, 4, 45, 60), g, dtype),
                 random_run_mask((2, 1, 45, 60), g), random_run_additive_mask((2, 4, 45, 60), g, dtype)):
        failures += grad_problems(q, k, v, dout, mask, tag=f"{isa} {dtype} {mask.dtype}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("mask_kind", ["bool", "runs"])
@pytest.mark.parametrize("mask_shape", [(2, 1, 130, 150), (1, 4, 130, 150)], ids=["per_batch", "batch_shared"])
def test_results_do_not_depend_on_thread_count(restore_threads, mask_shape, mask_kind, backward_path):
    """Bitwise the same out and gradients on 1, 2, 3 threads; a mask shared by the batch (stride 0 over b) makes the
    forward's tasks take the batch innermost (flash_common.h, run_forward_tiles); runs are key ranges."""
    g = gen(1108)
    q, k, v, dout = inputs((2, 4, 130, 32), (2, 2, 150, 32), g)
    mask = (random_bool_mask if mask_kind == "bool" else random_run_mask)(mask_shape, g)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cs149gpt.attention(*leaves, attn_mask=mask)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_mask_that_requires_grad_is_refused_by_attention():
    g = gen(1109)
    q, k, v, _ = inputs((1, 2, 5, 8), (1, 2, 5, 8), g)
    mask = torch.zeros(5, 5, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        cs149gpt.attention(q, k, v, attn_mask=mask)
    with torch.no_grad():
        cs149gpt.attention(q, k, v, attn_mask=mask)  # no gradient wanted: fine
    cs149gpt.attention(q, k, v, attn_mask=mask.detach())


def test_opcheck_with_masks():
    cs149gpt.ops._load()
    g = gen(1110)
    q, k, v, dout = inputs((2, 4, 9, 8), (2, 2, 11, 8), g)
    for mask in (random_bool_mask((2, 1, 1, 11), g),):
        torch.library.opcheck(torch.ops.cs149gpt.flash_attention,
                              (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, "none", None, None,
                               mask))
        out, lse = torch.ops.cs149gpt.flash_attention(q.detach(), k.detach(), v.detach(), None, "none", None, None,
                                                      mask)
        torch.library.opcheck(torch.ops.cs149gpt.flash_attention_backward,
                              (dout, q.detach(), k.detach(), v.detach(), out, lse, None, "none", None, None, mask))
        q, k, v = q.detach(), k.detach(), v.detach()
    # the sliding window, with a mask
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, "none", None, None, mask, 3, 1)
    torch.library.opcheck(torch.ops.cs149gpt.flash_attention, args)


def test_compile_with_a_mask():
    """torch.compile(fullgraph=True) of attention with a mask: out and gradients equal eager's."""
    torch._dynamo.reset()
    g = gen(1111)
    q, k, v, dout = inputs((2, 4, 33, 16), (2, 4, 33, 16), g)
    mask = random_bool_mask((2, 1, 33, 33), g)

    def f(q, k, v, mask):
        return cs149gpt.attention(q, k, v, attn_mask=mask)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, mask)
        out.backward(dout)
        results.append([out.detach(), *(t.grad for t in leaves)])
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------------------------------------------------
# cs149gpt.scaled_dot_product_attention with masks: ours where it computes what torch does, torch's otherwise.
# ---------------------------------------------------------------------------------------------------------
def _sdpa_cases(g):
    q, k, v, _ = inputs((2, 4, 20, 16), (2, 4, 25, 16), g)
    qg, kg, vg, _ = inputs((2, 8, 20, 16), (2, 2, 25, 16), g)
    bool_mask = random_bool_mask((2, 1, 20, 25), g)
    yield "bool (B,1,Nq,Nk)", (q, k, v), dict(attn_mask=bool_mask)
    yield "bool (Nq,Nk)", (q, k, v), dict(attn_mask=bool_mask[0, 0])
    yield "padding (B,1,1,Nk)", (q, k, v), dict(attn_mask=random_bool_mask((2, 1, 1, 25), g, dead_rows=False))
    yield "additive float32", (q, k, v), dict(attn_mask=random_additive_mask((2, 4, 20, 25), g))
    yield "gqa + mask", (qg, kg, vg), dict(attn_mask=bool_mask, enable_gqa=True)
    yield "mask + is_causal", (q, k, v), dict(attn_mask=bool_mask, is_causal=True)
    yield "bf16 + float32 mask", tuple(t.bfloat16() for t in (q, k, v)), dict(
        attn_mask=random_additive_mask((2, 1, 20, 25), g))
    yield "bf16 + bf16 mask", tuple(t.bfloat16() for t in (q, k, v)), dict(
        attn_mask=random_additive_mask((2, 1, 20, 25), g, torch.bfloat16))


@pytest.mark.parametrize("case", list(range(8)))
def test_sdpa_with_masks_is_ours_and_torchs(case):
    name, (q, k, v), kwargs = list(_sdpa_cases(gen(1112)))[case]
    assert cs149gpt.uses_our_kernel(q, k, v, **kwargs), name
    ours = cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs)
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    assert (ours.double() - want.double()).abs().max().item() <= tol, name


def test_sdpa_masks_we_leave_to_torch():
    """What our kernel does not compute goes to torch: a mask that requires grad, a mask of another float dtype
    (torch's error), an unbroadcastable one (torch's error), dropout_p = 1."""
    g = gen(1113)
    q, k, v, _ = inputs((1, 2, 6, 8), (1, 2, 7, 8), g)
    learned = torch.zeros(6, 7, requires_grad=True)
    assert not cs149gpt.uses_our_kernel(q, k, v, attn_mask=learned)
    out = cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=learned)
    out.sum().backward()
    assert learned.grad is not None  # torch's SDPA computed the mask's gradient
    with torch.no_grad():
        assert cs149gpt.uses_our_kernel(q, k, v, attn_mask=learned)
    for bad in (torch.zeros(6, 7, dtype=torch.float64), torch.ones(6, 7, dtype=torch.int64), torch.zeros(5, 7)):
        assert not cs149gpt.uses_our_kernel(q, k, v, attn_mask=bad)
        with pytest.raises(RuntimeError) as theirs:
            F.scaled_dot_product_attention(q, k, v, attn_mask=bad)
        with pytest.raises(RuntimeError) as ours:
            cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=bad)
        assert str(ours.value) == str(theirs.value)
    assert not cs149gpt.uses_our_kernel(q, k, v, attn_mask=torch.zeros(6, 7), dropout_p=1.0)


def test_sdpa_mask_gradients_match_torch():
    g = gen(1114)
    q, k, v, dout = inputs((2, 4, 20, 16), (2, 2, 25, 16), g)
    mask = random_bool_mask((2, 1, 20, 25), g)
    grads = []
    for fn in (cs149gpt.scaled_dot_product_attention, F.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves, attn_mask=mask, enable_gqa=True).backward(dout)
        grads.append([t.grad for t in leaves])
    for ours, theirs in zip(*grads):
        assert (ours - theirs).abs().max().item() <= 1e-5


def test_sdpa_installed_restores_torchs():
    original = F.scaled_dot_product_attention
    with cs149gpt.sdpa_installed():
        assert F.scaled_dot_product_attention is cs149gpt.scaled_dot_product_attention
        g = gen(1115)
        q, k, v, _ = inputs((1, 2, 6, 8), (1, 2, 7, 8), g)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(6, 7))
    assert F.scaled_dot_product_attention is original
    with pytest.raises(KeyError):
        with cs149gpt.sdpa_installed():
            raise KeyError("inside")
    assert F.scaled_dot_product_attention is original
    cs149gpt.install_sdpa()
    try:
        assert F.scaled_dot_product_attention is cs149gpt.scaled_dot_product_attention
    finally:
        cs149gpt.restore_sdpa()
    assert F.scaled_dot_product_attention is original


# ---------------------------------------------------------------------------------------------------------
# Sliding window (FlashAttention's window_size): a band of keys around each query's aligned position.
# ---------------------------------------------------------------------------------------------------------
def window_mask(n_q, n_k, left, right):
    """Bool (Nq, Nk): i + Nk − Nq − left <= j <= i + Nk − Nq + right (−1: that side unbounded)."""
    i = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


WINDOWS = [(0, 0), (3, 0), (16, 5), (-1, 2), (7, -1), (40, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_forward(isa, f32_products, dtype):
    """out and lse with a window alone, with is_causal, and with an attn_mask, Nq = Nk and Nq != Nk, odd tiles."""
    g = gen(1120)
    failures = []
    for (n_q, n_k) in ((64, 64), (30, 75), (75, 30)):
        q, k, v, _ = inputs((2, 4, n_q, 16), (2, 2, n_k, 16), g, dtype)
        pad = random_bool_mask((2, 1, 1, n_k), g, p_keep=0.8, dead_rows=False)
        for left, right in WINDOWS:
            band = window_mask(n_q, n_k, left, right)
            for is_causal, mask in ((False, None), (True, None), ("bottom_right", None), (False, pad)):
                want_mask = band if mask is None else band & mask
                for block_q, block_k in ((None, None), (7, 5)):
                    out, lse = cs149gpt.attention(q, k, v, window=(left, right), is_causal=is_causal,
                                                  attn_mask=mask, block_q=block_q, block_k=block_k,
                                                  return_lse=True)
                    failures += out_problems(out, lse, q, k, v, want_mask, is_causal=is_causal,
                                             tag=f"{isa} window=({left}, {right}) causal={is_causal} "
                                                 f"mask={mask is not None} ({n_q}, {n_k}) tiles=({block_q}, {block_k})")
    assert not failures, "\n".join(failures[:20])


def test_window_gradients(isa, backward_path):
    g = gen(1121)
    failures = []
    for (n_q, n_k) in ((50, 50), (33, 61)):
        q, k, v, dout = inputs((2, 4, n_q, 16), (2, 2, n_k, 16), g)
        for left, right in WINDOWS[:4]:
            band = window_mask(n_q, n_k, left, right)
            for is_causal in (False, True):
                for block_q, block_k in ((None, None), (7, 5)):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    cs149gpt.attention(*leaves, window=(left, right), is_causal=is_causal, block_q=block_q,
                                       block_k=block_k).backward(dout)
                    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
                    ref_masked(*ref_leaves, band, is_causal=is_causal)[0].backward(dout.double())
                    for name, a, b in zip("qkv", leaves, ref_leaves):
                        err = (a.grad.double() - b.grad).abs().max().item()
                        if not err <= GRAD_TOL:
                            failures.append(f"{isa} d{name} window=({left}, {right}) causal={is_causal} "
                                            f"({n_q}, {n_k}) tiles=({block_q}, {block_k}): {err:.3g}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("n_q,n_k", [(4, 6), (6, 3), (40, 70), (70, 40)])
def test_window_bounds_past_every_key(isa, n_q, n_k):
    """A bound that reaches past every key hides none, up to sys.maxsize ("no bound", as some callers write it):
    the band's ends, i + (Nk - Nq) ± bound, must not overflow int64. Forward and gradients equal those of -1 on that
    side; the decode kernel (Nq <= 16) and the tiled ones."""
    g = gen(1123)
    q, k, v, dout = inputs((1, 2, n_q, 8), (1, 2, n_k, 8), g)
    failures = []
    for other in (-1, 3):
        for big in (n_q + n_k, n_q + n_k + 1, 2**62, sys.maxsize - n_q, sys.maxsize):
            for window, same in (((other, big), (other, -1)), ((big, other), (-1, other))):
                grads = []
                for w in (window, same):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = cs149gpt.attention(*leaves, window=w)
                    out.backward(dout)
                    grads.append([out.detach()] + [t.grad for t in leaves])
                # Past q_len + kv_len the bound is -1 itself (the same call, the same bits); at it, the band path
                # must still show every key.
                tol = 1e-5 if big == n_q + n_k else 0.0
                for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
                    err = (a - b).abs().max().item()
                    if not err <= tol:
                        failures.append(f"{isa} ({n_q}, {n_k}) window={window} against {same}: {name} off by {err:.3g}")
    assert not failures, "\n".join(failures[:20])


def test_window_checks():
    g = gen(1122)
    q, k, v, _ = inputs((1, 2, 5, 8), (1, 2, 5, 8), g)
    with pytest.raises(ValueError, match=r"window must be \(left, right\) with each >= 0, or -1"):
        cs149gpt.attention(q, k, v, window=(-2, 0))
    with pytest.raises(TypeError, match="window must be a pair of ints"):
        cs149gpt.attention(q, k, v, window=3)
    with pytest.raises(ValueError, match="window needs impl='flash'"):
        cs149gpt.attention(q, k, v, impl="naive", window=(1, 1))
    with pytest.raises(ValueError, match="window must be"):
        torch.ops.cs149gpt.flash_attention(q, k, v, window_left=-5)
    with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1; got \(-1, 9223372036854775808\)"):
        cs149gpt.attention(q, k, v, window=(-1, 2**63))
    assert torch.equal(cs149gpt.attention(q, k, v, window=(-1, -1)), cs149gpt.attention(q, k, v))


def test_dropin_computes_what_torch_refuses():
    """Calls torch 2.13's SDPA refuses or turns NaN although they have one meaning: the drop-in runs our kernel and
    matches float64 (cs149gpt.scaled_dot_product_attention's docstring). If a torch release starts taking them,
    torch's result must agree too."""
    g = gen(1124)
    cases = []
    for shape in ((3, 5, 8), (2, 2, 3, 5, 8)):  # attn_mask with is_causal on 3-D and 5-D inputs
        q = randn(*shape, gen=g)
        mask = randn(5, 5, gen=g) > -0.5
        cases.append((f"mask + causal {shape}", (q, q, q), dict(attn_mask=mask, is_causal=True), mask, True, None))
    q, k = randn(1, 4, 5, 8, gen=g), randn(1, 2, 5, 8, gen=g)
    for mask in (torch.tensor(True), torch.ones(5, dtype=torch.bool)):  # 0-d and 1-d masks with enable_gqa
        kk = k.repeat_interleave(2, dim=1)
        cases.append((f"{mask.dim()}-d mask, GQA", (q, k, k), dict(attn_mask=mask, enable_gqa=True), mask, False,
                      (q, kk, kk)))
    q = randn(1, 2, 5, 8, gen=g)
    for scale in (0.0, -1.0):  # is_causal with a scale <= 0
        cases.append((f"causal, scale {scale}", (q, q, q), dict(is_causal=True, scale=scale), None, True, None))
    failures = []
    for tag, args, kwargs, mask, causal, ref_args in cases:
        out = cs149gpt.scaled_dot_product_attention(*args, **kwargs)
        r = [t.double() for t in (ref_args or args)]
        want, _ = ref_masked(*r, mask, scale=kwargs.get("scale"), is_causal=causal)
        err = (out.double() - want).abs().max().item()
        if not err <= TOL:
            failures.append(f"{tag}: ours off float64 by {err:.3g}")
        try:
            theirs = F.scaled_dot_product_attention(*args, **kwargs)
        except (RuntimeError, IndexError):
            continue
        if torch.isfinite(theirs).all() and not (theirs.double() - want).abs().max().item() <= TOL:
            failures.append(f"{tag}: torch now takes it, and differs from float64")
    assert not failures, "\n".join(failures)
