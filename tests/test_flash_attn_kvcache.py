"""cs149gpt.flash_attn.flash_attn_with_kvcache against FlashAttention 2.x's documented semantics, in float64.

The reference follows FlashAttention's own test of this function: q and the new k rotated (at cache_seqlens + i, or
all of q at cache_seqlens when neither causal nor windowed), the cache updated at rows [cache_seqlens,
cache_seqlens + seqlen_new), then attention over each sequence's keys [cache_leftpad, cache_seqlens + seqlen_new),
counted from cache_leftpad, causal mask and window aligned to their end. Covered: appends of new lengths 0, 1..q and
> q, contiguous and paged caches, cache_batch_idx, cache_leftpad, rotary (interleaved or not, rotary_dim < d or = d),
causal / window, GQA and MQA, float32 / bfloat16 / float16, softmax_lse (+inf for a row that sees no key), the caches'
contents after the call, caches long enough to be split, and bad input. Also flash_attn_func's return_attn_probs with
dropout: S_dmask's sign is the kernel's own keep mask.
"""
import math

import pytest
import torch

from cs149gpt.flash_attn import flash_attn_func, flash_attn_with_kvcache
from tests._helpers import gen, isa  # noqa: F401  (fixture)
from tests.test_flash_attn_api import reference, visible

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Norm-relative error against float64 on the same inputs: the output's rounding plus, on the bf16 dot-product ISAs,
# P rounded to bf16 before P·V (bf16); float16 keeps 11 bits.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-8}


def rotate(x, cos, sin, positions, interleaved):
    """x (B, S, H, d) float64 with columns [0, 2·cos.shape[1]) rotated by the angles of rows positions (B, S)."""
    half = cos.shape[1]
    c = cos.double()[positions].unsqueeze(2)
    s = sin.double()[positions].unsqueeze(2)
    out = x.clone()
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    out[..., first] = x[..., first] * c - x[..., second] * s
    out[..., second] = x[..., second] * c + x[..., first] * s
    return out


def kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx=None, cache_leftpad=None,
                      causal=False, window_size=(-1, -1), rotary=None, softcap=0.0, alibi_slopes=None):
    """FlashAttention's flash_attn_with_kvcache, written out. Caches contiguous (B_cache, S, Hkv, d).
    Returns out (B, Sq, H, d) and lse (B, H, Sq) in float64, and the caches as they must be after the call (their
    dtype; the rotated k computed in float64, then rounded)."""
    B, Sq, H, d = q.shape
    rows = torch.arange(B) if cache_batch_idx is None else cache_batch_idx.long()
    k_after, v_after = k_cache.clone(), v_cache.clone()
    q_used = q
    if rotary is not None:
        cos, sin, interleaved = rotary
        start = cache_seqlens.long().unsqueeze(1)
        per_row = causal or window_size != (-1, -1)
        q_pos = start + torch.arange(Sq) if per_row else start.expand(B, Sq)
        q_used = rotate(q.double(), cos, sin, q_pos, interleaved).to(q.dtype)
        k = rotate(k.double(), cos, sin, start + torch.arange(k.shape[1]), interleaved).to(k.dtype)
    n_new = 0 if k is None else k.shape[1]
    for b in range(B):
        n = int(cache_seqlens[b])
        if n_new:
            k_after[rows[b], n:n + n_new] = k[b]
            v_after[rows[b], n:n + n_new] = v[b]
    outs, lses = [], []
    for b in range(B):
        first = 0 if cache_leftpad is None else int(cache_leftpad[b])
        end = int(cache_seqlens[b]) + n_new
        kb, vb = k_after[rows[b], first:end].unsqueeze(0), v_after[rows[b], first:end].unsqueeze(0)
        if softcap == 0.0 and alibi_slopes is None:
            out, lse, _ = reference(q_used[b:b + 1], kb, vb, causal, window_size)
        else:
            out, lse = biased_reference(q_used[b:b + 1], kb, vb, causal, window_size, softcap,
                                        None if alibi_slopes is None else alibi_slopes.reshape(-1, H)[-1 if
                                        alibi_slopes.dim() == 1 else b])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_after, v_after


def biased_reference(q, k, v, causal, window_size, softcap, slopes):
    """One sequence, float64: softcap · tanh(s / softcap) on the scaled logits, then −slope · |i + Nk − Nq − j|."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    n_q, n_k = q.shape[1], k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        distance = (torch.arange(n_q).unsqueeze(1) + n_k - n_q - torch.arange(n_k)).abs().double()
        s = s - slopes.double().view(1, -1, 1, 1) * distance
    s = s.masked_fill(~visible(n_q, n_k, causal, window_size), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)).nan_to_num(nan=0.0), v)
    return out, torch.where(torch.isneginf(lse), float("inf"), lse)


def assert_close(out, want, dtype):
    assert out.shape == want.shape and out.dtype == dtype
    rel = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert rel <= REL_TOL[dtype], f"norm-relative error {rel:.3g}"


def assert_lse(lse, want):
    assert lse.dtype == torch.float32 and lse.shape == want.shape
    assert torch.equal(torch.isposinf(lse), torch.isposinf(want)) and not torch.isneginf(lse).any()
    live = torch.isfinite(want)
    if live.any():
        assert (lse.double()[live] - want[live]).abs().max().item() <= 1e-4 * max(1.0, want[live].abs().max())


def assert_cache(got, want, dtype, appended_k=False):
    """The cache after the call: bitwise what was there and what v appended; a rotated k within one rounding."""
    if not appended_k:
        assert torch.equal(got, want)
        return
    ulp = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]
    assert torch.allclose(got.double(), want.double(), rtol=ulp, atol=ulp)


def paged_copy(k_cache, v_cache, page, g):
    """The same logical caches (B, S, Hkv, d), S a multiple of page, as shuffled blocks of a paged cache (2 spare)."""
    B, S = k_cache.shape[:2]
    n = B * (S // page)
    table = torch.randperm(n + 2, generator=g)[:n].view(B, S // page).to(torch.int32)
    k_paged = torch.zeros(n + 2, page, *k_cache.shape[2:], dtype=k_cache.dtype)
    v_paged = torch.zeros_like(k_paged)
    k_paged[table.flatten().long()] = k_cache.reshape(n, page, *k_cache.shape[2:])
    v_paged[table.flatten().long()] = v_cache.reshape(n, page, *v_cache.shape[2:])
    return k_paged, v_paged, table


def logical(paged_cache, table):
    return paged_cache[table.flatten().long()].reshape(table.shape[0], -1, *paged_cache.shape[2:])


def run_case(dtype, paged, s_q, s_new, causal, window_size, h=4, h_kv=2, d=16, cap=48, page=8, seqlens=(0, 17, 30),
             batch_cache=None, batch_idx=None, leftpad=None, rotary_dim=0, interleaved=True, seed=0, lse=False,
             softcap=0.0, alibi=None):
    """Builds the inputs, calls flash_attn_with_kvcache and checks out (and lse), and the caches after."""
    g = gen(seed)
    B = len(seqlens)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
    k_cache = torch.randn(batch_cache or B, cap, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(batch_cache or B, cap, h_kv, d, generator=g).to(dtype)
    q = torch.randn(B, s_q, h, d, generator=g).to(dtype)
    k = torch.randn(B, s_new, h_kv, d, generator=g).to(dtype) if s_new else None
    v = torch.randn(B, s_new, h_kv, d, generator=g).to(dtype) if s_new else None
    rotary = None
    if rotary_dim:
        angle = torch.rand(cap, rotary_dim // 2, generator=g) * 2 * math.pi
        rotary = (torch.cos(angle).to(dtype), torch.sin(angle).to(dtype), interleaved)
    cache_batch_idx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32)
    cache_leftpad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    slopes = None
    if alibi is not None:  # "head": (h,), "batch": (B, h)
        slopes = torch.rand(h if alibi == "head" else (B, h), generator=g) * 0.5 + 0.05
    want, want_lse, want_k, want_v = kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx,
                                                       cache_leftpad, causal, window_size, rotary, softcap, slopes)
    if paged:
        k_arg, v_arg, table = paged_copy(k_cache, v_cache, page, g)
    else:
        k_arg, v_arg, table = k_cache, v_cache, None
    result = flash_attn_with_kvcache(q, k_arg, v_arg, k, v, rotary_cos=None if rotary is None else rotary[0],
                                     rotary_sin=None if rotary is None else rotary[1], cache_seqlens=cache_seqlens,
                                     cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=table,
                                     causal=causal, window_size=window_size, rotary_interleaved=interleaved,
                                     softcap=softcap, alibi_slopes=slopes, return_softmax_lse=lse)
    out, out_lse = result if lse else (result, None)
    assert out.shape == (B, s_q, h, d)
    assert_close(out, want, dtype)
    if lse:
        assert_lse(out_lse, want_lse)
    got_k, got_v = (logical(k_arg, table), logical(v_arg, table)) if paged else (k_arg, v_arg)
    assert_cache(got_v, want_v, dtype)
    assert_cache(got_k, want_k, dtype, appended_k=rotary is not None)
    return out


MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (6, 2)), (True, (9, -1))]
MASK_IDS = ["full", "causal", "window", "causal+window"]


@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("s_new", [0, 1, 3, 5, 9], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_appends_of_any_length(dtype, paged, s_new, causal, window_size):
    """seqlen_q = 5 queries after appending 0, 1, 3, 5 (= q) and 9 (> q) new keys: out, lse, the caches after."""
    run_case(dtype, paged, 5, s_new, causal, window_size, lse=True)


@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [8, 16], ids=lambda r: f"rotary{r}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary(dtype, paged, rotary_dim, interleaved, causal, window_size):
    """q and the new k rotated at cache_seqlens + i (q at cache_seqlens alone when neither causal nor windowed),
    the cache holding the rotated k; appends shorter and longer than q."""
    run_case(dtype, paged, 4, 3, causal, window_size, rotary_dim=rotary_dim, interleaved=interleaved)
    run_case(dtype, paged, 3, 6, causal, window_size, rotary_dim=rotary_dim, interleaved=interleaved, seed=1,
             h=3, h_kv=1)


@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("s_new", [0, 2, 7], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_batch_idx(dtype, s_new, causal, window_size):
    """Sequence b in row cache_batch_idx[b] of a larger cache (read by address): the other rows untouched."""
    run_case(dtype, False, 4, s_new, causal, window_size, batch_cache=5, batch_idx=[3, 0, 4], lse=True)


@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("s_new", [0, 1, 4, 6], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_leftpad(dtype, paged, s_new, causal, window_size):
    """Keys from cache_leftpad[b] on (leftpad 0, mid-sequence, = cache_seqlens); rotary and cache_batch_idx with it."""
    run_case(dtype, paged, 4, s_new, causal, window_size, seqlens=(0, 17, 30, 12), leftpad=[0, 5, 30, 12],
             lse=True)
    if s_new:
        run_case(dtype, paged, 4, s_new, causal, window_size, seqlens=(9, 20), leftpad=[3, 11], rotary_dim=8,
                 interleaved=False, seed=2)
    if not paged:
        run_case(dtype, False, 2, s_new, causal, window_size, seqlens=(9, 20), leftpad=[3, 11], batch_cache=4,
                 batch_idx=[2, 1], seed=3, h=2, h_kv=1)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
def test_long_cache_split(paged, causal, window_size):
    """Caches long enough that the kernel splits the keys (merged after), across many pages, with leftpad and an
    append shorter than q."""
    run_case(torch.float32, paged, 3, 2, causal, (40, 3) if window_size != (-1, -1) else window_size, h=2, h_kv=1,
             d=32, cap=1536, page=64, seqlens=(1400, 700), leftpad=[300, 0], lse=True)


def test_lse_of_rows_that_see_no_key():
    """seqlen_q > the keys a sequence has: the first rows of a causal call see none: out 0, lse +inf."""
    out = run_case(torch.float32, False, 6, 1, True, (-1, -1), seqlens=(2, 0, 30), lse=True)
    assert (out[0, :3] == 0).all() and (out[1, :5] == 0).all()


def test_cache_seqlens_int_and_none():
    g = gen(9)
    q = torch.randn(2, 3, 2, 16, generator=g)
    k_cache, v_cache = torch.randn(2, 24, 2, 16, generator=g), torch.randn(2, 24, 2, 16, generator=g)
    full = kvcache_reference(q, k_cache, v_cache, None, None, torch.tensor([24, 24]), causal=True)[0]
    assert_close(flash_attn_with_kvcache(q, k_cache, v_cache, causal=True), full, torch.float32)
    part = kvcache_reference(q, k_cache, v_cache, None, None, torch.tensor([10, 10]), window_size=(3, 1))[0]
    assert_close(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, window_size=(3, 1)), part,
                 torch.float32)


@pytest.mark.parametrize("what", ["softcap", "alibi", "alibi_per_batch"])
def test_softcap_and_alibi(what):
    """FlashAttention's softcap and ALiBi (distance counted from cache_leftpad, bottom-right)."""
    g = gen(10)
    B, s_q, h, h_kv, d = 2, 3, 4, 2, 16
    q = torch.randn(B, s_q, h, d, generator=g)
    k_cache, v_cache = torch.randn(B, 40, h_kv, d, generator=g), torch.randn(B, 40, h_kv, d, generator=g)
    k, v = torch.randn(B, 2, h_kv, d, generator=g), torch.randn(B, 2, h_kv, d, generator=g)
    seqlens, leftpad = torch.tensor([20, 33], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32)
    softcap = 2.0 if what == "softcap" else 0.0
    slopes = None if what == "softcap" else torch.rand(h if what == "alibi" else (B, h), generator=g)
    want = kvcache_reference(q, k_cache, v_cache, k, v, seqlens, cache_leftpad=leftpad, causal=True,
                             softcap=softcap, alibi_slopes=slopes)[0]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                  causal=True, softcap=softcap, alibi_slopes=slopes)
    assert_close(out, want, torch.float32)


@pytest.mark.parametrize("causal,window_size", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("mods", [dict(softcap=1.5), dict(alibi="head"), dict(softcap=3.0, alibi="batch")],
                         ids=["softcap", "alibi", "both"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_alibi_everywhere(dtype, paged, mods, causal, window_size):
    """softcap and ALiBi with appends shorter and longer than q, cache_leftpad, cache_batch_idx, GQA, out and lse."""
    run_case(dtype, paged, 5, 3, causal, window_size, lse=True, **mods)
    run_case(dtype, paged, 4, 6, causal, window_size, seqlens=(0, 17, 30, 12), leftpad=[0, 5, 30, 12], lse=True,
             seed=1, **mods)
    if not paged:
        run_case(dtype, False, 2, 1, causal, window_size, seqlens=(9, 20), leftpad=[3, 11], batch_cache=4,
                 batch_idx=[2, 1], seed=3, h=2, h_kv=1, **mods)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_softcap_and_alibi_long_cache_split(isa, paged):
    """Long caches that the kernel splits (the splits' partials merged after), on every ISA."""
    run_case(torch.float32, paged, 3, 2, True, (-1, -1), h=2, h_kv=1, d=32, cap=1536, page=64, seqlens=(1400, 700),
             leftpad=[300, 0], lse=True, softcap=2.0, alibi="batch")
    run_case(torch.bfloat16, paged, 1, 1, False, (-1, -1), h=4, h_kv=2, d=64, cap=1024, page=64, seqlens=(1000, 333),
             lse=True, softcap=4.0, alibi="head", seed=1)


def bad_call(**overrides):
    """A valid small call with some arguments replaced."""
    g = gen(11)
    args = dict(q=torch.randn(2, 2, 2, 16, generator=g), k_cache=torch.randn(2, 16, 2, 16, generator=g),
                v_cache=torch.randn(2, 16, 2, 16, generator=g), k=torch.randn(2, 3, 2, 16, generator=g),
                v=torch.randn(2, 3, 2, 16, generator=g), cache_seqlens=torch.tensor([4, 9], dtype=torch.int32))
    args.update(overrides)
    return args


PAGED = dict(k_cache=torch.zeros(6, 8, 2, 16), v_cache=torch.zeros(6, 8, 2, 16),
             block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))


@pytest.mark.parametrize("overrides,error,pattern", [
    (dict(PAGED, block_table=torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)), IndexError, r"block_table\[1, 1\] = 6"),
    (dict(PAGED, cache_seqlens=torch.tensor([4, 14], dtype=torch.int32)), ValueError, r"^block_table: row 1 .* too few"),
    (dict(cache_seqlens=torch.tensor([4, 14], dtype=torch.int32)), ValueError, r"cache_seqlens\[1\] = 14 plus the 3"),
    (dict(k_cache=torch.zeros(3, 16, 2, 16), v_cache=torch.zeros(3, 16, 2, 16),
          cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32)), IndexError, r"cache_batch_idx\[1\] = 3"),
    (dict(k_cache=torch.zeros(3, 16, 2, 16), v_cache=torch.zeros(3, 16, 2, 16),
          cache_batch_idx=torch.tensor([2, 2], dtype=torch.int32)), ValueError, r"cache_batch_idx\[0\] and .* row 2"),
    (dict(PAGED, cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), ValueError, r"cache_batch_idx.*block_table"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), TypeError, r"cache_batch_idx must be int32"),
    (dict(cache_leftpad=torch.tensor([0, 10], dtype=torch.int32)), ValueError, r"cache_leftpad\[1\] = 10 .* = 9"),
    (dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[0\] = -1"),
    (dict(cache_leftpad=torch.tensor([0], dtype=torch.int32)), ValueError, r"cache_leftpad must have shape \(B,\)"),
    (dict(v=torch.randn(2, 4, 2, 16)), ValueError, r"v_new must have shape"),
    (dict(rotary_cos=torch.ones(32, 4), rotary_sin=torch.zeros(32, 4), k=None, v=None), ValueError, r"rotary_cos"),
    (dict(rotary_cos=torch.ones(32, 4)), ValueError, r"rotary_cos and rotary_sin"),
    (dict(rotary_cos=torch.ones(11, 4), rotary_sin=torch.zeros(11, 4)), ValueError, r"rotary_cos: has 11 positions"),
    (dict(rotary_cos=torch.ones(32, 9), rotary_sin=torch.zeros(32, 9)), ValueError, r"rotary_dim = 2 · 9"),
    (dict(rotary_cos=torch.ones(32, 4), rotary_sin=torch.zeros(32, 3)), ValueError, r"rotary_sin: expected"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape"),
])
def test_bad_input(overrides, error, pattern):
    """A clear error naming the argument, raised before anything is written."""
    args = bad_call(**overrides)
    before = [t.clone() for t in (args["k_cache"], args["v_cache"])]
    with pytest.raises(error, match=pattern):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1])


@pytest.mark.parametrize("kwargs", [
    dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32), cache_leftpad=torch.tensor([1, 2], dtype=torch.int32),
         window=(3, 0), lse=torch.empty(2, 4, 3)),
    dict(block_table=torch.tensor([[3, 0], [1, 2]], dtype=torch.int32), window=(-1, 2)),
], ids=["batch_idx+leftpad+window+lse", "paged+window"])
def test_opcheck(kwargs):
    """The operator's new arguments: fake tensors, the schema's aliasing (the caches and lse written) and the
    dispatcher agree."""
    g = gen(12)
    paged = "block_table" in kwargs
    k_cache = torch.randn(4 if paged else 2, 2, 8 if paged else 16, 16, generator=g)
    q = torch.randn(2, 4, 3, 16, generator=g)
    k_new, v_new = torch.randn(2, 2, 2, 16, generator=g), torch.randn(2, 2, 2, 16, generator=g)
    window = kwargs.pop("window")
    args = (q, k_cache, k_cache.clone(), torch.tensor([5, 7], dtype=torch.int32), k_new, v_new,
            kwargs.get("block_table"), None, True, kwargs.get("cache_batch_idx"), kwargs.get("cache_leftpad"),
            window[0], window[1], 0.0, None, kwargs.get("lse"))
    torch.library.opcheck(torch.ops.cs149gpt.attention_with_kvcache.default, args)


@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
def test_return_attn_probs_with_dropout(causal, window_size):
    """S_dmask: the probabilities before dropout, negative where the kernel dropped them. The kernel's output is the
    dropped, rescaled probabilities times v exactly when the sign is its keep mask."""
    g = gen(13)
    q, k, v = (torch.randn(2, n, h, 16, generator=g) for n, h in ((12, 4), (20, 2), (20, 2)))
    p = 0.3
    torch.manual_seed(5)
    out, lse, S = flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window_size,
                                  return_attn_probs=True)
    _, want_lse, want_probs = reference(q, k, v, causal, window_size)
    assert S.shape == (2, 4, 12, 20) and S.dtype == torch.float32
    assert (S.abs().double() - want_probs).abs().max().item() <= 1e-5
    keep = S >= 0
    seen = want_probs > 0
    assert 0.6 < keep[seen].float().mean().item() < 0.8  # Bernoulli(1 - p) over ~3000 weights
    dropped = torch.where(keep, S.abs(), torch.zeros_like(S)).double() / (1 - p)
    want = torch.einsum("bhqk,bkhd->bqhd", dropped, v.double().repeat_interleave(2, dim=2))
    assert (out.double() - want).abs().max().item() <= 1e-4
    assert torch.allclose(lse.double(), want_lse, atol=1e-4)
    # the draw that follows is the generator's next: the mask is that of this call, not of a re-seeded one
    torch.manual_seed(5)
    again = flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window_size)
    assert torch.equal(again, out)
