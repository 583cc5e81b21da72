"""softcap and ALiBi slopes inside the flash kernels, forward and backward, against a float64 reference.

The reference is written from the definitions (FlashAttention's): scores = scale · q kᵀ; softcap > 0 makes them
softcap · tanh(scores / softcap); ALiBi adds −slope · |i + Nk − Nq − j|; then attn_mask, the causal mask and the
window; softmax; times v. lse is the logsumexp of the same logits.
"""
import math

import pytest
import torch

import cs149gpt
from _helpers import gen, isa, f32_products, module, randn  # noqa: F401  (fixtures)

# Max abs error against float64, per dtype (inputs rounded to the dtype first, so only the kernel's arithmetic counts).
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.float32: 1e-3, torch.bfloat16: 8e-2, torch.float16: 1.5e-2}


def slopes_of(h, b=None, seed=0):
    g = gen(seed)
    base = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
    if b is None:
        return base
    return base * (0.5 + torch.rand(b, h, generator=g))


def reference(q, k, v, *, scale=None, causal="none", softcap=0.0, slopes=None, mask=None, window=(-1, -1)):
    """(out, lse) in float64. q (B, Hq, Nq, d); k, v (B, Hkv, Nk, d)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, n_q, d = q.shape
    n_k = k.shape[-2]
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n_q, dtype=torch.float64).view(-1, 1)
    j = torch.arange(n_k, dtype=torch.float64).view(1, -1)
    if slopes is not None:
        sl = slopes.double()
        sl = sl.view(1, H, 1, 1) if sl.dim() == 1 else sl.view(B, H, 1, 1)
        s = s - sl * (i + n_k - n_q - j).abs()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    offset = {"none": None, "top_left": 0, "bottom_right": n_k - n_q}[causal]
    if offset is not None:
        s = s.masked_fill(j > i + offset, float("-inf"))
    left, right = window
    if left >= 0:
        s = s.masked_fill(j < i + n_k - n_q - left, float("-inf"))
    if right >= 0:
        s = s.masked_fill(j > i + n_k - n_q + right, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # a row that sees no key: 0
    return p @ v, lse


def run_case(dtype, *, B=2, H=4, Hkv=None, n_q=37, n_k=53, d=32, causal="none", softcap=0.0, slopes="head",
             mask=None, window=None, block_q=None, block_k=None, grads=True, seed=0, q_scale=2.0):
    g = gen(seed)
    Hkv = Hkv or H
    q = randn(B, H, n_q, d, gen=g).to(dtype)
    k = randn(B, Hkv, n_k, d, gen=g).to(dtype)
    v = randn(B, Hkv, n_k, d, gen=g).to(dtype)
    # Scores of a few units (q_scale 2), so that a softcap of 2–5 bites.
    q = (q.float() * q_scale).to(dtype)
    if slopes is None or isinstance(slopes, torch.Tensor):
        sl = slopes
    else:
        sl = slopes_of(H) if slopes == "head" else slopes_of(H, B, seed)
    ref_out, ref_lse = reference(q, k, v, causal=causal, softcap=softcap, slopes=sl, mask=mask,
                                 window=window or (-1, -1))
    qr, kr, vr = (t.clone().requires_grad_(grads) for t in (q, k, v))
    out, lse = cs149gpt.attention(qr, kr, vr, is_causal=causal if causal != "none" else False, return_lse=True,
                                  softcap=softcap, alibi_slopes=sl, attn_mask=mask, window=window, block_q=block_q,
                                  block_k=block_k)
    seen = torch.isfinite(ref_lse)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - ref_out).abs().max().item()
    assert err <= TOL[dtype], f"out: max abs error {err:.3g}"
    lse_err = (lse.double()[seen] - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
    assert lse_err <= TOL[dtype] * 4, f"lse: max abs error {lse_err:.3g}"
    assert torch.equal(torch.isinf(lse), ~seen)
    if not grads:
        return
    dout = randn(*out.shape, gen=g).to(dtype)
    out.backward(dout)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = reference(qd, kd, vd, causal=causal, softcap=softcap, slopes=sl, mask=mask, window=window or (-1, -1))
    ref.backward(dout.double())
    for name, ours, theirs in (("dq", qr.grad, qd.grad), ("dk", kr.grad, kd.grad), ("dv", vr.grad, vd.grad)):
        e = (ours.double() - theirs).abs().max().item()
        assert e <= GRAD_TOL[dtype], f"{name}: max abs error {e:.3g}"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap, slopes", [(3.0, None), (30.0, None), (0.0, "head"), (4.0, "batch")])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_every_isa(isa, f32_products, dtype, softcap, slopes, causal):
    """Forward (out, lse) and gradients on every ISA and dtype; Nq ≠ Nk, tiles that do not divide N. softcap 3 takes
    both of the forward's tanh paths (logits of N(0, 1): some vectors past 0.625 · cap), 30 the polynomial alone."""
    run_case(dtype, causal=causal, softcap=softcap, slopes=slopes, block_q=16, block_k=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_scale", [12.0, 40.0])
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_alibi_wide_logits(dtype, q_scale, causal):
    """ALiBi where the scores of a row spread over tens to hundreds of units and the slopes are steep: the float32
    kernel's exp pass bounds a row's max by its scores' max plus the nearest key's offset, which can lie hundreds of
    units above its logits' max (the score's max at a far key); such a row takes ALiBi in a pass of its own (without
    it, its exps underflow to 0 and the row is NaN). Out and lse match the float64 reference."""
    steep = torch.tensor([4.0, 1.0, 0.25, 2.0 ** -6])
    run_case(dtype, n_q=40, n_k=300, causal=causal, slopes=steep, q_scale=q_scale, grads=False)
    run_case(dtype, n_q=70, n_k=90, causal=causal, slopes="head", q_scale=q_scale, grads=False, block_q=16,
             block_k=24)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
def test_alibi_negative_slopes(dtype, causal):
    """Slopes of either sign (alibi_slopes takes any float32): a negative slope raises the far keys' logits, so the
    nearest key's offset no longer bounds a row's max (the float32 kernel's exp pass relies on it; without the
    separate pass its exps overflow and the row is NaN). Out, lse and gradients match the float64 reference."""
    mixed = torch.tensor([-0.5, -0.05, 0.3, -2.0])
    run_case(dtype, n_q=40, n_k=300, causal=causal, slopes=mixed, q_scale=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["gqa", "window", "bool_mask", "additive_mask", "decode", "long_kv", "q_longer",
                                  "default_tiles"])
def test_combinations(dtype, case):
    """With GQA, windows, attn_mask (bool and additive), decode-shaped calls, Nq > Nk (rows that see no key)."""
    g = gen(7)
    kw = dict(softcap=2.5, slopes="batch")
    if case == "gqa":
        run_case(dtype, H=6, Hkv=2, causal="bottom_right", **kw)
    elif case == "window":
        run_case(dtype, window=(9, 3), causal="none", **kw)
    elif case == "bool_mask":
        mask = torch.rand(2, 1, 37, 53, generator=g) > 0.3
        run_case(dtype, mask=mask, causal="top_left", **kw)
    elif case == "additive_mask":
        mask = randn(1, 4, 37, 53, gen=g).to(dtype if dtype != torch.float32 else torch.float32)
        run_case(dtype, mask=mask, **kw)
    elif case == "decode":
        run_case(dtype, n_q=3, n_k=300, causal="bottom_right", **kw)
        run_case(dtype, n_q=1, n_k=77, slopes="head", softcap=0.0)
    elif case == "long_kv":
        run_case(dtype, n_q=150, n_k=400, causal="bottom_right", d=64, grads=dtype == torch.float32, **kw)
    elif case == "q_longer":
        run_case(dtype, n_q=60, n_k=20, causal="bottom_right", **kw)
    elif case == "default_tiles":
        run_case(dtype, n_q=200, n_k=200, causal="top_left", d=64, **kw)


def decode_runs(fn):
    """(fn(), how many times the decode kernel (flash_decode.cpp, under its own profiler label) ran in it)."""
    from torch.profiler import profile
    with profile() as prof:
        result = fn()
    return result, sum(1 for e in prof.events() if e.name == "cs149gpt::flash_decode")


# Decode-shaped calls (Nq <= 16, default tiles, no dropout) take flash_decode.cpp, softcap and ALiBi included:
# (B, Hq, Hkv, Nq, Nk, d); 700 keys make several splits (merged after), GQA 4 puts a group's rows in one task.
DECODE_SHAPES = [(2, 4, 2, 1, 53, 24), (2, 4, 2, 3, 700, 32), (1, 8, 2, 16, 300, 16), (3, 4, 1, 5, 200, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mods", [dict(softcap=2.5, slopes=None), dict(softcap=0.0, slopes="head"),
                                  dict(softcap=4.0, slopes="batch")], ids=["softcap", "alibi", "both"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_decode_kernel(isa, dtype, mods, causal):
    """attention()'s decode-shaped calls with softcap and ALiBi run the decode kernel and match the reference."""
    for n, (B, H, Hkv, n_q, n_k, d) in enumerate(DECODE_SHAPES):
        _, runs = decode_runs(lambda: run_case(dtype, B=B, H=H, Hkv=Hkv, n_q=n_q, n_k=n_k, d=d, causal=causal,
                                               grads=False, seed=n, **mods))
        assert runs == 1, f"{(B, H, Hkv, n_q, n_k, d)}: the decode kernel ran {runs} times"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["bool_mask", "additive_mask", "window", "rows_see_none"])
def test_decode_kernel_masked(dtype, case):
    """The decode kernel's masked blocks (attn_mask, window) after softcap and ALiBi; rows that see no key."""
    g = gen(11)
    kw = dict(B=2, H=4, Hkv=2, n_q=4, n_k=300, d=32, softcap=3.0, slopes="batch", grads=False)
    if case == "bool_mask":
        mask = torch.rand(2, 1, 4, 300, generator=g) > 0.4
        run = lambda: run_case(dtype, mask=mask, causal="bottom_right", **kw)  # noqa: E731
    elif case == "additive_mask":
        mask = randn(1, 4, 4, 300, gen=g).to(dtype)
        run = lambda: run_case(dtype, mask=mask, **kw)  # noqa: E731
    elif case == "window":
        run = lambda: run_case(dtype, window=(40, 2), **kw)  # noqa: E731
    else:  # Nq > Nk, top-left: the first rows see keys, bottom-right: the first rows see none
        run = lambda: run_case(dtype, **dict(kw, n_q=12, n_k=8), causal="bottom_right")  # noqa: E731
    _, runs = decode_runs(run)
    assert runs == 1


def test_vector_tanh(isa):
    """The kernels' tanh (softcap's) against float64 tanh: relative error <= 5e-7 from the denormals to the
    saturation, exact at ±0, ±1 beyond, NaN kept; every length modulo the vector widths."""
    tanh = module()._testing.vector_tanh
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 1e-30, 1e-10, 1e-5, 1e-3])
    dense = torch.cat([torch.linspace(-12.0, 12.0, 400_001), torch.logspace(-38, 1.2, 20_001), tiny, -tiny,
                       torch.tensor([0.17, 0.1733, 0.3, 0.34657, 0.5, 1.0, 9.0, 9.9, 10.0, 10.1, 20.0, 88.0, 1e4,
                                     3.4e38])])
    dense = torch.cat([dense, -dense])
    y = tanh(dense)
    assert y.dtype == torch.float32 and y.shape == dense.shape
    want = torch.tanh(dense.double())
    rel = ((y.double() - want).abs() / want.abs().clamp_min(1e-300))
    worst = rel.argmax()
    assert rel.max().item() <= 5e-7, f"tanh({dense[worst].item()!r}) = {y[worst].item()!r}, want {want[worst].item()!r}"
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e30, -1e30])
    ys = tanh(special)
    assert ys[0].item() == 0.0 and math.copysign(1.0, ys[0].item()) == 1.0
    assert ys[1].item() == 0.0 and math.copysign(1.0, ys[1].item()) == -1.0
    assert ys[2:4].tolist() == [1.0, -1.0] and math.isnan(ys[4].item()) and ys[5:].tolist() == [1.0, -1.0]
    for n in list(range(1, 40)) + [63, 64, 65]:
        x = (3 * randn(2 * n, gen=gen(n)))[::2]
        before = x.clone()
        assert ((tanh(x).double() - torch.tanh(x.double())).abs() <= 5e-7 * torch.tanh(x.double()).abs()).all(), n
        assert torch.equal(x, before), f"n={n}: vector_tanh modified its input"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_q, block_k", [(1, 1), (7, 13), (48, 64), (None, None)])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_tiles_sweep(isa, dtype, block_q, block_k, causal):
    run_case(dtype, n_q=97, n_k=131, H=6, Hkv=3, causal=causal, softcap=5.0, slopes="batch", block_q=block_q,
             block_k=block_k)


def test_softcap_large_is_plain():
    """A softcap far above the logits changes nothing measurable; without ALiBi and softcap the call is the plain one."""
    g = gen(3)
    q, k, v = (randn(1, 2, 40, 16, gen=g) for _ in range(3))
    plain = cs149gpt.attention(q, k, v)
    capped = cs149gpt.attention(q, k, v, softcap=1e4)
    assert (plain - capped).abs().max().item() < 1e-5
    zero = cs149gpt.attention(q, k, v, alibi_slopes=torch.zeros(2))
    assert (plain - zero).abs().max().item() < 1e-6


def test_softcap_nonfinite():
    """tanh maps ±inf logits to ±softcap: an inf in q no longer makes its row NaN; a NaN stays NaN."""
    g = gen(4)
    q, k, v = (randn(1, 1, 4, 8, gen=g) for _ in range(3))
    q[0, 0, 1, 0] = float("inf")
    q[0, 0, 2, 0] = float("nan")
    out = cs149gpt.attention(q, k, v, softcap=2.0)
    assert torch.isfinite(out[0, 0, 0]).all() and torch.isfinite(out[0, 0, 3]).all()
    assert torch.isnan(out[0, 0, 2]).all()
    s = q[0, 0, 1].double() @ k[0, 0].double().T / math.sqrt(8)  # ±inf or NaN (inf · 0) per key
    assert torch.isfinite(out[0, 0, 1]).all() == (~torch.isnan(s)).all()


def test_compile_and_autocast():
    g = gen(5)
    q, k, v = (randn(2, 4, 33, 16, gen=g) for _ in range(3))
    sl = slopes_of(4)
    ref, _ = reference(q, k, v, causal="top_left", softcap=3.0, slopes=sl)
    f = torch.compile(lambda q, k, v, s: cs149gpt.attention(q, k, v, is_causal=True, softcap=3.0, alibi_slopes=s),
                      fullgraph=True)
    assert (f(q, k, v, sl).double() - ref).abs().max().item() < TOL[torch.float32]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cs149gpt.attention(q, k, v, is_causal=True, softcap=3.0, alibi_slopes=sl)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() < 5e-2


def test_opcheck():
    g = gen(6)
    q, k, v = (randn(2, 4, 20, 16, gen=g).requires_grad_() for _ in range(3))
    args = (q, k, v, None, "top_left", None, None, None, -1, -1, 0.0, None, 2.0, slopes_of(4, 2))
    torch.library.opcheck(torch.ops.cs149gpt.flash_attention, args)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=1.0, impl="naive"), ValueError, "softcap needs impl='flash'"),
    (dict(softcap=1.0, impl="flash_teaching"), ValueError, "softcap needs impl='flash'"),
    (dict(alibi_slopes=torch.ones(4), impl="fused"), ValueError, "alibi_slopes needs impl='flash'"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.bfloat16)), TypeError, "alibi_slopes must be float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=torch.ones(2, 4, 1)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes must be a float32 torch.Tensor"),
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)), ValueError, "alibi_slopes gets no gradient"),
    (dict(alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes"),
])
def test_bad_input(kwargs, error, words):
    g = gen(8)
    q, k, v = (randn(2, 4, 10, 8, gen=g) for _ in range(3))
    with pytest.raises(error, match=words.replace("(", r"\(")):
        cs149gpt.attention(q, k, v, **kwargs)


def test_bad_input_ops_and_fake():
    """The op and its fake refuse alike (one shared check)."""
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    for mode in ("eager", "meta"):
        t = (q, k, v) if mode == "eager" else tuple(x.to("meta") for x in (q, k, v))
        with pytest.raises(ValueError, match="softcap"):
            torch.ops.cs149gpt.flash_attention(*t, softcap=-2.0)
        with pytest.raises(ValueError, match="alibi_slopes must have shape"):
            torch.ops.cs149gpt.flash_attention(*t, alibi_slopes=torch.ones(5, device=t[0].device))
