"""Shared by the test files: the float64 reference, the per-ISA fixture, small input builders.

The reference is written out from the definition, softmax(scale · Q Kᵀ + mask) V in float64, independent of
the kernels; test_attention.py checks it once against torch's scaled_dot_product_attention.
"""
import math

import pytest
import torch

import cs149gpt
from cs149gpt import _ext

# Widest first, as dispatch.cpp tries them. amx and avx512_bf16 differ from avx512 only for bfloat16 inputs (and amx
# for float16, and for float32 when set_float32_products("bf16_tiles") asks). amx_emulated, last, is the amx kernels with the tiles done in software (csrc/isa/amx_emulation.h):
# never chosen by itself, it runs the AMX code paths wherever avx512_bf16 runs.
ALL_ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "scalar", "amx_emulated")
# Where bfloat16 runs on bf16 dot-product instructions (flash_bf16.cpp, flash_backward_bf16.cpp).
BF16_DOT_ISAS = ("amx", "avx512_bf16", "amx_emulated")
# Where the float32 forward may run on the bf16 tiles, each operand in three bf16 parts (flash_bf16.cpp).
TILE_ISAS = ("amx", "amx_emulated")

# Max abs error allowed against float64 for unit-scale (torch.randn) inputs.
TOL = 1e-4


def module():
    return _ext.load()


def reference(q, k, v, scale=None, is_causal=False):
    """softmax(scale · q kᵀ, masked) v in float64. q (..., Nq, d), k/v (..., Nk, d); GQA on dim -3."""
    q, k, v = q.double(), k.double(), v.double()
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        visible = torch.ones(n_q, n_k, dtype=torch.bool).tril()  # query i sees keys j <= i (top-left)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def expected_strides(q):
    """The output's strides for query q: torch's CPU SDPA lays its output out as empty_like(q) (dense, in q's order of
    strides: (B, N, H, d) memory for a (B, N, H·d) projection viewed as (B, H, N, d)); ours too, up to 4 dims and
    with head_dim innermost, contiguous otherwise. (test_attention.py checks the rule against torch's own output.)"""
    like = torch.empty_like(q).stride()
    return like if q.dim() <= 4 and like[-1] == 1 else torch.empty(q.shape).stride()


def mismatch(out, q, k, v, *, scale=None, is_causal=False, tol=TOL):
    """None if `out` is a correct attention result for (q, k, v), else a line saying what is wrong."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if out.shape != q.shape:
        return f"output shape {tuple(out.shape)} != q shape {tuple(q.shape)}"
    if out.dtype != torch.float32:
        return f"output dtype {out.dtype}"
    if out.stride() != expected_strides(q):
        return f"output strides {out.stride()}, expected {expected_strides(q)} (laid out as q)"
    if not torch.isfinite(out).all():
        return "output has non-finite values"
    ref = reference(q, k, v, scale=scale, is_causal=is_causal)
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    if not err <= tol:
        return f"max abs error {err:.3g} > {tol:g}"
    return None


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Runs the test with the kernels of one instruction set (skipped where the CPU lacks it); restores the
    original choice afterwards."""
    m = module()
    name = request.param
    if not m._testing.cpu_supports(name):
        pytest.skip(f"this CPU does not run the {name} kernels")
    original = m.isa()
    m._testing.set_isa(name)
    try:
        assert m.isa() == name and cs149gpt.isa() == name
        yield name
    finally:
        m._testing.set_isa(original)


@pytest.fixture(params=["auto", "bf16_tiles"])
def f32_products(request):
    """Runs a float32 test on amx and amx_emulated twice: as the kernels choose (float32 FMAs), and with every
    float32 forward on the bf16 tiles in three parts (set_float32_products), so that every shape, tile, mask and
    dropout case meets that path too. Elsewhere, and for other dtypes, once."""
    params = request.node.callspec.params
    if request.param == "bf16_tiles" and (params.get("isa") not in TILE_ISAS
                                          or params.get("dtype", torch.float32) != torch.float32):
        pytest.skip("float32 takes the bf16 tiles only on amx and amx_emulated")
    m = module()
    m.set_float32_products(request.param)
    try:
        yield request.param
    finally:
        m.set_float32_products("auto")


@pytest.fixture(params=["one_pass", "one_pass_chunked", "two_pass"])
def backward_path(request):
    """Runs the test with one backward algorithm forced: one pass (flash_backward_onepass.cpp and, for bf16 on amx
    and avx512_bf16, flash_backward_bf16.cpp: a task per (batch, kv head)), the same with each kv head's keys split
    into 3 tasks whose partial dq join the kv head's sum in turn and, float32 with an even GQA group, its query heads
    in 2 parts whose dk, dv shares are added in turn, or two passes (flash_backward.cpp); "auto" leaves the choice,
    runs and parts to heuristics.h, which picks by shape and CPU count, so on any one machine some shapes would only
    ever meet one of them."""
    m = module()
    m._testing.set_backward_path(request.param if request.param in ("auto", "two_pass") else "one_pass")
    m._testing.set_backward_key_chunks(3 if request.param == "one_pass_chunked" else 0)
    m._testing.set_backward_head_parts({"one_pass_chunked": 2, "auto": 0}.get(request.param, 1))
    try:
        yield request.param
    finally:
        m._testing.set_backward_path("auto")
        m._testing.set_backward_key_chunks(0)
        m._testing.set_backward_head_parts(0)


def visible_mask(n_q, n_k, is_causal):
    """Bool (n_q, n_k): query i sees key j. None when nothing is masked."""
    if is_causal is False:
        return None
    offset = 0 if is_causal in (True, "top_left") else n_k - n_q  # bottom_right: j <= i + Nk − Nq
    return torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + offset


def scaled_scores(q, k, v, scale=None):
    """(scale · q kᵀ, v) with GQA expanded by repeat_interleave on dim -3 (autograd then sums dk/dv per group);
    scale None means 1/sqrt(d). The references build their softmax on this."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    return (q @ k.transpose(-1, -2)) * scale, v


def padded_batch(vocab, lengths, n, side, seed=0, low=1):
    """input_ids (B, n), ids in [low, vocab), and attention_mask with each row's `length` tokens on the right (left
    padding) or the left (right padding); on the CPU."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        if side == "left":
            mask[i, n - length:] = 1
        else:
            mask[i, :length] = 1
    return ids, mask


def check_window_wider_than_every_sequence(window, device, dtype):
    """attention_with_kvcache with a window bound past every key (sys.maxsize meaning "no bound") equals the call with
    that side open (window=None where both are), causal or not, bit for bit: never an int64 overflow that hides keys;
    a sequence shorter than Nq − 1 included. The CPU's and CUDA's kvcache tests share it."""
    g = torch.Generator().manual_seed(1300)
    q = torch.randn(2, 4, 3, 64, generator=g).to(device, dtype)
    k, v = (torch.randn(2, 2, 40, 64, generator=g).to(device, dtype) for _ in range(2))
    seqlens = torch.tensor([40, 1], dtype=torch.int32, device=device)
    open_sides = tuple(-1 if bound > 1000 else bound for bound in window)
    for causal in (False, True):
        want = cs149gpt.attention_with_kvcache(q, k, v, seqlens, is_causal=causal,
                                               window=None if open_sides == (-1, -1) else open_sides)
        got = cs149gpt.attention_with_kvcache(q, k, v, seqlens, is_causal=causal, window=window)
        assert torch.equal(got, want), (causal, window)
