"""attn_mask, sliding windows, softcap, ALiBi and dropout in the CUDA FlashAttention-2 kernels (their general path,
csrc/cuda/flash_mask.cuh), forward and backward, against float64 references written from the definitions
(csrc/attention.h): s = c(scale · q·k) − slope·|i + Nk − Nq − j| + M, hidden keys (attn_mask False or −inf, causal
mask, window) weigh 0, a row that sees no key gets 0 and lse −inf, dropout's keep mask the CPU's generator (the same
(seed, offset) drops the same elements on both devices). Skipped where torch sees no GPU.
"""
import math

import pytest
import torch

import cs149gpt
from cs149gpt import _ext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

CUDA = "cuda"
NEG_INF = float("-inf")
# (dtype, d): both dtypes and both head dims, each with each, over the long parametrisations two pairs only.
DT_D = [(torch.bfloat16, 64), (torch.float16, 128)]
ALL_DT_D = DT_D + [(torch.float16, 64), (torch.bfloat16, 128)]
CAUSAL = (False, "top_left", "bottom_right")
# (B, Hq, Hkv, Nq, Nk): GQA, Nq != Nk both ways, one query row, a thousand keys
SHAPES = [(2, 4, 2, 77, 300), (1, 4, 4, 300, 77), (2, 2, 1, 1, 1000), (1, 2, 2, 1000, 1000)]
OUT_CAP = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_CAP = {torch.bfloat16: 5e-2, torch.float16: 1.5e-2}


def rand(shape, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(shape, generator=g, device=CUDA, dtype=torch.float32).to(dtype)


def make_qkv(shape, d, dtype, seed=0):
    B, Hq, Hkv, Nq, Nk = shape
    return rand((B, Hq, Nq, d), dtype, seed), rand((B, Hkv, Nk, d), dtype, seed + 1), rand((B, Hkv, Nk, d), dtype,
                                                                                         seed + 2)


def reference(q, k, v, *, scale=None, causal=False, mask=None, window=None, softcap=0.0, alibi=None, keep=None,
              dropout_p=0.0):
    """(out, lse) in float64 from the definition; differentiable in q, k, v. keep: the dropout keep mask
    (B, Hq, Nq, Nk) bool."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Nq, d = q.shape
    Nk = k.shape[-2]
    if k.shape[1] != Hq:
        k, v = k.repeat_interleave(Hq // k.shape[1], 1), v.repeat_interleave(Hq // k.shape[1], 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.double().reshape(*(alibi.shape if alibi.dim() == 2 else (1, Hq)), 1, 1)
        s = s - slopes * (i + Nk - Nq - j).abs()
    visible = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device).expand(B, Hq, Nq, Nk)
    if causal:
        visible = visible & (j <= i + (0 if causal in (True, "top_left") else Nk - Nq))
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (j >= i + Nk - Nq - left)
        if right >= 0:
            visible = visible & (j <= i + Nk - Nq + right)
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            visible = visible & (mask != NEG_INF)
            s = s + mask.double().masked_fill(mask == NEG_INF, 0.0)
    s = s.masked_fill(~visible, NEG_INF)
    m = s.amax(-1, keepdim=True)
    none = m == NEG_INF
    p = torch.exp(s - m.masked_fill(none, 0.0))
    l = p.sum(-1, keepdim=True)
    p = p / l.masked_fill(l == 0, 1.0)
    lse = (m + torch.log(l.masked_fill(l == 0, 1.0))).masked_fill(none, NEG_INF).squeeze(-1)
    if keep is not None:
        p = p * keep.to(p.device) / (1.0 - dropout_p)
    return p @ v, lse


def run(q, k, v, dout, **kw):
    """Ours: out, lse and (dq, dk, dv) for dout."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = cs149gpt.attention(q, k, v, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def run_reference(q, k, v, dout, **kw):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = reference(q, k, v, **kw)
    out.backward(dout.double())
    return out.detach(), lse, q.grad, k.grad, v.grad


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check(q, k, v, what, ours_kw, ref_kw, grads=True):
    """Ours against the float64 reference: out within OUT_CAP, lse within 1e-2 where finite (−inf where it is),
    gradients within GRAD_CAP of the largest reference gradient."""
    dtype = q.dtype
    dout = rand(q.shape, dtype, 7)
    if grads:
        out, lse, dq, dk, dv = run(q, k, v, dout, **ours_kw)
        r_out, r_lse, rq, rk, rv = run_reference(q, k, v, dout, **ref_kw)
    else:
        out, lse = cs149gpt.attention(q, k, v, return_lse=True, **ours_kw)
        r_out, r_lse = reference(q, k, v, **ref_kw)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = max_err(out, r_out)
    assert err <= OUT_CAP[dtype], f"{what}: out max abs error {err:.3g}"
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite pattern"
    assert (lse[~finite] == NEG_INF).all(), f"{what}: lse of a row that sees no key must be -inf"
    assert max_err(lse[finite], r_lse[finite]) <= 1e-2, f"{what}: lse"
    if grads:
        scale = max(g.abs().max().item() for g in (rq, rk, rv)) + 1e-6
        for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            assert g.dtype == dtype and g.shape == r.shape, f"{what}: {name}"
            assert torch.isfinite(g).all(), f"{what}: {name} non-finite"
            e = max_err(g, r) / scale
            assert e <= GRAD_CAP[dtype], f"{what}: {name} relative max error {e:.3g}"


def make_mask(case, shape, dtype, seed=0):
    """attn_mask of each broadcast shape and kind the kernels read."""
    B, Hq, _, Nq, Nk = shape
    g = torch.Generator(device=CUDA).manual_seed(seed)
    lengths = torch.randint(1, Nk + 1, (B,), generator=g, device=CUDA)
    j = torch.arange(Nk, device=CUDA)
    i = torch.arange(Nq, device=CUDA)
    if case == "bool_NN":
        return torch.rand(Nq, Nk, generator=g, device=CUDA) < 0.7
    if case == "bool_B1NN":
        return (torch.rand(B, 1, Nq, Nk, generator=g, device=CUDA) < 0.8) & (j < lengths[:, None, None, None])
    if case == "key_padding_B11N":  # right padding, the first batch element's keys all hidden
        lengths[0] = 0
        return (j < lengths[:, None, None, None])
    if case == "key_padding_1H1N":  # left padding per head
        starts = torch.randint(0, Nk, (Hq,), generator=g, device=CUDA)
        return (j >= starts[:, None, None])[None]
    if case == "padded_causal_B1NN":  # transformers' padded causal mask, bottom-right, left padding
        starts = torch.randint(0, Nk, (B,), generator=g, device=CUDA)
        return (j <= i[:, None] + Nk - Nq) & (j >= starts[:, None, None, None])
    if case == "additive_f32_B1NN":
        bias = torch.randn(B, 1, Nq, Nk, generator=g, device=CUDA)
        return bias.masked_fill(torch.rand(B, 1, Nq, Nk, generator=g, device=CUDA) < 0.3, NEG_INF)
    if case == "additive_qdtype_NN":
        bias = torch.randn(Nq, Nk, generator=g, device=CUDA)
        return bias.masked_fill(j >= lengths[0], NEG_INF).to(dtype)
    if case == "strided_view":  # every other key of a wider mask, transposed storage
        wide = torch.rand(B, Hq, 2 * Nk, Nq, generator=g, device=CUDA) < 0.75
        return wide.transpose(-1, -2)[..., ::2]
    raise AssertionError(case)


MASK_CASES = ["bool_NN", "bool_B1NN", "key_padding_B11N", "key_padding_1H1N", "padded_causal_B1NN",
              "additive_f32_B1NN", "additive_qdtype_NN", "strided_view"]


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", MASK_CASES)
def test_attn_mask(dtype, d, causal, shape, case):
    q, k, v = make_qkv(shape, d, dtype, seed=shape[3] + shape[4])
    mask = make_mask(case, shape, dtype)
    check(q, k, v, f"{case} causal={causal}", dict(attn_mask=mask, is_causal=causal),
          dict(mask=mask, causal=causal))


@pytest.mark.parametrize("dtype,d", ALL_DT_D, ids=str)
def test_attn_mask_every_dtype_and_head_dim(dtype, d):
    shape = (2, 4, 2, 130, 257)
    q, k, v = make_qkv(shape, d, dtype, seed=5)
    for case in ("padded_causal_B1NN", "additive_f32_B1NN"):
        mask = make_mask(case, shape, dtype, seed=1)
        check(q, k, v, case, dict(attn_mask=mask), dict(mask=mask))


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("window", [(16, 0), (0, 16), (100, 7), (5, -1), (-1, 5), (0, 0)], ids=str)
def test_window(dtype, d, causal, shape, window):
    q, k, v = make_qkv(shape, d, dtype, seed=11)
    check(q, k, v, f"window={window} causal={causal}", dict(window=window, is_causal=causal),
          dict(window=window, causal=causal))


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
def test_window_with_mask(dtype, d):
    shape = (2, 4, 2, 300, 300)
    q, k, v = make_qkv(shape, d, dtype, seed=12)
    mask = make_mask("key_padding_B11N", shape, dtype)
    check(q, k, v, "window + padding", dict(window=(64, 0), attn_mask=mask), dict(window=(64, 0), mask=mask))


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("softcap,alibi", [(5.0, None), (30.0, None), (0.0, "H"), (0.0, "BH"), (10.0, "H")],
                         ids=str)
def test_softcap_alibi(dtype, d, causal, shape, softcap, alibi):
    B, Hq = shape[:2]
    q, k, v = make_qkv(shape, d, dtype, seed=21)
    q = q * 3  # logits of a few units: softcap 5 bends them
    slopes = None
    if alibi == "H":
        slopes = 2.0 ** (-8.0 * torch.arange(1, Hq + 1, device=CUDA) / Hq)
    elif alibi == "BH":
        slopes = torch.rand(B, Hq, device=CUDA) * 0.2
    check(q, k, v, f"softcap={softcap} alibi={alibi}", dict(softcap=softcap, alibi_slopes=slopes, is_causal=causal),
          dict(softcap=softcap, alibi=slopes, causal=causal))


@pytest.mark.parametrize("dtype,d", ALL_DT_D, ids=str)
def test_everything_at_once(dtype, d):
    """mask, window, causal, softcap and ALiBi in one call."""
    shape = (2, 4, 2, 200, 333)
    q, k, v = make_qkv(shape, d, dtype, seed=31)
    mask = make_mask("additive_f32_B1NN", shape, dtype)
    slopes = torch.rand(2, 4, device=CUDA) * 0.1
    kw = dict(attn_mask=mask, window=(90, 20), is_causal="bottom_right", softcap=8.0, alibi_slopes=slopes)
    check(q, k, v, "all", kw, dict(mask=mask, window=(90, 20), causal="bottom_right", softcap=8.0, alibi=slopes))


# ---------------------------------------------------------------------------------------------------------
# dropout: the CPU's generator, so the same (seed, offset) drops the same elements on both devices
# ---------------------------------------------------------------------------------------------------------
def keep_mask(seed, offset, shape, p):
    return _ext.load()._testing.dropout_keep_mask(int(seed), int(offset), list(shape), float(p))


def flash_op(q, k, v, seed, p, *, mask=None, causal="none", window=(-1, -1), softcap=0.0, slopes=None):
    return torch.ops.cs149gpt.flash_attention(q, k, v, None, causal, None, None, mask, window[0], window[1], p, seed,
                                              softcap, slopes)


@pytest.mark.parametrize("dtype,d", ALL_DT_D, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(2, 4, 2, 77, 300), (1, 2, 2, 300, 300), (2, 2, 1, 1, 1000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dropout_against_the_keep_mask(dtype, d, p, shape):
    """Out, lse and gradients against float64 given the CPU generator's keep mask for the call's (seed, offset)."""
    B, Hq, _, Nq, Nk = shape
    q, k, v = make_qkv(shape, d, dtype, seed=41)
    seed = torch.tensor([123456789, 1000 + Nq], dtype=torch.int64)
    keep = keep_mask(seed[0], seed[1], (B, Hq, Nq, Nk), p).to(CUDA)
    mask = make_mask("bool_B1NN", shape, dtype)
    dout = rand(q.shape, dtype, 8)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_op(qs, ks, vs, seed, p, mask=mask, causal="bottom_right")
    out.backward(dout)
    r_out, r_lse, rq, rk, rv = run_reference(q, k, v, dout, mask=mask, causal="bottom_right", keep=keep, dropout_p=p)
    assert max_err(out, r_out) <= OUT_CAP[dtype] / (1 - p)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite) and max_err(lse[finite], r_lse[finite]) <= 1e-2
    scale = max(g.abs().max().item() for g in (rq, rk, rv)) + 1e-6
    for name, g, r in (("dq", qs.grad, rq), ("dk", ks.grad, rk), ("dv", vs.grad, rv)):
        assert torch.isfinite(g).all(), name
        assert max_err(g, r) / scale <= GRAD_CAP[dtype], name


@pytest.mark.parametrize("dtype,d", ALL_DT_D, ids=str)
def test_dropout_drops_what_the_cpu_drops(dtype, d):
    """V one-hot over the keys (Nk = d): out[i, j] = P_ij / (1 − p) or exactly 0, so the output shows the keep mask
    itself; CUDA and the CPU kernel, given the same (seed, offset), zero the same entries, and agree elsewhere."""
    B, Hq, Nq, Nk, p = 2, 3, 150, d, 0.3
    q, k, _ = make_qkv((B, Hq, Hq, Nq, Nk), d, dtype, seed=51)
    v = torch.eye(Nk, d, device=CUDA, dtype=dtype).expand(B, Hq, Nk, d).contiguous()
    seed = torch.tensor([-987654321, 4242], dtype=torch.int64)
    out, _ = flash_op(q, k, v, seed, p, causal="top_left")
    out_cpu, _ = flash_op(q.cpu(), k.cpu(), v.cpu(), seed, p, causal="top_left")
    keep = keep_mask(seed[0], seed[1], (B, Hq, Nq, Nk), p)
    causal = torch.arange(Nk)[None, :] <= torch.arange(Nq)[:, None]
    expected_zero = ~keep | ~causal
    assert torch.equal(out.cpu() == 0, expected_zero)
    assert torch.equal(out_cpu == 0, expected_zero)
    assert max_err(out.cpu(), out_cpu) <= OUT_CAP[dtype]
    assert 0.2 < (~keep[..., causal]).float().mean().item() < 0.4  # the drop rate


def test_dropout_same_result_on_cpu_and_cuda_with_gradients():
    shape, p = (2, 4, 2, 100, 190), 0.2
    q, k, v = make_qkv(shape, 64, torch.bfloat16, seed=61)
    dout = rand(q.shape, torch.bfloat16, 9)
    seed = torch.tensor([31337, 77], dtype=torch.int64)
    results = []
    for device in (CUDA, "cpu"):
        ts = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
        out, _ = flash_op(*ts, seed, p, softcap=20.0, window=(50, 10))
        out.backward(dout.to(device))
        results.append([out.detach().cpu()] + [t.grad.cpu() for t in ts])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        scale = b.abs().max().item() + 1e-6
        assert max_err(a, b) / scale <= 3e-2, name


def test_dropout_reproducible_from_manual_seed():
    q, k, v = make_qkv((1, 2, 2, 128, 128), 64, torch.bfloat16, seed=71)
    torch.manual_seed(0)
    a = cs149gpt.attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(0)
    b = cs149gpt.attention(q, k, v, dropout_p=0.25)
    c = cs149gpt.attention(q, k, v, dropout_p=0.25)
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------------------
# rows that see nothing, the non-finite rule, tiles skipped, GQA's two backward layouts, the path taken
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
def test_fully_masked_rows(dtype, d):
    """Rows whose keys the mask (or a window) hides whole: out exactly 0, lse −inf, gradients 0 there and finite."""
    shape = (2, 4, 2, 150, 200)
    q, k, v = make_qkv(shape, d, dtype, seed=81)
    mask = torch.rand(2, 1, 150, 200, device=CUDA) < 0.5
    mask[0, :, 10:40] = False
    mask[1, :, 149] = False
    out, lse, dq, dk, dv = run(q, k, v, rand(q.shape, dtype, 3), attn_mask=mask)
    assert (out[0, :, 10:40] == 0).all() and (out[1, :, 149] == 0).all()
    assert (lse[0, :, 10:40] == NEG_INF).all() and (lse[1, :, 149] == NEG_INF).all()
    assert (dq[0, :, 10:40] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    check(q, k, v, "rows hidden whole", dict(attn_mask=mask), dict(mask=mask))
    # a window that leaves the first rows nothing (Nk < Nq, bottom-right: row i sees i + Nk - Nq - 2 .. i + Nk - Nq)
    q2, k2, v2 = make_qkv((1, 2, 2, 300, 100), d, dtype, seed=82)
    out2, lse2 = cs149gpt.attention(q2, k2, v2, window=(2, 0), return_lse=True)
    assert (out2[..., :198, :] == 0).all() and (lse2[..., :198] == NEG_INF).all()
    check(q2, k2, v2, "window hides rows", dict(window=(2, 0)), dict(window=(2, 0)))


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
def test_nonfinite_rule(dtype, d):
    """README's rule with masks: a NaN or +inf among a row's shown logits makes its row NaN; a NaN in the k of a key
    the mask hides (or in the additive mask at a hidden key) changes nothing; NaN/+inf in an additive mask at a shown
    key makes the row NaN."""
    B, H, Nq, Nk = 1, 2, 40, 128
    q, k, v = make_qkv((B, H, H, Nq, Nk), d, dtype, seed=91)
    mask = torch.zeros(B, H, Nq, Nk, device=CUDA)
    mask[..., 100:] = NEG_INF  # keys 100.. hidden from every row
    mask[0, 0, 5, 50] = float("nan")  # row 5 of head 0: NaN at a shown key
    mask[0, 1, 6, 60] = float("inf")  # row 6 of head 1: +inf there
    q[0, 0, 7, 0] = float("nan")  # row 7 of head 0: a NaN query
    k[0, :, 110, :] = float("nan")  # a hidden key's k
    out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, return_lse=True)
    bad = torch.zeros(B, H, Nq, dtype=torch.bool, device=CUDA)
    bad[0, 0, 5] = bad[0, 1, 6] = bad[0, 0, 7] = True
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert torch.isfinite(out[~bad]).all() and torch.isfinite(lse[~bad]).all()
    good = mask.masked_fill(mask.isnan() | (mask == float("inf")), 0.0)
    r_out, _ = reference(q.nan_to_num(0.0), k.nan_to_num(0.0), v, mask=good)
    assert max_err(out[~bad], r_out[~bad]) <= OUT_CAP[dtype]


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
def test_hidden_tiles_are_never_read(dtype, d):
    """Keys past every row's padding fill whole tiles (Nk 512, 200 shown): the kernels skip those tiles, so even a NaN
    in their v (which P = 0 would still multiply) cannot reach the output or the gradients."""
    B, H, Nq, Nk = 2, 2, 100, 512
    q, k, v = make_qkv((B, H, H, Nq, Nk), d, dtype, seed=101)
    k[..., 256:, :] = float("nan")
    v[..., 256:, :] = float("nan")
    mask = (torch.arange(Nk, device=CUDA) < 200)[None, None, None, :].expand(B, 1, 1, Nk)
    out, lse, dq, dk, dv = run(q, k, v, rand(q.shape, dtype, 4), attn_mask=mask)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk[..., :256, :]).all() and torch.isfinite(dv[..., :256, :]).all()
    assert (dk[..., 256:, :] == 0).all() and (dv[..., 256:, :] == 0).all()
    r_out, _ = reference(q, k[..., :200, :], v[..., :200, :])
    assert max_err(out, r_out) <= OUT_CAP[dtype]


@pytest.mark.parametrize("split", ["1", "0"])
def test_gqa_backward_layouts(split, monkeypatch):
    """One block per query head (the default) and one per kv head (CS149GPT_BWD_GQA_SPLIT=0) give the same gradients."""
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", split)
    shape = (2, 8, 2, 130, 170)
    q, k, v = make_qkv(shape, 128, torch.bfloat16, seed=111)
    mask = make_mask("padded_causal_B1NN", shape, torch.bfloat16)
    slopes = torch.rand(8, device=CUDA) * 0.1
    check(q, k, v, f"GQA split={split}", dict(attn_mask=mask, alibi_slopes=slopes, softcap=15.0),
          dict(mask=mask, alibi=slopes, softcap=15.0))


def kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("hopper", ["1", "0"])
def test_which_kernels_take_the_options(hopper, monkeypatch):
    """attn_mask and windows: the Hopper kernels' key spans on a Hopper GPU, forward and, for a boolean mask or a
    window, backward (an additive mask's backward: the FlashAttention-2 general kernel); elsewhere, and with
    CS149GPT_HOPPER=0, the FlashAttention-2 general kernels. softcap, ALiBi and dropout: the FlashAttention-2 general
    kernels both ways (hopper_fwd_supports / hopper_bwd_supports decline them). attn_mask's key bounds are found on
    the GPU."""
    monkeypatch.setenv("CS149GPT_HOPPER", hopper)
    on_hopper = hopper == "1" and torch.cuda.get_device_capability() == (9, 0)
    q, k, v = (t.requires_grad_() for t in make_qkv((1, 2, 2, 128, 128), 64, torch.bfloat16, seed=121))
    mask = torch.ones(128, 128, dtype=torch.bool, device=CUDA).tril()
    additive = torch.zeros(128, 128, device=CUDA).masked_fill(~mask, NEG_INF)
    for kw in (dict(attn_mask=mask), dict(window=(8, 8)), dict(attn_mask=additive), dict(softcap=5.0),
               dict(dropout_p=0.1), dict(alibi_slopes=torch.ones(2, device=CUDA))):
        names = kernels_run(lambda: cs149gpt.attention(q, k, v, **kw).sum().backward())
        spans = on_hopper and ("attn_mask" in kw or "window" in kw)
        spans_bwd = spans and not ("attn_mask" in kw and kw["attn_mask"].is_floating_point())
        assert any("flash_fwd_hopper_kernel" in n for n in names) == spans, (kw, names)
        assert any("flash_fwd_kernel" in n for n in names) != spans, (kw, names)
        assert any("flash_bwd_hopper_kernel" in n for n in names) == spans_bwd, (kw, names)
        assert any("bwd_span_tiles_kernel" in n for n in names) == spans_bwd, (kw, names)
        assert any("flash_bwd_kernel" in n for n in names) != spans_bwd, (kw, names)
        assert any("mask_key_bounds" in n for n in names) == ("attn_mask" in kw), (kw, names)


def block_diagonal(shape, cuts):
    """A packed-documents mask (B, 1, Nq, Nk): query i sees the keys of its own document, documents split at `cuts`
    (query and key positions alike, Nq == Nk), causal inside each."""
    _, _, _, Nq, Nk = shape
    doc = torch.bucketize(torch.arange(Nk, device=CUDA), torch.tensor(cuts, device=CUDA), right=True)
    i = torch.arange(Nq, device=CUDA)[:, None]
    j = torch.arange(Nk, device=CUDA)[None, :]
    return ((doc[:, None] == doc[None, :]) & (j <= i))[None, None].expand(shape[0], 1, Nq, Nk)


# Cases with several key blocks (128 keys) and query tiles (64 or 128 rows), so that the backward's producer skips
# tiles, visits some whole and masks others: (name, shape, ours' options, the reference's options).
def _hopper_span_cases():
    s1, s2 = (2, 4, 2, 700, 700), (1, 4, 4, 333, 1100)
    g = torch.Generator(device=CUDA).manual_seed(3)
    holes = torch.rand(2, 1, 700, 700, generator=g, device=CUDA) < 0.9  # rows not exact: entries read
    lengths = torch.tensor([700, 301], device=CUDA)
    padding = torch.arange(700, device=CUDA)[None, None, None, :] < lengths[:, None, None, None]
    docs = block_diagonal(s1, [130, 131, 400])
    return [
        ("key padding", s1, dict(attn_mask=padding), dict(mask=padding)),
        ("padded causal", s1, dict(attn_mask=padding, is_causal=True), dict(mask=padding, causal=True)),
        ("documents", s1, dict(attn_mask=docs), dict(mask=docs)),
        ("holes", s1, dict(attn_mask=holes, is_causal="bottom_right"), dict(mask=holes, causal="bottom_right")),
        ("window", s1, dict(window=(200, 0)), dict(window=(200, 0))),
        ("window both ways", s1, dict(window=(64, 130)), dict(window=(64, 130))),
        ("window, Nq < Nk", s2, dict(window=(300, 40), is_causal="bottom_right"),
         dict(window=(300, 40), causal="bottom_right")),
        ("window and padding", s1, dict(window=(150, 0), attn_mask=padding), dict(window=(150, 0), mask=padding)),
        # more than 32 query tiles a head: the producer reads the table in several passes
        ("window, 68 query tiles", (1, 2, 1, 4300, 4300), dict(window=(500, 0)), dict(window=(500, 0))),
    ]


@pytest.mark.parametrize("dtype,d", ALL_DT_D, ids=str)
@pytest.mark.parametrize("split", ["1", "0"])
def test_hopper_backward_key_spans(dtype, d, split, monkeypatch):
    """The Hopper backward's key spans (a boolean mask, windows, the causal mask with them) against float64, GQA with
    one block per query head and per kv head; on a Hopper GPU the test also checks that the kernel ran."""
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", split)
    on_hopper = torch.cuda.get_device_capability() == (9, 0)
    for name, shape, ours, ref in _hopper_span_cases():
        q, k, v = make_qkv(shape, d, dtype, seed=shape[3])
        if on_hopper:
            qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
            names = kernels_run(lambda: cs149gpt.attention(qs, ks, vs, **ours).sum().backward())
            assert any("flash_bwd_hopper_kernel" in n for n in names), (name, names)
        check(q, k, v, name, ours, ref)


@pytest.mark.parametrize("dtype,d", DT_D, ids=str)
@pytest.mark.parametrize("split", ["1", "0"])
def test_hopper_backward_key_spans_match_the_general_kernel(dtype, d, split, monkeypatch):
    """The same gradients from the Hopper backward's key spans and FlashAttention-2's general kernel (CS149GPT_HOPPER=0)
    for every case, to the rounding of their different orders of summation."""
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", split)
    for name, shape, ours, _ in _hopper_span_cases():
        q, k, v = make_qkv(shape, d, dtype, seed=shape[3] + 1)
        dout = rand(q.shape, dtype, 5)
        monkeypatch.setenv("CS149GPT_HOPPER", "1")
        a = run(q, k, v, dout, **ours)
        monkeypatch.setenv("CS149GPT_HOPPER", "0")
        b = run(q, k, v, dout, **ours)
        for what, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
            finite = torch.isfinite(y)
            assert torch.equal(torch.isfinite(x), finite), (name, what)
            scale = y[finite].abs().max().item() + 1e-6 if finite.any() else 1.0
            assert max_err(x[finite], y[finite]) / scale <= GRAD_CAP[dtype], (name, what)


def test_float32_teaching_kernel_refuses_the_options():
    q, k, v = make_qkv((1, 2, 2, 16, 16), 64, torch.float32)
    mask = torch.ones(16, 16, dtype=torch.bool, device=CUDA)
    for kw, name in ((dict(attn_mask=mask), "attn_mask"), (dict(window=(4, 0)), "window"),
                     (dict(dropout_p=0.1), "dropout_p"), (dict(softcap=3.0), "softcap"),
                     (dict(alibi_slopes=torch.ones(2, device=CUDA)), "alibi_slopes")):
        with pytest.raises(NotImplementedError, match=f"{name} on CUDA needs bfloat16 or float16"):
            cs149gpt.attention(q, k, v, **kw)


def test_opcheck_with_every_option():
    q, k, v = (t.requires_grad_() for t in make_qkv((1, 2, 1, 40, 72), 64, torch.bfloat16, seed=131))
    mask = torch.rand(1, 1, 40, 72, device=CUDA) < 0.8
    seed = torch.tensor([5, 6], dtype=torch.int64)
    slopes = torch.rand(2, device=CUDA)
    options = (mask, 30, 4, 0.2, seed, 10.0, slopes)
    ops = torch.ops.cs149gpt
    torch.library.opcheck(ops.flash_attention.default, (q, k, v, None, "bottom_right", None, None, *options))
    out, lse = ops.flash_attention(q, k, v, None, "bottom_right", None, None, *options)
    torch.library.opcheck(ops.flash_attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None,
                           "bottom_right", None, None, *options))


def test_compile_with_mask():
    torch._dynamo.reset()
    q, k, v = make_qkv((2, 2, 2, 64, 96), 128, torch.float16, seed=141)
    mask = make_mask("key_padding_B11N", (2, 2, 2, 64, 96), torch.float16)

    def f(q, k, v, mask):
        return cs149gpt.attention(q, k, v, attn_mask=mask, softcap=10.0)

    eager = f(q, k, v, mask)
    compiled = torch.compile(f, fullgraph=True)(q, k, v, mask)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
