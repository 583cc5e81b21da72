"""cs149gpt.varlen_attention and cs149gpt.flash_attn's varlen functions: packed sequences of different lengths in one
kernel call, against a float64 reference computed sequence by sequence from the definition (FlashAttention's
semantics: causal and window bottom-right in each sequence)."""
import math

import pytest
import torch

import cs149gpt
from cs149gpt.flash_attn import (flash_attn_func, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                 flash_attn_varlen_qkvpacked_func)
from tests._helpers import isa, module  # noqa: F401  (isa: fixture)

TOLS = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# (query length, key length) per sequence: empty ones, one row, Nq < Nk, Nq > Nk (causal rows that see no key), lengths
# that are not whole tiles, and one longer than a tile.
LENGTHS = [(0, 3), (5, 5), (37, 50), (130, 100), (1, 0), (64, 64), (0, 0), (300, 257), (17, 1)]


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def reference(q, k, v, cu_q, cu_k, *, scale, causal=False, window=(-1, -1), keep=None, p=0.0, softcap=0.0,
              slopes=None):
    """(out, lse) in float64, sequence by sequence. keep(b): the (H, Nq, Nk) dropout keep mask of sequence b;
    slopes (H,) or (B, H): ALiBi's, in each sequence."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].double().transpose(0, 1)
        ks = k[cu_k[b]:cu_k[b + 1]].double().transpose(0, 1)
        vs = v[cu_k[b]:cu_k[b + 1]].double().transpose(0, 1)
        group = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        n_q, n_k = qs.shape[1], ks.shape[1]
        s = scale * qs @ ks.transpose(-1, -2)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(n_q)[:, None] + (n_k - n_q)
        j = torch.arange(n_k)[None, :]
        if slopes is not None:
            s = s - (slopes if slopes.dim() == 1 else slopes[b]).double()[:, None, None] * (i - j).abs()
        shown = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal:
            shown &= j <= i
        if window[0] >= 0:
            shown &= j >= i - window[0]
        if window[1] >= 0:
            shown &= j <= i + window[1]
        s = s.masked_fill(~shown, -math.inf)
        lse = torch.logsumexp(s, -1)
        probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        if keep is not None:
            probs = probs * keep(b) / (1.0 - p)
        outs.append((probs @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, -1)


def packed(lengths, heads_q, heads_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = offsets([a for a, _ in lengths]), offsets([b for _, b in lengths])
    q = torch.randn(cu_q[-1], heads_q, d, generator=g).to(dtype)
    k = torch.randn(cu_k[-1], heads_kv, d, generator=g).to(dtype)
    v = torch.randn(cu_k[-1], heads_kv, d, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


def call(q, k, v, cu_q, cu_k, **kw):
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    n_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    n_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    return cs149gpt.varlen_attention(q, k, v, t(cu_q), t(cu_k), n_q, n_k, return_lse=True, **kw)


def check(out, lse, ref_out, ref_lse, tol):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() <= tol
    seen = torch.isfinite(ref_lse)
    assert torch.equal(lse[~seen], ref_lse[~seen].float())  # −inf: a row that sees no key
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-4
    assert torch.all(out[(~seen).transpose(0, 1)] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_every_isa(isa, dtype, causal):
    q, k, v, cu_q, cu_k = packed(LENGTHS, 4, 2, 64, dtype)
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
    check(out, lse, *reference(q, k, v, cu_q, cu_k, scale=1 / 8, causal=causal), TOLS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_every_isa(isa, dtype, causal):
    q, k, v, cu_q, cu_k = packed(LENGTHS[:6], 4, 1, 32, dtype, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = call(q, k, v, cu_q, cu_k, is_causal=causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference(q64, k64, v64, cu_q, cu_k, scale=32 ** -0.5, causal=causal)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    tol = 5 * TOLS[dtype]
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert got.shape == want.shape, name
        assert (got.double() - want).abs().max().item() <= tol, name


@pytest.mark.parametrize("window", [(16, 0), (8, 8), (-1, 4), (0, -1)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_windows_and_gqa(window, heads):
    q, k, v, cu_q, cu_k = packed(LENGTHS, *heads, 48, torch.float32, seed=3)
    for causal in (False, True):
        out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal, window=window)
        check(out, lse, *reference(q, k, v, cu_q, cu_k, scale=48 ** -0.5, causal=causal, window=window), 2e-5)


def test_sequences_match_dense_calls():
    """Each sequence of a packed call gets what a dense call on that sequence alone gets (flash_attn_func), bits
    included: the varlen kernel is the dense kernel, sequence by sequence."""
    q, k, v, cu_q, cu_k = packed([(96, 96), (33, 70), (200, 200)], 4, 2, 64, torch.float32, seed=4)
    out = call(q, k, v, cu_q, cu_k, is_causal=True)[0]
    for b in range(3):
        dense = flash_attn_func(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                                v[None, cu_k[b]:cu_k[b + 1]], causal=True)[0]
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], dense, atol=2e-6, rtol=0)


def test_strided_views_read_in_place():
    """q, k, v as views into one packed (total, 3, H, d) projection, the layout of a fused qkv Linear."""
    qkv = torch.randn(211, 3, 4, 32)
    cu = [0, 100, 101, 211]
    out = flash_attn_varlen_qkvpacked_func(qkv, torch.tensor(cu, dtype=torch.int32), 110, causal=True)
    ref, _ = reference(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, scale=32 ** -0.5, causal=True)
    assert (out.double() - ref).abs().max().item() <= 2e-5
    kv = torch.randn(150, 2, 2, 32)
    q = torch.randn(211, 4, 32)[:, :, :]
    cu_k = [0, 50, 100, 150]
    out = flash_attn_varlen_kvpacked_func(q, kv, torch.tensor(cu, dtype=torch.int32),
                                          torch.tensor(cu_k, dtype=torch.int32), 110, 50)
    ref, _ = reference(q, kv[:, 0], kv[:, 1], cu, cu_k, scale=32 ** -0.5)
    assert (out.double() - ref).abs().max().item() <= 2e-5


def test_flash_attn_varlen_func_returns_flash_attention_values():
    q, k, v, cu_q, cu_k = packed([(20, 30), (7, 3), (40, 40)], 2, 2, 16, torch.float32, seed=5)
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    out, lse, probs = flash_attn_varlen_func(q, k, v, t(cu_q), t(cu_k), 40, 40, causal=True,
                                             return_attn_probs=True)
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, scale=0.25, causal=True)
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    # FlashAttention returns lse +inf for a row that sees no key (here: sequence 1's first 4 rows, causal Nq > Nk).
    assert torch.equal(torch.isinf(lse) & (lse > 0), ~torch.isfinite(ref_lse))
    assert probs.shape == (3, 2, 40, 40)
    for b in range(3):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        rows = probs[b, :, :n_q, :n_k].double()
        vs = v[cu_k[b]:cu_k[b + 1]].double().transpose(0, 1)
        torch.testing.assert_close(rows @ vs, ref_out[cu_q[b]:cu_q[b + 1]].transpose(0, 1), atol=2e-5, rtol=0)
        assert torch.all(probs[b, :, n_q:] == 0) and torch.all(probs[b, :, :, n_k:] == 0)


@pytest.mark.parametrize("lengths", [
    [(30, 40), (0, 5), (64, 64), (9, 9)],
    [(9, 9), (1500, 1400), (3, 1), (1, 3)] + [(1, 2)] * 40,  # run in groups of similar lengths (module.cpp)
])
def test_dropout_follows_its_documented_counters(lengths):
    """Dropout in a packed call: sequence b's keep mask is the dense one at offset + cu_seqlens_q[b]·H·(the longest key
    sequence) (attention.h, sequence_view), however the call groups its sequences — checked exactly, forward and
    backward, against the reference with that mask."""
    m = module()
    q, k, v, cu_q, cu_k = packed(lengths, 2, 2, 16, torch.float32, seed=6)
    seed = torch.tensor([1234, 99], dtype=torch.int64)
    p, heads, max_k = 0.3, 2, max(n for _, n in lengths)
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = torch.ops.cs149gpt.varlen_attention(q, k, v, t(cu_q), t(cu_k), 2000, 2000, None, True, -1, -1, p,
                                                   seed)

    def keep(b):
        offset = (99 + cu_q[b] * heads * max_k + 2**63) % 2**64 - 2**63  # as the kernel's uint64 sum wraps
        shape = [1, heads, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]]
        return m._testing.dropout_keep_mask(1234, offset, shape, p)[0].double()

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = reference(q64, k64, v64, cu_q, cu_k, scale=0.25, causal=True, keep=keep, p=p)
    assert (out.double() - ref).abs().max().item() <= 2e-5
    grad = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max().item() <= 1e-4
    kept = torch.cat([keep(b).flatten() for b in range(len(lengths))])
    assert abs(kept.mean().item() - (1 - p)) < 0.02  # Bernoulli(1 − p) keeps (9,000+ draws)


def test_one_kernel_call_for_every_sequence():
    q, k, v, cu_q, cu_k = packed(LENGTHS, 2, 2, 32, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(q, k, v, cu_q, cu_k, is_causal=True)
    names = [e.name for e in prof.events()]
    assert names.count("cs149gpt::varlen_attention") == 1
    assert not any("scaled_dot_product" in n or "cs149gpt::flash_attention" in n for n in names)


def test_rows_outside_every_sequence_get_zeros():
    q, k, v, _, _ = packed([(10, 10)], 2, 2, 16, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = torch.tensor([2, 6, 8], dtype=torch.int32)  # rows 0, 1 and 8, 9 belong to no sequence
    out, lse = cs149gpt.varlen_attention(q, k, v, cu, cu, 4, 4, return_lse=True)
    assert torch.all(out[:2] == 0) and torch.all(out[8:] == 0) and torch.all(lse[:, 8:] == -math.inf)
    ref, _ = reference(q, k, v, [2, 6, 8], [2, 6, 8], scale=0.25)
    assert (out[2:8].double() - ref).abs().max().item() <= 2e-5
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(dq[8:] == 0) and torch.all(dk[:2] == 0) and torch.all(dv[8:] == 0)


def test_opcheck_and_compile():
    q, k, v, cu_q, cu_k = packed([(12, 12), (5, 9)], 2, 1, 16, torch.float32)
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.cs149gpt.varlen_attention.default,
                          (q, k, v, t(cu_q), t(cu_k), 12, 12, None, True, -1, -1, 0.0, None))
    f = torch.compile(flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    out = f(q, k, v, t(cu_q), t(cu_k), 12, 12, causal=True)
    torch.testing.assert_close(out, flash_attn_varlen_func(q, k, v, t(cu_q), t(cu_k), 12, 12, causal=True))


@pytest.mark.parametrize("cu_q, cu_k, max_q, error, match", [
    ([0, 5, 3], [0, 5, 9], 5, ValueError, r"cu_seqlens_q must not decrease"),
    ([0, 5, 11], [0, 5, 9], 6, ValueError, r"cu_seqlens_q\[-1\] = 11 reaches past the 10 rows of q"),
    ([0, 5, 10], [0, 5, 12], 5, ValueError, r"cu_seqlens_k\[-1\] = 12 reaches past the 10 rows of k and v"),
    ([0, 5, 10], [0, 5, 10], 4, ValueError, r"max_seqlen_q = 4 is less than the longest sequence of cu_seqlens_q, 5"),
    ([-1, 5, 10], [0, 5, 10], 6, ValueError, r"cu_seqlens_q\[0\] must be >= 0"),
    ([0, 5, 10], [0, 10], 5, ValueError, r"cu_seqlens_q and cu_seqlens_k must both be \(batch \+ 1,\)"),
])
def test_bad_offsets_are_refused(cu_q, cu_k, max_q, error, match):
    q = torch.randn(10, 2, 16)
    with pytest.raises(error, match=match):
        cs149gpt.varlen_attention(q, q, q, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                                  max_q, 10)


def test_bad_arguments_are_refused():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        cs149gpt.varlen_attention(q, q, q, cu.long(), cu, 10, 10)
    with pytest.raises(ValueError, match=r"q must be \(total_tokens, heads, head_dim\)"):
        cs149gpt.varlen_attention(q[None], q, q, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="max_seqlen_k = 9 is less than"):
        cs149gpt.varlen_attention(q, q, q, cu, cu, 10, 9)
    with pytest.raises(ValueError, match="heads of q"):
        cs149gpt.varlen_attention(torch.randn(10, 3, 16), q, q, cu, cu, 10, 10)
    with pytest.raises(ValueError, match=r"window"):
        cs149gpt.varlen_attention(q, q, q, cu, cu, 10, 10, window=(-2, 0))
    with pytest.raises(ValueError, match=r"k: expected \(num_blocks, page_block_size, heads_kv, head_dim\)"):
        flash_attn_varlen_func(q, q, q, cu, cu, 10, 10, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_attn_probs_carry_the_dropout_pattern():
    """return_attn_probs with dropout: S_dmask negative where dropped, and out = (kept S_dmask / (1 − p)) v."""
    q, k, v, cu_q, cu_k = packed([(12, 20), (30, 30), (5, 9)], 2, 1, 16, torch.float32, seed=7)
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    torch.manual_seed(11)
    out, _, s = flash_attn_varlen_func(q, k, v, t(cu_q), t(cu_k), 30, 30, dropout_p=0.25, causal=True,
                                       return_attn_probs=True)
    assert (s < 0).any() and (s > 0).any()
    for b in range(3):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        kept = s[b, :, :n_q, :n_k].clamp(min=0).double() / 0.75
        vs = v[cu_k[b]:cu_k[b + 1]].double().transpose(0, 1).repeat_interleave(2, 0)
        torch.testing.assert_close((kept @ vs).transpose(0, 1), out[cu_q[b]:cu_q[b + 1]].double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_softcap_and_alibi_in_each_sequence(isa, dtype, per_sequence):
    """softcap and ALiBi (the distance i + Nk − Nq − j taken in each sequence), forward and backward."""
    lengths = LENGTHS[:6]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 2, 32, dtype, seed=8)
    slopes = torch.rand(len(lengths), 4) if per_sequence else torch.rand(4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=True, softcap=2.5, alibi_slopes=slopes)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, cu_q, cu_k, scale=32 ** -0.5, causal=True, softcap=2.5, slopes=slopes)
    check(out, lse, ref.detach(), ref_lse.detach(), TOLS[dtype])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max().item() <= 5 * TOLS[dtype]


def test_alibi_slopes_shape_is_checked():
    q = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"alibi_slopes must be \(heads,\) or \(batch, heads\) with batch"):
        cs149gpt.varlen_attention(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.ones(3, 2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        cs149gpt.varlen_attention(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes must be float32"):
        cs149gpt.varlen_attention(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skewed_lengths_run_in_groups(dtype):
    """One long sequence beside many one-token ones (a padding-free batch, a serving step): right results, forward and
    backward, and a workspace that follows the tokens, not sequences × the longest (which would be 301 × 3000 rows)."""
    lengths = [(3000, 3000)] + [(1, 1), (1, 4), (2, 1)] * 100
    q, k, v, cu_q, cu_k = packed(lengths, 2, 1, 16, dtype, seed=10)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=True, softcap=20.0)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, cu_q, cu_k, scale=0.25, causal=True, softcap=20.0)
    check(out, lse, ref.detach(), ref_lse.detach(), TOLS[dtype])
    grad = torch.randn(out.shape).to(dtype)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q64, k64, v64), grad.double())):
        assert (g.double() - w).abs().max().item() <= 5 * TOLS[dtype]


def _int32(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


# (name, (q, k, v) shapes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, keywords, exception, message): each message names
# the argument as passed and shows its shape in the packed layout (total, heads, d), never the kernels' (heads, total, d).
BAD_SHAPES = [
    ("q rank", ((1, 10, 4, 16), (10, 2, 16), (10, 2, 16)), None, None, 6, {}, ValueError,
     r"q must be \(total_tokens, heads, head_dim\), the sequences packed one after another, got shape \[1, 10, 4, 16\]"),
    ("v rank", ((10, 4, 16), (10, 2, 16), (10, 32)), None, None, 6, {}, ValueError,
     r"v must be \(total_tokens, heads, head_dim\), the sequences packed one after another, got shape \[10, 32\]"),
    ("heads not dividing", ((10, 3, 16), (10, 2, 16), (10, 2, 16)), None, None, 6, {}, ValueError,
     r"the heads of q \(dim 1\) must be a multiple of those of k and v \(dim 1\), got q \[10, 3, 16\], k \[10, 2, 16\]"),
    ("k head dim", ((10, 4, 16), (10, 2, 8), (10, 2, 16)), None, None, 6, {}, ValueError,
     r"k and v must have head dim d = 16 \(the last dim of q\), got k \[10, 2, 8\], v \[10, 2, 16\]"),
    ("v head dim", ((10, 4, 16), (10, 2, 16), (10, 2, 8)), None, None, 6, {}, ValueError,
     r"k and v must have head dim d = 16 \(the last dim of q\), got k \[10, 2, 16\], v \[10, 2, 8\]"),
    ("head dim 0", ((10, 4, 0), (10, 2, 0), (10, 2, 0)), None, None, 6, {}, ValueError,
     r"head dim d \(the last dim of q\) must be >= 1, got q of shape \[10, 4, 0\]"),
    ("k and v totals", ((10, 4, 16), (10, 2, 16), (9, 2, 16)), None, None, 6, {}, ValueError,
     r"k and v must have the same number of tokens total_k \(dim 0\), got k \[10, 2, 16\], v \[9, 2, 16\]"),
    ("k and v heads", ((10, 4, 16), (10, 2, 16), (10, 1, 16)), None, None, 6, {}, ValueError,
     r"k and v must have the same number of heads \(dim 1\), got k \[10, 2, 16\], v \[10, 1, 16\]"),
    ("no kv heads", ((10, 4, 16), (10, 0, 16), (10, 0, 16)), None, None, 6, {}, ValueError,
     r"k and v must have at least one head \(dim 1\), got k \[10, 0, 16\], v \[10, 0, 16\]"),
    ("cu_seqlens dtype", None, _int32(0, 4, 10).long(), None, 6, {}, TypeError,
     r"cu_seqlens_q must be int32 \(FlashAttention's\), got Long"),
    ("cu_seqlens 2-D", None, None, _int32(0, 4, 10)[None], 6, {}, ValueError,
     r"cu_seqlens_k must be 1-D, \(batch \+ 1,\), got shape \[1, 3\]"),
    ("batch 0", None, _int32(0), _int32(0), 6, {}, ValueError,
     r"cu_seqlens_q must hold batch \+ 1 >= 2 offsets, got shape \[1\]"),
    ("cu_seqlens lengths", None, None, _int32(0, 10), 6, {}, ValueError,
     r"cu_seqlens_q and cu_seqlens_k must both be \(batch \+ 1,\), got \[3\] and \[2\]"),
    ("cu_seqlens decreasing", None, None, _int32(0, 6, 4), 6, {}, ValueError,
     r"cu_seqlens_k must not decrease, got cu_seqlens_k\[1\] = 6 > cu_seqlens_k\[2\] = 4"),
    ("cu_seqlens past the tensor", None, _int32(0, 4, 11), None, 7, {}, ValueError,
     r"cu_seqlens_q\[-1\] = 11 reaches past the 10 rows of q"),
    ("max_seqlen_q too small", None, None, None, 5, {}, ValueError,
     r"max_seqlen_q = 5 is less than the longest sequence of cu_seqlens_q, 6"),
    ("alibi_slopes heads", None, None, None, 6, {"alibi_slopes": torch.ones(3)}, ValueError,
     r"alibi_slopes must be \(heads,\) or \(batch, heads\) with batch = len\(cu_seqlens_q\) - 1 = 2 and heads = 4 "
     r"\(q's dim 1\); got shape \[3\]"),
    ("alibi_slopes batch", None, None, None, 6, {"alibi_slopes": torch.ones(3, 4)}, ValueError,
     r"alibi_slopes must be \(heads,\) or \(batch, heads\) with batch = len\(cu_seqlens_q\) - 1 = 2 and heads = 4 "
     r"\(q's dim 1\); got shape \[3, 4\]"),
]


@pytest.mark.parametrize("entry", ["varlen_attention", "flash_attn_varlen_func"])
@pytest.mark.parametrize("case", BAD_SHAPES, ids=[c[0] for c in BAD_SHAPES])
def test_bad_shapes_name_the_argument_in_its_layout(case, entry):
    _, shapes, cu_q, cu_k, max_q, kwargs, error, message = case
    q, k, v = (torch.randn(s) for s in shapes or ((10, 4, 16), (10, 2, 16), (10, 2, 16)))
    cu_q = _int32(0, 4, 10) if cu_q is None else cu_q
    cu_k = _int32(0, 4, 10) if cu_k is None else cu_k
    f = cs149gpt.varlen_attention if entry == "varlen_attention" else flash_attn_varlen_func
    with pytest.raises(error, match=message if entry == "varlen_attention" or "rank" not in case[0] else
                       message.split(" must be")[0] + r": expected \(total_tokens, heads, head_dim\)"):
        f(q, k, v, cu_q, cu_k, max_q, 6, **kwargs)


@pytest.mark.parametrize("entry", ["varlen_attention", "flash_attn_varlen_func"])
def test_bad_paged_shapes_name_the_argument_in_its_layout(entry):
    """A paged cache's messages show k and v as passed, (num_blocks, page_block_size, heads_kv, d); a block id out of
    range names block_table (IndexError; from flash_attn_varlen_func a RuntimeError too, as FlashAttention's)."""
    f = cs149gpt.varlen_attention if entry == "varlen_attention" else flash_attn_varlen_func
    q, cache, table, cu = torch.randn(10, 3, 16), torch.randn(4, 8, 2, 16), _int32(0, 1, 2, 3, 4)[None], _int32(0, 10)
    with pytest.raises(ValueError, match=r"the heads of q \(dim 1\) must be a multiple of those of k and v \(dim 2\), "
                                         r"got q \[10, 3, 16\], k \[4, 8, 2, 16\]"):
        f(q, cache, cache, cu, cu, 10, 10, block_table=table)
    q = torch.randn(10, 4, 16)
    with pytest.raises(ValueError, match=r"k and v must have head dim d = 16 \(the last dim of q\), got k "
                                         r"\[4, 8, 2, 8\], v \[4, 8, 2, 8\]"):
        f(q, cache[..., :8], cache[..., :8], cu, cu, 10, 10, block_table=table)
    bad = table.clone()
    bad[0, 1] = 4
    errors = (IndexError, RuntimeError) if entry == "flash_attn_varlen_func" else (IndexError,)
    for error in errors:
        with pytest.raises(error, match=r"block_table\[0, 1\] = 4 is not a block of the cache: block ids must be in "
                                        r"\[0, num_blocks = 4\)"):
            f(q, cache, cache, cu, cu, 10, 10, block_table=bad)


@pytest.mark.parametrize("empty", ["queries", "keys", "both"])
def test_empty_packed_batch(empty):
    """total_q or total_k 0 (every sequence empty) runs, as FlashAttention's varlen_fwd/bwd do (they refuse a batch of
    0 sequences only): out (total_q, Hq, d) of zeros where no key is seen, lse −inf there (flash_attn's +inf), zero
    gradients; the forward, the backward and their fakes agree on the shapes."""
    n_q = 0 if empty in ("queries", "both") else 10
    n_k = 0 if empty in ("keys", "both") else 10
    cu_q = _int32(0, 0, 0) if n_q == 0 else _int32(0, 4, 10)
    cu_k = _int32(0, 0, 0) if n_k == 0 else _int32(0, 4, 10)
    q, k, v = torch.randn(n_q, 4, 16), torch.randn(n_k, 2, 16), torch.randn(n_k, 2, 16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = cs149gpt.varlen_attention(q, k, v, cu_q, cu_k, 6, 6, is_causal=True, return_lse=True)
    ref_out, ref_lse = reference(q.detach(), k.detach(), v.detach(), cu_q.tolist(), cu_k.tolist(), scale=0.25,
                                 causal=True)
    assert out.shape == (n_q, 4, 16) and lse.shape == (4, n_q)
    assert torch.equal(out.double(), ref_out) and torch.equal(lse.double(), ref_lse)
    assert torch.all(lse == -math.inf)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not (dq.any() or dk.any() or dv.any())
    _, fa_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, return_attn_probs=True)
    assert torch.all(fa_lse == math.inf) and fa_lse.shape == (4, n_q)
    meta = [t.detach().to("meta") for t in (q, k, v, cu_q, cu_k)]
    m_out, m_lse = torch.ops.cs149gpt.varlen_attention(*meta, 6, 6, causal=True)
    assert m_out.shape == out.shape and m_lse.shape == lse.shape
    grads = torch.ops.cs149gpt.varlen_attention_backward(m_out, *meta[:3], m_out, m_lse, *meta[3:], 6, 6, causal=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    torch.library.opcheck(torch.ops.cs149gpt.varlen_attention.default, (q, k, v, cu_q, cu_k, 6, 6),
                          {"causal": True})


# The backward op: dout, out and lse are checked by the fake (and meta kernel) as by the CPU kernel, one C++ check.
BAD_VARLEN_BACKWARD = [
    ("dout shape", {"dout": (10, 4, 8)}, ValueError, "dout must have the shape of q, [10, 4, 16]; got [10, 4, 8]"),
    ("dout dtype", {"dout_dtype": torch.float64}, TypeError, "dout must have the dtype of q, Float; got Double"),
    ("out shape", {"out": (9, 4, 16)}, ValueError, "out must have the shape of q, [10, 4, 16]; got [9, 4, 16]"),
    ("lse shape", {"lse": (10, 4)}, ValueError, "lse must be (heads, total_q) = (4, 10), got shape [10, 4]"),
    ("lse rank", {"lse": (4, 10, 1)}, ValueError, "lse must be (heads, total_q) = (4, 10), got shape [4, 10, 1]"),
    ("lse dtype", {"lse_dtype": torch.float16}, TypeError, "lse must be float32, got Half"),
    ("k head dim", {"k": (10, 2, 8)}, ValueError, "k and v must have head dim d = 16 (the last dim of q), got k [10, 2, 8]"),
]


def _varlen_backward_args(spec, device="cpu"):
    shapes = {"dout": (10, 4, 16), "q": (10, 4, 16), "k": (10, 2, 16), "v": (10, 2, 16), "out": (10, 4, 16),
              "lse": (4, 10)}
    shapes.update({key: value for key, value in spec.items() if key in shapes})
    t = {name: torch.randn(shape, device=device) for name, shape in shapes.items()}
    t["dout"] = t["dout"].to(spec.get("dout_dtype", torch.float32))
    t["lse"] = t["lse"].to(spec.get("lse_dtype", torch.float32))
    cu = _int32(0, 4, 10).to(device)
    return [t[name] for name in ("dout", "q", "k", "v", "out", "lse")] + [cu, cu]


def _raised(f, *args):
    try:
        f(*args)
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return e
    return None


@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
@pytest.mark.parametrize("case", BAD_VARLEN_BACKWARD, ids=[c[0] for c in BAD_VARLEN_BACKWARD])
def test_backward_fake_checks_dout_out_and_lse(case, mode):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, spec, error, message = case
    op = torch.ops.cs149gpt.varlen_attention_backward
    args = _varlen_backward_args(spec, "meta" if mode == "meta" else "cpu")
    if mode == "fake":
        with FakeTensorMode() as fake:
            e = _raised(op, *(fake.from_tensor(t) for t in args), 6, 6)
    else:
        e = _raised(op, *args, 6, 6)
    assert type(e) is error, repr(e)
    assert message in str(e)
    assert str(e) == str(_raised(op, *_varlen_backward_args(spec), 6, 6))  # word for word


def test_backward_opcheck():
    """The backward op's fake gives the CPU kernel's shapes, strides and dtypes."""
    q, k, v, cu_q, cu_k = packed([(12, 12), (5, 9)], 2, 1, 16, torch.float32)
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=True)
    args = (torch.randn(out.shape), q, k, v, out, lse, _int32(*cu_q), _int32(*cu_k), 12, 12)
    torch.library.opcheck(torch.ops.cs149gpt.varlen_attention_backward.default, args, {"causal": True},
                          test_utils=("test_schema", "test_faketensor"))
