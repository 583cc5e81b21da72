"""cs149gpt.flash_attn against FlashAttention 2.x's documented semantics, written here in float64.

Covered: FlashAttention's (batch, seqlen, heads, d) layout in and out, bottom-right causal and window_size as
FlashAttention defines them (seqlen_q != seqlen_k both ways), MHA/GQA/MQA, float32 and bfloat16, the qkv- and
kv-packed variants (gradients reaching the packed tensor), softmax_lse's shape and values (+inf for a row that sees
no key), the attention probabilities of return_attn_probs, gradients of flash_attn_func against float64 autograd,
flash_attn_with_kvcache on contiguous and paged caches with appends (the caches' contents checked after; its other
options in test_flash_attn_kvcache.py), and every option that is not served raising NotImplementedError naming its
argument.
"""
import math

import pytest
import torch

from cs149gpt.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                 flash_attn_varlen_func, flash_attn_with_kvcache)
from tests._helpers import gen

F32_TOL = 1e-4
# bfloat16 against float64 on the same (upcast) inputs, norm-relative: the output's rounding (2^-8) plus, on the
# bf16 dot-product ISAs, P rounded to bf16 before P·V.
BF16_REL_TOL = 2 * 2.0**-8
GRAD_TOL = 1e-4


def visible(n_q, n_k, causal, window_size):
    """(Nq, Nk) bool: FlashAttention's rule, query i's diagonal at i + Nk - Nq; -1 leaves a side unbounded."""
    i = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)
    j = torch.arange(n_k).unsqueeze(0)
    left, right = window_size
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def reference(q, k, v, causal=False, window_size=(-1, -1), scale=None):
    """FlashAttention layout, float64: q (B, Sq, H, d), k/v (B, Sk, Hkv, d) -> out (B, Sq, H, d), lse (B, H, Sq),
    probs (B, H, Sq, Sk). A row that sees no key: out 0, lse +inf, probs 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~visible(q.shape[1], k.shape[1], causal, window_size), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, torch.where(torch.isneginf(lse), float("inf"), lse), probs


def assert_close(out, want, dtype):
    assert out.shape == want.shape and out.dtype == dtype
    if dtype == torch.float32:
        err = (out.double() - want).abs().max().item() if out.numel() else 0.0
        assert err <= F32_TOL, f"max abs error {err:.3g}"
    else:
        rel = ((out.double() - want).norm() / want.norm()).item()
        assert rel <= BF16_REL_TOL, f"norm-relative error {rel:.3g}"


def inputs(b, s_q, s_k, h, h_kv, d, dtype, seed=0):
    g = gen(seed)
    q = torch.randn(b, s_q, h, d, generator=g).to(dtype)
    k = torch.randn(b, s_k, h_kv, d, generator=g).to(dtype)
    v = torch.randn(b, s_k, h_kv, d, generator=g).to(dtype)
    return q, k, v


CASES = [  # (Sq, Sk, H, Hkv, causal, window_size)
    (37, 53, 4, 4, False, (-1, -1)),
    (37, 53, 4, 2, True, (-1, -1)),
    (53, 37, 4, 1, True, (-1, -1)),  # Sq > Sk: the first 16 rows see no key
    (40, 40, 6, 2, False, (5, 3)),
    (29, 61, 4, 1, True, (7, -1)),
    (61, 29, 2, 2, False, (-1, 0)),
    (64, 48, 4, 2, False, (0, 0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("s_q,s_k,h,h_kv,causal,window_size", CASES)
def test_flash_attn_func(s_q, s_k, h, h_kv, causal, window_size, dtype):
    q, k, v = inputs(2, s_q, s_k, h, h_kv, 32, dtype)
    want, want_lse, want_probs = reference(q, k, v, causal, window_size)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    assert out.shape == (2, s_q, h, 32)
    assert_close(out, want, dtype)
    out2, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window_size, return_attn_probs=True)
    assert torch.equal(out2, out)
    assert lse.shape == (2, h, s_q) and lse.dtype == torch.float32
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want_lse)) and not torch.isneginf(lse).any()
    live = torch.isfinite(want_lse)
    assert (lse.double()[live] - want_lse[live]).abs().max().item() <= 1e-4 * max(1.0, want_lse[live].abs().max())
    assert probs.shape == (2, h, s_q, s_k)
    assert (probs.double() - want_probs).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_flash_attn_func_scale_and_lse_of_dead_rows():
    q, k, v = inputs(1, 20, 8, 2, 2, 16, torch.float32, seed=1)
    want, want_lse, _ = reference(q, k, v, causal=True, scale=0.3)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, return_attn_probs=True)
    assert_close(out, want, torch.float32)
    assert torch.isposinf(lse[..., :12]).all() and (out[:, :12] == 0).all()  # rows 0..11 see no key
    assert torch.allclose(lse[..., 12:].double(), want_lse[..., 12:], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkvpacked_and_kvpacked(dtype):
    g = gen(2)
    qkv = torch.randn(2, 33, 3, 4, 16, generator=g).to(dtype)
    want, _, _ = reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, window_size=(6, -1))
    assert_close(flash_attn_qkvpacked_func(qkv, causal=True, window_size=(6, -1)), want, dtype)
    q = torch.randn(2, 21, 4, 16, generator=g).to(dtype)
    kv = torch.randn(2, 45, 2, 2, 16, generator=g).to(dtype)
    want, _, _ = reference(q, kv[:, :, 0], kv[:, :, 1], causal=True)
    assert_close(flash_attn_kvpacked_func(q, kv, causal=True), want, dtype)


@pytest.mark.parametrize("s_q,s_k,h,h_kv,causal,window_size", [CASES[1], CASES[2], CASES[4]])
def test_gradients(s_q, s_k, h, h_kv, causal, window_size):
    q, k, v = inputs(2, s_q, s_k, h, h_kv, 16, torch.float32, seed=3)
    dout = torch.randn(2, s_q, h, 16, generator=gen(4))
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*ours, causal=causal, window_size=window_size).backward(dout)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*exact, causal=causal, window_size=window_size)[0].backward(dout.double())
    for name, a, b in zip("qkv", ours, exact):
        err = (a.grad.double() - b.grad).abs().max().item()
        assert err <= GRAD_TOL, f"d{name}: max abs error {err:.3g}"


def test_qkvpacked_gradient_reaches_the_packed_tensor():
    qkv = torch.randn(1, 24, 3, 2, 16, generator=gen(5))
    dout = torch.randn(1, 24, 2, 16, generator=gen(6))
    ours = qkv.clone().requires_grad_()
    flash_attn_qkvpacked_func(ours, causal=True).backward(dout)
    exact = qkv.double().requires_grad_()
    reference(exact[:, :, 0], exact[:, :, 1], exact[:, :, 2], causal=True)[0].backward(dout.double())
    assert (ours.grad.double() - exact.grad).abs().max().item() <= GRAD_TOL


def test_dropout_keeps_the_expectation():
    """dropout_p reaches the kernel: the output differs from p = 0, and the mean over draws approaches it."""
    q, k, v = inputs(1, 16, 16, 2, 2, 16, torch.float32, seed=7)
    want, _, _ = reference(q, k, v)
    torch.manual_seed(0)
    draws = torch.stack([flash_attn_func(q, k, v, dropout_p=0.3) for _ in range(400)])
    assert (draws[0].double() - want).abs().max() > 1e-2
    assert (draws.mean(0).double() - want).abs().max().item() < 0.1


def kv_cache_reference(q, k_cache, v_cache, lengths, causal):
    """(B, Sq, H, d) float64: batch b's queries against keys [0, lengths[b]) of its logical cache
    (B, S_cache, Hkv, d), bottom-right causal."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        outs.append(reference(q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n], causal)[0])
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("s_q,causal", [(1, True), (5, True), (5, False)])
def test_kvcache_with_appends(paged, s_q, causal, dtype):
    g = gen(8)
    B, h, h_kv, d, cap, page = 3, 4, 2, 16, 48, 8
    lengths = torch.tensor([0, 17, 40], dtype=torch.int32)
    logical_k = torch.randn(B, cap, h_kv, d, generator=g).to(dtype)
    logical_v = torch.randn(B, cap, h_kv, d, generator=g).to(dtype)
    q = torch.randn(B, s_q, h, d, generator=g).to(dtype)
    k_new = torch.randn(B, s_q, h_kv, d, generator=g).to(dtype)
    v_new = torch.randn(B, s_q, h_kv, d, generator=g).to(dtype)
    if paged:
        blocks_per_seq = cap // page
        perm = torch.randperm(B * blocks_per_seq + 2, generator=g)[:B * blocks_per_seq]  # shuffled, 2 spare
        block_table = perm.view(B, blocks_per_seq).to(torch.int32)
        k_cache = torch.zeros(B * blocks_per_seq + 2, page, h_kv, d, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        k_cache[block_table.flatten().long()] = logical_k.reshape(-1, page, h_kv, d)
        v_cache[block_table.flatten().long()] = logical_v.reshape(-1, page, h_kv, d)
    else:
        block_table = None
        k_cache, v_cache = logical_k.clone(), logical_v.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths,
                                  block_table=block_table, causal=causal)
    want_k, want_v = logical_k.clone(), logical_v.clone()
    for b in range(B):
        n = int(lengths[b])
        want_k[b, n:n + s_q], want_v[b, n:n + s_q] = k_new[b], v_new[b]
    if paged:
        got_k = k_cache[block_table.flatten().long()].reshape(B, cap, h_kv, d)
        got_v = v_cache[block_table.flatten().long()].reshape(B, cap, h_kv, d)
    else:
        got_k, got_v = k_cache, v_cache
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # appended in place, nothing else touched
    assert out.shape == (B, s_q, h, d)
    assert_close(out, kv_cache_reference(q, want_k, want_v, lengths + s_q, causal), dtype)
    # cache_seqlens as an int; None reads the whole cache
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20, block_table=block_table, causal=causal)
    assert_close(out, kv_cache_reference(q, want_k, want_v, [20] * B, causal), dtype)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, block_table=block_table, causal=causal)
    assert_close(out, kv_cache_reference(q, want_k, want_v, [cap] * B, causal), dtype)


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_and_alibi(slopes_shape, causal):
    """FlashAttention's definitions: softcap · tanh(scale·s / softcap), then −slope·|i + Nk − Nq − j|; the three
    dense functions, out, lse and the probabilities, and gradients."""
    q, k, v = inputs(2, 9, 13, 4, 2, 16, torch.float32)
    slopes = torch.rand(slopes_shape) * 0.5
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, softcap=3.0, alibi_slopes=slopes,
                                      return_attn_probs=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64.repeat_interleave(2, dim=2)) * 0.25
    s = 3.0 * torch.tanh(s / 3.0)
    i = torch.arange(9)[:, None] + 13 - 9
    j = torch.arange(13)[None, :]
    s = s - slopes.double().reshape(-1 if len(slopes_shape) == 2 else 1, 4, 1, 1) * (i - j).abs()
    if causal:
        s = s.masked_fill(j > i, float("-inf"))
    p = torch.softmax(s, -1)
    ref = torch.einsum("bhqk,bkhd->bqhd", p, v64.repeat_interleave(2, dim=2))
    assert (out.double() - ref).abs().max() < 1e-5
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-5
    assert (probs.double() - p).abs().max() < 1e-5
    g = torch.randn(out.shape)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q64, k64, v64), g.double())):
        assert (got.double() - want).abs().max() < 1e-4
    packed = flash_attn_qkvpacked_func(torch.stack([q, q, q], dim=2).detach(), softcap=3.0, alibi_slopes=slopes)
    kvp = flash_attn_kvpacked_func(q.detach(), torch.stack([q, q], dim=2).detach(), softcap=3.0, alibi_slopes=slopes)
    torch.testing.assert_close(packed, kvp)


def test_block_table_errors_are_runtime_errors_too():
    """FlashAttention raises RuntimeError for a block table too short or out of range; ours are ValueError/IndexError,
    and through cs149gpt.flash_attn both at once."""
    q = torch.randn(1, 1, 1, 64)
    k_cache = v_cache = torch.zeros(4, 256, 1, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match="block_table"):
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([257], dtype=torch.int32),
                                    block_table=table)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([256], dtype=torch.int32),
                                  block_table=table)  # exactly the capacity: fine
    assert out.shape == (1, 1, 1, 64)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    for error in (RuntimeError, IndexError):
        with pytest.raises(error, match="block_table"):
            flash_attn_varlen_func(q[0], k_cache, v_cache, cu, torch.tensor([0, 3], dtype=torch.int32), 1, 3,
                                   block_table=torch.full((1, 1), 9, dtype=torch.int32))
