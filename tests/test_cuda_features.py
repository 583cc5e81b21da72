"""The CPU suites' features on CUDA tensors: attn_mask (bool and additive, each broadcast shape), sliding windows,
softcap, ALiBi, dropout, the non-finite rule and the SDPA drop-in's routing — forward and backward, bfloat16 and
float16, head dim 64 and 128 (the tensor-core kernels' instantiations). Skipped where torch sees no GPU.

The definitions are the CPU suites' (test_masks.py and its windows, test_softcap_alibi.py,
test_dropout.py, test_nonfinite.py, test_sdpa_contract.py); the reference is written out from them in float64 on the
GPU. Bars: test_cuda.py's for 16-bit inputs of unit scale (out within 3e-2 for bfloat16, 4e-3 for float16; gradients
within 4e-2 / 1e-2 of the largest reference gradient). Dropout: the CUDA kernels draw the CPU's keep mask for the same
(seed, offset) (cs149gpt._ext.load()._testing.dropout_keep_mask), the pair coming from torch's CUDA generator.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import cs149gpt
from cs149gpt import ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

CUDA = "cuda"
DTYPES = (torch.bfloat16, torch.float16)
DIMS = (64, 128)
CAP = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
GRAD_CAP = {torch.bfloat16: 4e-2, torch.float16: 1e-2}
NEG_INF = float("-inf")
# (B, Hq, Hkv, Nq, Nk): GQA, ragged (no tile multiple), Nq < Nk (a chunked prefill's bottom-right diagonal).
SHAPE = (2, 4, 2, 150, 203)


def rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=CUDA, dtype=torch.float32) * scale).to(dtype)


def make_qkv(dtype, d, seed=0, shape=SHAPE):
    B, Hq, Hkv, Nq, Nk = shape
    return (rand((B, Hq, Nq, d), dtype, seed), rand((B, Hkv, Nk, d), dtype, seed + 1),
            rand((B, Hkv, Nk, d), dtype, seed + 2))


def reference(q, k, v, *, scale=None, causal=False, attn_mask=None, window=None, softcap=0.0, alibi=None,
              keep=None, p=0.0):
    """(out, lse) in float64 from the definitions (attention()'s docstring): c(scale · q kᵀ) [− slope·|i + Nk − Nq − j|]
    [+ additive mask], keys hidden by a bool mask, the causal mask and the window; a row that sees no key gets 0 and
    lse −inf; dropout multiplies the weights by keep / (1 − p). Differentiable in q, k, v."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0.0:
        s = softcap * torch.tanh(s / softcap)
    n_q, n_k = s.shape[-2:]
    row = torch.arange(n_q, device=q.device)[:, None]
    diag = row + (n_k - n_q)  # each row's bottom-right diagonal
    j = torch.arange(n_k, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.double().reshape(*([1] if alibi.dim() == 1 else [alibi.shape[0]]), alibi.shape[-1], 1, 1)
        s = s - slopes * (diag - j).abs()
    hidden = torch.zeros(s.shape, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            hidden = hidden | ~attn_mask
        else:
            s = s + attn_mask.double()
    if causal:
        hidden = hidden | (j > (row if causal in (True, "top_left") else diag))
    if window is not None:
        left, right = window
        if left >= 0:
            hidden = hidden | (j < diag - left)
        if right >= 0:
            hidden = hidden | (j > diag + right)
    s = s.masked_fill(hidden, NEG_INF)
    seen = (s > NEG_INF).any(-1, keepdim=True)
    s = torch.where(seen, s, 0.0)
    lse = torch.where(seen[..., 0], torch.logsumexp(s, dim=-1), NEG_INF)
    weights = torch.softmax(s, dim=-1) * seen
    if keep is not None:
        weights = weights * keep.to(weights.device).double() / (1 - p)
    return weights @ v, lse


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_forward(out, lse, want, want_lse, dtype, what):
    assert out.dtype == dtype and out.shape == want.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = max_err(out, want)
    assert err <= CAP[dtype], f"{what}: out max abs error {err:.3g} > {CAP[dtype]}"
    if lse is not None:
        live = torch.isfinite(want_lse)
        assert torch.equal(torch.isneginf(lse), ~live), f"{what}: lse is −inf where a row sees no key, only there"
        assert max_err(lse[live], want_lse[live]) <= 1e-2, f"{what}: lse"


def check_gradients(fn, ref_fn, q, k, v, dtype, what, seed=99):
    """dq, dk, dv of fn against float64 autograd of ref_fn, relative to the largest reference gradient."""
    dout = rand(q.shape, dtype, seed)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves).backward(dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_fn(*ref_leaves).backward(dout.double())
    scale = max(t.grad.abs().max().item() for t in ref_leaves) + 1e-6
    for name, got, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert got.grad.dtype == dtype and got.grad.shape == ref.grad.shape, f"{what} {name}"
        assert torch.isfinite(got.grad).all(), f"{what} {name}: non-finite"
        err = max_err(got.grad, ref.grad) / scale
        assert err <= GRAD_CAP[dtype], f"{what} {name}: relative max error {err:.3g} > {GRAD_CAP[dtype]}"


def kernel_names(fn):
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def ours(name):
    """One of our kernels: every kernel of csrc/cuda lives in namespace cs149gpt::cuda (aten's FlashAttention is
    pytorch_flash::flash_fwd_kernel, its memory-efficient one fmha_cutlass*, cuDNN's *sdpa*)."""
    return "cs149gpt::cuda" in name


def torch_attention(name):
    n = name.lower()
    return not ours(name) and any(w in n for w in ("fmha", "flash", "sdpa", "attention"))


# ---------------------------------------------------------------------------------------------------------
# attn_mask: every broadcast shape, bool and additive (test_masks.py)
# ---------------------------------------------------------------------------------------------------------
def masks(dtype, seed=7, shape=SHAPE):
    """{name: mask} for (B, Hq, Nq, Nk) scores: the shapes models pass."""
    B, Hq, _, Nq, Nk = shape
    g = torch.Generator(device=CUDA).manual_seed(seed)
    lengths = [Nk, Nk // 3]  # row 1: its first Nk − Nk // 3 keys are padding (left padding)
    keys = torch.arange(Nk, device=CUDA)
    padding = torch.stack([keys >= Nk - n for n in lengths])[:, None, None, :]  # (B, 1, 1, Nk)
    causal = keys[None, :] <= torch.arange(Nq, device=CUDA)[:, None] + (Nk - Nq)
    additive = torch.randn(1, Hq, Nq, Nk, generator=g, device=CUDA)
    additive = additive.masked_fill(torch.rand(1, Hq, Nq, Nk, generator=g, device=CUDA) < 0.2, NEG_INF)
    return {
        "(Nq,Nk) bool scattered": torch.rand(Nq, Nk, generator=g, device=CUDA) < 0.7,
        "(B,1,1,Nk) bool key padding": padding,
        "(B,1,Nq,Nk) bool padded causal": padding & causal,
        "(B,1,1,Nk) additive 0/-inf float32": torch.where(padding, 0.0, NEG_INF),
        "(1,H,Nq,Nk) additive float32": additive,
        "(B,H,Nq,Nk) additive in q's dtype": torch.randn(B, Hq, Nq, Nk, generator=g, device=CUDA).to(dtype),
        "(B,H,Nq,Nk) bool, rows with no key": torch.rand(B, Hq, Nq, Nk, generator=g, device=CUDA) < 0.01,
    }


MASK_NAMES = ["(Nq,Nk) bool scattered", "(B,1,1,Nk) bool key padding", "(B,1,Nq,Nk) bool padded causal",
              "(B,1,1,Nk) additive 0/-inf float32", "(1,H,Nq,Nk) additive float32", "(B,H,Nq,Nk) additive in q's dtype",
              "(B,H,Nq,Nk) bool, rows with no key"]  # masks()'s keys


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_forward(dtype, d, mask_name, causal, forward_path):
    q, k, v = make_qkv(dtype, d, seed=d)
    mask = masks(dtype)[mask_name]
    out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=causal, return_lse=True)
    want, want_lse = reference(q, k, v, attn_mask=mask, causal=causal)
    check_forward(out, lse, want, want_lse, dtype, f"{mask_name} causal={causal}")
    names = kernel_names(lambda: cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=causal))
    assert any("hopper" in n for n in names) == (forward_path == "hopper"), names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["bool", "additive", "bool (B,1,N,N)"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_padding_over_many_tiles(dtype, kind, causal, forward_path):
    """A padded batch longer than the kernels' tiles: sequences ending inside a tile, on a tile's edge, past half the
    keys, one key long. Key tiles past a sequence's end are never read: NaN there (from the first 128-key boundary past
    the end: both kernels' tiles divide 128) leaves the output finite."""
    B, H, N, d = 5, 4, 700, 128
    q, k, v = make_qkv(dtype, d, seed=5, shape=(B, H, H, N, N))
    lengths = torch.tensor([700, 512, 357, 129, 1], device=CUDA)
    keep = torch.arange(N, device=CUDA)[None, :] < lengths[:, None]  # (B, N)
    if kind == "bool (B,1,N,N)":
        mask = keep[:, None, None, :].expand(B, 1, N, N).contiguous()
    else:
        mask = keep[:, None, None, :] if kind == "bool" else torch.where(keep, 0.0, NEG_INF)[:, None, None, :]
    v_unread = v.clone()
    for b, n in enumerate(lengths.tolist()):
        v_unread[b, :, -(-n // 128) * 128:] = float("nan")
    out, lse = cs149gpt.attention(q, k, v_unread, attn_mask=mask, is_causal=causal, return_lse=True)
    want, want_lse = reference(q, k, v, attn_mask=mask, causal=causal)
    check_forward(out, lse, want, want_lse, dtype, f"{kind} causal={causal}")
    names = kernel_names(lambda: cs149gpt.attention(q, k, v, attn_mask=mask, is_causal=causal))
    assert any("hopper" in n for n in names) == (forward_path == "hopper"), names


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_huge_additive_entries(dtype, forward_path):
    """Additive entries of −1e38 (finite also times log2 e; finfo.min is not, and hides its key: README, Limitations)
    are added, not taken for −inf: a row whose entries are all −1e38 averages its keys, as torch and the CPU do; a row
    with one +inf entry is NaN."""
    q, k, v = make_qkv(dtype, 64, seed=9)
    B, Hq, _, Nq, Nk = SHAPE
    g = torch.Generator(device=CUDA).manual_seed(10)
    mask = torch.where(torch.rand(B, 1, Nq, Nk, generator=g, device=CUDA) < 0.3, -1e38, 0.0)
    mask[0, 0, 5] = -1e38  # every key of row 5 carries −1e38
    out, lse = cs149gpt.attention(q, k, v, attn_mask=mask, return_lse=True)
    want, want_lse = reference(q, k, v, attn_mask=mask)
    check_forward(out, None, want, None, dtype, "entries of -1e38")
    live = torch.ones_like(want_lse, dtype=torch.bool)
    live[0, :, 5] = False
    assert max_err(lse[live], want_lse[live]) <= 1e-2, "lse"
    torch.testing.assert_close(lse[0, :, 5].double(), want_lse[0, :, 5], rtol=1e-6, atol=0)
    names = kernel_names(lambda: cs149gpt.attention(q, k, v, attn_mask=mask))
    assert any("hopper" in n for n in names) == (forward_path == "hopper"), names
    mask[1, 0, 7, 3] = float("inf")
    out = cs149gpt.attention(q, k, v, attn_mask=mask)
    assert torch.isnan(out[1, :, 7]).all() and torch.isfinite(out[1, :, 6]).all()


@pytest.mark.parametrize("scale", [-0.5, 0.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_not_positive(dtype, causal, scale, forward_path):
    """scale <= 0 (torch takes any float): below 0 the largest logit is at the smallest q·k, which the plain kernels'
    max of raw scores would miss; at 0 every logit is 0 (uniform weights), where the plain kernels' exp2(s·scale·log2 e
    − shift) would turn a hidden key's −inf into −inf·0 = NaN. The causal mask's −inf must stay hidden."""
    q, k, v = make_qkv(dtype, 64, seed=8)
    q = q * 4  # logits spread wide enough that a wrong max overflows float16's P
    out, lse = cs149gpt.attention(q, k, v, scale=scale, is_causal=causal, return_lse=True)
    want, want_lse = reference(q, k, v, scale=scale, causal=causal)
    check_forward(out, lse, want, want_lse, dtype, f"scale {scale} causal={causal}")
    check_gradients(lambda a, b, c: cs149gpt.attention(a, b, c, scale=scale, is_causal=causal),
                    lambda a, b, c: reference(a, b, c, scale=scale, causal=causal)[0], q, k, v, dtype, f"scale {scale}")
    names = kernel_names(lambda: cs149gpt.attention(q, k, v, scale=scale, is_causal=causal))
    assert not any("hopper" in n for n in names), "the Hopper kernels decline scale <= 0"


@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mask_backward(dtype, mask_name):
    q, k, v = make_qkv(dtype, 64, seed=3)
    mask = masks(dtype)[mask_name]
    check_gradients(lambda a, b, c: cs149gpt.attention(a, b, c, attn_mask=mask, is_causal=True),
                    lambda a, b, c: reference(a, b, c, attn_mask=mask, causal=True)[0], q, k, v, dtype, mask_name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decoding_rows_with_a_padding_mask(dtype):
    """A generation step: one query row (and a 4-row chunk) against 1000 keys under a (B, 1, Nq, Nk) padding mask."""
    for n_q in (1, 4):
        q, k, v = make_qkv(dtype, 128, seed=11, shape=(3, 8, 2, n_q, 1000))
        keep = torch.ones(3, 1, n_q, 1000, dtype=torch.bool, device=CUDA)
        keep[1, ..., :600] = False
        keep[2, ..., 999:] = False
        out, lse = cs149gpt.attention(q, k, v, attn_mask=keep, return_lse=True)
        want, want_lse = reference(q, k, v, attn_mask=keep)
        check_forward(out, lse, want, want_lse, dtype, f"Nq={n_q}")


# ---------------------------------------------------------------------------------------------------------
# sliding windows (test_flash.py's window tests), softcap and ALiBi (test_softcap_alibi.py)
# ---------------------------------------------------------------------------------------------------------
WINDOWS = [(16, 0), (40, 7), (0, 0), (-1, 30), (100, -1)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_forward_and_backward(dtype, d, window, forward_path):
    q, k, v = make_qkv(dtype, d, seed=21)
    out, lse = cs149gpt.attention(q, k, v, window=window, return_lse=True)
    want, want_lse = reference(q, k, v, window=window)
    check_forward(out, lse, want, want_lse, dtype, f"window={window}")
    pad = masks(dtype)["(B,1,1,Nk) bool key padding"]
    out = cs149gpt.attention(q, k, v, window=window, attn_mask=pad, is_causal="bottom_right")
    check_forward(out, None, reference(q, k, v, window=window, attn_mask=pad, causal="bottom_right")[0], None, dtype,
                  f"window={window} with a padding mask")
    if d == 64:
        check_gradients(lambda a, b, c: cs149gpt.attention(a, b, c, window=window),
                        lambda a, b, c: reference(a, b, c, window=window)[0], q, k, v, dtype, f"window={window}")


def alibi_slopes(shape):
    """ALiBi's geometric slopes 2^(−8(h+1)/H) for each head, (H,) or the batch's rows of them, (B, H)."""
    heads = shape[-1]
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device=CUDA)
    return base if len(shape) == 1 else base * torch.linspace(0.5, 1.5, shape[0], device=CUDA)[:, None]


LOGIT_MODS = {
    "softcap": dict(softcap=5.0, scale=0.5),  # a large scale: logits the cap bends
    "alibi (H,)": dict(alibi=(4,)),
    "alibi (B,H)": dict(alibi=(2, 4)),
    "softcap+alibi+causal": dict(softcap=8.0, alibi=(4,), causal="bottom_right"),
    "alibi+padding mask": dict(alibi=(2, 4), mask="(B,1,Nq,Nk) bool padded causal"),
}


@pytest.mark.parametrize("mods", list(LOGIT_MODS))
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_alibi(dtype, d, mods):
    spec = LOGIT_MODS[mods]
    q, k, v = make_qkv(dtype, d, seed=31)
    slopes = alibi_slopes(spec["alibi"]) if "alibi" in spec else None
    mask = masks(dtype)[spec["mask"]] if "mask" in spec else None
    kwargs = dict(scale=spec.get("scale"), is_causal=spec.get("causal", False), attn_mask=mask)
    ref_kwargs = dict(scale=spec.get("scale"), causal=spec.get("causal", False), attn_mask=mask)
    softcap = spec.get("softcap", 0.0)
    out, lse = cs149gpt.attention(q, k, v, softcap=softcap, alibi_slopes=slopes, return_lse=True, **kwargs)
    want, want_lse = reference(q, k, v, softcap=softcap, alibi=slopes, **ref_kwargs)
    check_forward(out, lse, want, want_lse, dtype, mods)
    check_gradients(lambda a, b, c: cs149gpt.attention(a, b, c, softcap=softcap, alibi_slopes=slopes, **kwargs),
                    lambda a, b, c: reference(a, b, c, softcap=softcap, alibi=slopes, **ref_kwargs)[0], q, k, v,
                    dtype, mods)


# ---------------------------------------------------------------------------------------------------------
# dropout (test_dropout.py): the CPU's generator, (seed, offset) from torch's CUDA generator
# ---------------------------------------------------------------------------------------------------------
def keep_mask(seed, offset, shape, p):
    return cs149gpt._ext.load()._testing.dropout_keep_mask(int(seed), int(offset), list(shape), float(p))


def dropout_call(q, k, v, p, seed, offset, **kwargs):
    return torch.ops.cs149gpt.flash_attention(q, k, v, None, kwargs.get("causal", "none"), None, None,
                                              kwargs.get("attn_mask"), -1, -1, p,
                                              torch.tensor([seed, offset], dtype=torch.int64))


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_keeps_the_cpu_generators_entries(dtype, d):
    """Same (seed, offset), same keep mask as the CPU kernels, entry for entry: with q = 0 every weight is 1/Nk, and
    with v the identity (Nk = d) out·Nk·(1 − p) is the keep mask itself (exact in 16 bits)."""
    B, H, Nq, Nk, p = 2, 3, 77, d, 0.5
    q = torch.zeros(B, H, Nq, d, dtype=dtype, device=CUDA)
    k = rand((B, H, Nk, d), dtype, 1)
    v = torch.eye(d, dtype=dtype, device=CUDA).expand(B, H, Nk, d).contiguous()
    for seed, offset in ((12345, 0), (-7, 2**40 + 3), (2**62, 17)):
        out, _ = dropout_call(q, k, v, p, seed, offset)
        got = out.double() * Nk * (1 - p)
        keep = keep_mask(seed, offset, (B, H, Nq, Nk), p).to(CUDA)
        assert (got - keep.double()).abs().max().item() < 1e-2, (seed, offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_forward_given_the_mask(dtype):
    """out = (P ∘ keep / (1 − p)) V and lse of the undropped P, with attn_mask, causal, GQA."""
    q, k, v = make_qkv(dtype, 64, seed=41)
    pad = masks(dtype)["(B,1,Nq,Nk) bool padded causal"]
    for p in (0.1, 0.5):
        for attn_mask, causal in ((None, "none"), (None, "bottom_right"), (pad, "none"), (pad, "top_left")):
            seed, offset = 1000 + int(p * 10), 77
            out, lse = dropout_call(q, k, v, p, seed, offset, attn_mask=attn_mask, causal=causal)
            keep = keep_mask(seed, offset, (*q.shape[:-1], k.shape[-2]), p)
            want, want_lse = reference(q, k, v, attn_mask=attn_mask, causal=False if causal == "none" else causal,
                                       keep=keep, p=p)
            check_forward(out, lse, want, want_lse, dtype, f"p={p} mask={attn_mask is not None} causal={causal}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_gradients_and_the_cuda_generator(dtype):
    """attention(dropout_p=...) on CUDA: the (seed, offset) is the CUDA generator's seed and offset, read before the
    call (ops._next_dropout_seed); the offset then moves past the call's B·H·Nq·Nk counters; the gradients match
    float64 autograd of the reference given that keep mask (the backward regenerates it)."""
    q, k, v = make_qkv(dtype, 64, seed=43)
    counters = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    for p, kwargs in ((0.2, {}), (0.6, {"is_causal": True}), (0.3, {"window": (20, 5)})):
        torch.manual_seed(31)
        seed, offset = ops._next_dropout_seed(q.device)
        assert offset == generator.get_offset() and seed % 2**64 == generator.initial_seed()
        keep = keep_mask(seed, offset, (*q.shape[:-1], k.shape[-2]), p)
        torch.manual_seed(31)
        ref_kwargs = {"causal": kwargs.get("is_causal", False), "window": kwargs.get("window")}
        check_gradients(lambda a, b, c: cs149gpt.attention(a, b, c, dropout_p=p, **kwargs),
                        lambda a, b, c: reference(a, b, c, keep=keep, p=p, **ref_kwargs)[0], q, k, v, dtype,
                        f"p={p} {kwargs}")
        assert generator.get_offset() >= offset + counters and generator.get_offset() % 4 == 0


def test_dropout_manual_seed_reproduces_and_the_generator_moves_on():
    q, k, v = make_qkv(torch.bfloat16, 128, seed=45)
    torch.manual_seed(5)
    a = cs149gpt.attention(q, k, v, dropout_p=0.25)
    b = cs149gpt.attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(5)
    assert torch.equal(cs149gpt.attention(q, k, v, dropout_p=0.25), a)
    assert not torch.equal(a, b)
    torch.cuda.manual_seed(6)  # the CUDA generator alone decides
    assert not torch.equal(cs149gpt.attention(q, k, v, dropout_p=0.25), a)


def test_dropout_is_unbiased():
    """The mean of out over 300 draws approaches attention without dropout (within 5 standard errors + bf16's
    rounding of each draw)."""
    q, k, v = make_qkv(torch.bfloat16, 64, seed=47, shape=(1, 2, 2, 6, 10))
    outs = torch.stack([cs149gpt.attention(q, k, v, dropout_p=0.3) for _ in range(300)]).double()
    want, _ = reference(q, k, v)
    sem = outs.std(0) / math.sqrt(outs.shape[0])
    assert ((outs.mean(0) - want).abs() <= 5 * sem + 2e-2).all()
    assert (outs.std(0) > 0).all()


# ---------------------------------------------------------------------------------------------------------
# the non-finite rule with masks (test_nonfinite.py; README's table)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_rule_with_masks_and_windows(dtype):
    """A key attn_mask or the window hides has no effect whatever its k and v hold (the reference: those entries
    zeroed); a NaN or +inf among a row's visible logits, or in an additive mask at a shown key, makes that row NaN
    (lse NaN); the other rows keep their values."""
    q, k, v = make_qkv(dtype, 64, seed=51, shape=(1, 2, 2, 40, 60))
    clean_k, clean_v = k.clone(), v.clone()
    # (k only: an inf in a hidden key's v reaches the rows that see its tile, P = 0 times inf; README, Limitations)
    k[0, :, 55, 0], k[0, :, 57, 3] = float("nan"), float("inf")
    keep = torch.ones(1, 1, 1, 60, dtype=torch.bool, device=CUDA)
    keep[..., 50:] = False  # hides keys 55 and 57
    out, lse = cs149gpt.attention(q, k, v, attn_mask=keep, return_lse=True)
    want, want_lse = reference(q, clean_k, clean_v, attn_mask=keep)
    check_forward(out, lse, want, want_lse, dtype, "NaN/inf in keys the mask hides")
    # The window (3, 0), bottom-right: row i sees keys i + 17 .. i + 20, so rows below 35 never see key 55 or 57.
    out, lse = cs149gpt.attention(q, k, v, window=(3, 0), return_lse=True)
    want, want_lse = reference(q, clean_k, clean_v, window=(3, 0))
    check_forward(out[..., :35, :], lse[..., :35], want[..., :35, :], want_lse[..., :35], dtype,
                  "NaN/inf in keys the window hides")
    assert lse[0, :, 35:39].isnan().all() and out[0, :, 35:39].isnan().all()  # rows that see key 55 (NaN logit)
    additive = torch.zeros(1, 1, 40, 60, device=CUDA).masked_fill(~keep, NEG_INF)
    additive[0, 0, 7, 2] = float("nan")
    additive[0, 0, 9, 4] = float("inf")
    out, lse = cs149gpt.attention(q, k, v, attn_mask=additive, return_lse=True)
    bad = torch.zeros(40, dtype=torch.bool, device=CUDA)
    bad[7] = bad[9] = True
    assert out[0, :, bad].isnan().all() and lse[0, :, bad].isnan().all()
    assert out[0, :, ~bad].isfinite().all() and lse[0, :, ~bad].isfinite().all()


# ---------------------------------------------------------------------------------------------------------
# the SDPA drop-in's routing on CUDA (test_sdpa_contract.py)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_name", [None, *MASK_NAMES])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_sdpa_with_masks_and_dropout_runs_ours(mask_name, dropout_p):
    """scaled_dot_product_attention on CUDA bf16 tensors with any of the masks, with or without dropout, is ours
    (uses_our_kernel, and only our kernels in the profile, forward and backward); without dropout it gives the
    float64 reference's answer."""
    dtype = torch.bfloat16
    q, k, v = make_qkv(dtype, 128, seed=61)
    mask = None if mask_name is None else masks(dtype)[mask_name]
    kwargs = dict(attn_mask=mask, dropout_p=dropout_p, enable_gqa=True)
    assert cs149gpt.uses_our_kernel(q, k, v, **kwargs)
    with torch.no_grad():
        names = kernel_names(lambda: cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs))
    assert any(ours(n) for n in names) and not any(torch_attention(n) for n in names), names
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    names = kernel_names(lambda: cs149gpt.scaled_dot_product_attention(*leaves, **kwargs).sum().backward())
    assert sum("flash_bwd" in n and ours(n) for n in names) >= 1 and not any(torch_attention(n) for n in names), names
    if dropout_p == 0.0:
        out = cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs)
        check_forward(out, None, reference(q, k, v, attn_mask=mask)[0], None, dtype, str(mask_name))


def test_sdpa_under_autocast_runs_ours():
    """torch.autocast("cuda", bfloat16) over float32 inputs and a float32 additive mask: as torch's SDPA, all cast to
    bfloat16, then ours (a float32 call on CUDA would be torch's), out in bfloat16."""
    q, k, v = make_qkv(torch.float32, 64, seed=69)
    mask = masks(torch.float32)["(1,H,Nq,Nk) additive float32"]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert cs149gpt.uses_our_kernel(q, k, v, attn_mask=mask, enable_gqa=True)
        names = kernel_names(lambda: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        out = cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert any(ours(n) for n in names) and not any(torch_attention(n) for n in names), names
    bf = [t.to(torch.bfloat16) for t in (q, k, v, mask)]
    check_forward(out, None, reference(*bf[:3], attn_mask=bf[3])[0], None, torch.bfloat16, "autocast")


def test_sdpa_falls_back_to_torch_where_ours_does_not_take_the_call():
    """float32 (the teaching kernel: torch's is faster), head dims but 64/128, a learned mask, a mask on another
    device, dropout 1: torch's SDPA, with torch's result."""
    q, k, v = make_qkv(torch.bfloat16, 64, seed=63, shape=(1, 2, 2, 20, 30))
    cases = [
        ((q.float(), k.float(), v.float()), {}),
        ((q[..., :32], k[..., :32], v[..., :32]), {}),
        ((q, k, v), {"attn_mask": torch.zeros(20, 30, device=CUDA, dtype=torch.bfloat16, requires_grad=True)}),
        ((q, k, v), {"attn_mask": torch.ones(20, 30, dtype=torch.bool)}),
        ((q, k, v), {"dropout_p": 1.0}),
    ]
    # dropout 1 goes to torch, whose cuDNN backend refuses it on this GPU and whose others return zeros
    for args, kwargs in cases:
        assert not cs149gpt.uses_our_kernel(*args, **kwargs), kwargs
        if kwargs.get("attn_mask") is not None and kwargs["attn_mask"].device.type == "cpu":
            continue  # torch refuses a mask on another device; ours hands it the call, and its error
        if kwargs.get("dropout_p") == 1.0:
            continue  # below, with torch's answer or torch's error
        names = kernel_names(lambda: cs149gpt.scaled_dot_product_attention(*args, **kwargs))
        assert not any(ours(n) for n in names), names
    try:
        torch.manual_seed(0)
        theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    except RuntimeError:  # torch's cuDNN refuses p = 1 (and a second such call crashes it): nothing to compare
        return
    torch.manual_seed(0)
    torch.testing.assert_close(cs149gpt.scaled_dot_product_attention(q, k, v, dropout_p=1.0), theirs, rtol=0, atol=0,
                               equal_nan=True)


def test_sdpa_dropout_under_cuda_graph_capture_is_torchs():
    """torch's generator cannot be read inside CUDA graph capture: the drop-in hands dropout calls to torch's SDPA
    there (it draws graph-safely), and attention() says why it cannot."""
    q, k, v = make_qkv(torch.bfloat16, 64, seed=65, shape=(1, 2, 2, 64, 64))
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, both functions
        cs149gpt.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    torch.cuda.synchronize()
    decided = {}
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            decided["ours"] = cs149gpt.uses_our_kernel(q, k, v, dropout_p=0.1)
            out = cs149gpt.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            try:
                cs149gpt.attention(q, k, v, dropout_p=0.1)
            except RuntimeError as e:
                decided["error"] = str(e)
    graph.replay()
    torch.cuda.synchronize()
    assert decided["ours"] is False and "CUDA graph capture" in decided.get("error", "")
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert cs149gpt.uses_our_kernel(q, k, v, dropout_p=0.1)  # outside the capture again


def test_compile_with_masks_and_dropout():
    """torch.compile(fullgraph=True) over a masked, dropped-out call on CUDA: traced (the (seed, offset) draw is the
    CPU's inside a graph), forward and backward run ours."""
    torch._dynamo.reset()
    q, k, v = make_qkv(torch.bfloat16, 64, seed=67)
    pad = masks(torch.bfloat16)["(B,1,1,Nk) bool key padding"]
    f = torch.compile(lambda q, k, v: cs149gpt.attention(q, k, v, attn_mask=pad, dropout_p=0.1, is_causal=True),
                      fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*leaves).sum().backward()
    names = kernel_names(lambda: f(*leaves).sum().backward())
    torch._dynamo.reset()
    assert any(ours(n) and "fwd" in n for n in names) and any(ours(n) and "bwd" in n for n in names), names
    assert all(torch.isfinite(t.grad).all() for t in leaves)


# ---------------------------------------------------------------------------------------------------------
# torch.use_deterministic_algorithms
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def deterministic_mode():
    """Sets torch.use_deterministic_algorithms(True, warn_only=...) for the test (a function of warn_only), restored."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only=False: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def grads(q, k, v, dout, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.autograd.backward(cs149gpt.attention(q, k, v, **kw), dout)
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("spans", [None, "key padding", "window", "random bool"])
@pytest.mark.parametrize("gqa_split", ["1", "0"], ids=["per_query_head", "group_in_block"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 700, 900), (2, 8, 2, 1024, 1024), (2, 4, 2, 900, 500)],
                         ids=["ragged", "gqa", "nq>nk"])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("d", DIMS)
def test_deterministic_backward_repeats_its_bits(d, causal, shape, gqa_split, spans, forward_path, deterministic_mode,
                                                 monkeypatch):
    """Under torch.use_deterministic_algorithms(True) both kernel families add each query tile's dQ blocks in key order:
    repeated calls give the same bits (several key tiles add into every dQ row here), so does batch element 0 alone
    (another grid, other timing), the gradients are the default order's within its rounding and float64's within the
    usual bar. gqa_split=0: a block walks its kv head's query heads (CS149GPT_BWD_GQA_SPLIT). spans: the key-spans
    kernels (a boolean key-padding mask; a window, whose query tiles start at their own first key tiles; a random
    boolean mask, read in partial tiles)."""
    dtype = torch.bfloat16
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", gqa_split)
    B, _, _, Nq, Nk = shape
    q, k, v = make_qkv(dtype, d, seed=7 + d, shape=shape)
    dout = rand(q.shape, dtype, 99)
    kw = dict(is_causal=causal)
    if spans == "key padding":
        kw["attn_mask"] = (torch.arange(Nk, device=CUDA) < torch.tensor([Nk, Nk // 3], device=CUDA)[:B, None])[
            :, None, None, :]
    elif spans == "window":
        kw["window"] = (300, 40)
    elif spans == "random bool":  # (partial tiles: the rows' bits)
        g = torch.Generator(device=CUDA).manual_seed(d)
        kw["attn_mask"] = torch.rand(B, 1, Nq, Nk, generator=g, device=CUDA) < 0.9
    free = grads(q, k, v, dout, **kw)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref, _ = reference(*leaves, causal=causal, attn_mask=kw.get("attn_mask"), window=kw.get("window"))
    # (the float64 matmuls before the switch: cuBLAS is not deterministic)
    torch.autograd.backward(out_ref, dout.double())
    deterministic_mode()
    first = grads(q, k, v, dout, **kw)
    names = kernel_names(lambda: grads(q, k, v, dout, **kw))
    # (FlashAttention-2's deterministic instantiation: its last template argument true)
    kernel = r"flash_bwd_hopper_kernel" if forward_path == "hopper" else r"flash_bwd_kernel<.*, true>\("
    assert any(re.search(kernel, n) for n in names), names
    for _ in range(3):
        again = grads(q, k, v, dout, **kw)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: bits differ between two deterministic calls"
    kw_alone = dict(kw, attn_mask=kw["attn_mask"][:1]) if "attn_mask" in kw else kw
    alone = grads(q[:1], k[:1], v[:1], dout[:1], **kw_alone)
    for name, a, b in zip(("dq", "dk", "dv"), first, alone):
        assert torch.equal(a[:1], b), f"{name}: batch element 0 alone differs from it within the batch"
    scale = max(ref.grad.abs().max().item() for ref in leaves) + 1e-6
    for name, got, want, ref in zip(("dq", "dk", "dv"), first, free, leaves):
        assert max_err(got, want) / scale <= GRAD_CAP[dtype] / 4, name
        assert max_err(got, ref.grad) / scale <= GRAD_CAP[dtype], name


@pytest.mark.parametrize("option", ["dropout", "softcap", "alibi", "bias", "window + softcap"])
def test_deterministic_backward_with_logit_options(option, deterministic_mode):
    """The FlashAttention-2 general kernel (dropout, softcap, ALiBi, a bias mask) under deterministic mode: repeated
    calls (dropout: from the same seed) give the same bits."""
    q, k, v = make_qkv(torch.bfloat16, 64, seed=21, shape=(2, 4, 2, 600, 700))
    dout = rand(q.shape, torch.bfloat16, 22)
    kw = {"dropout": dict(dropout_p=0.2), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi_slopes=torch.rand(4, device=CUDA) * 0.1),
          "bias": dict(attn_mask=rand((1, 4, 600, 700), torch.float32, 23)),
          "window + softcap": dict(window=(200, 0), softcap=5.0)}[option]
    deterministic_mode()

    def run():
        torch.manual_seed(5)  # (dropout's seed and offset)
        return grads(q, k, v, dout, is_causal=True, **kw)

    first = run()
    assert any(re.search(r"flash_bwd_kernel<.*, true>\(", n) for n in kernel_names(run))
    for _ in range(3):
        for name, a, b in zip(("dq", "dk", "dv"), first, run()):
            assert torch.equal(a, b), f"{option} {name}: bits differ between two deterministic calls"


def test_flash_attn_deterministic_flag(deterministic_mode):
    """flash_attn_func(deterministic=True) on CUDA warns where torch's switch is off (the backward reads the switch),
    and not where it is on."""
    import warnings

    from cs149gpt.flash_attn import flash_attn_func

    q, k, v = (t.transpose(1, 2).requires_grad_() for t in make_qkv(torch.bfloat16, 64, seed=5))
    with pytest.warns(UserWarning, match="use_deterministic_algorithms"):
        flash_attn_func(q, k, v, deterministic=True)
    deterministic_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn_func(q, k, v, deterministic=True, causal=True).sum().backward()
