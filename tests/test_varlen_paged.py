"""cs149gpt.varlen_attention with a paged KV cache (block_table; flash_attn_varlen_func's): packed queries of many
sequences against keys read through each sequence's page table, in one kernel call: prefills and decodes mixed.
The reference gathers each sequence's keys from its pages and computes softmax in float64 from the definition
(FlashAttention's semantics: causal, window and ALiBi bottom-right in each sequence)."""
import math

import pytest
import torch

import cs149gpt
from cs149gpt.flash_attn import flash_attn_varlen_func
from tests._helpers import isa, module  # noqa: F401  (isa: fixture)
from tests.test_varlen import offsets as varlen_offsets, reference as varlen_reference

TOLS = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# (query length, key length) per sequence: decode steps (1 query) beside prefills, chunked prefill (Nq < Nk), empty
# sequences, a sequence with keys but no queries, and one whose queries see no key.
MIXED = [(1, 40), (70, 70), (0, 0), (1, 1), (33, 90), (0, 17), (1, 300), (3, 0), (130, 200)]


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def paged_cache(key_lengths, page, heads_kv, d, dtype, gen, *, shared_prefix_pages=0, extra_blocks=3):
    """k_cache, v_cache (num_blocks, page, Hkv, d) and block_table (B, max_blocks) int32: each sequence's blocks drawn
    from a shuffled pool (never in order), unused table entries -1; with shared_prefix_pages, sequence 0's first blocks
    are also every other long-enough sequence's first blocks (a common prompt prefix)."""
    need = [math.ceil(n / page) for n in key_lengths]
    num_blocks = sum(need) + extra_blocks
    k_cache = torch.randn(num_blocks, page, heads_kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, heads_kv, d, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(key_lengths), max(need + [1]) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        for i in range(n):
            table[b, i] = pool.pop()
    for b in range(1, len(key_lengths)):
        shared = min(shared_prefix_pages, need[0], need[b])
        table[b, :shared] = table[0, :shared]
    return k_cache, v_cache, table


def gather(cache, table, key_lengths):
    """Sequence b's keys 0 .. n − 1 from its pages: key t is row t % page of block table[b, t // page]."""
    page = cache.shape[1]
    return [cache[table[b, torch.arange(n) // page].long(), torch.arange(n) % page] for b, n in enumerate(key_lengths)]


def reference(q, cu_q, keys, values, **kwargs):
    """(out (total_q, Hq, d), lse (Hq, total_q)) in float64; keys[b], values[b]: sequence b's (Nk, Hkv, d), gathered
    from its pages: test_varlen's reference on them packed."""
    cu_k = varlen_offsets([len(x) for x in keys])
    return varlen_reference(q, torch.cat(list(keys)), torch.cat(list(values)), cu_q, cu_k, **kwargs)


def setup(lengths, page, heads=(4, 2), d=64, dtype=torch.float32, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    cu_q = offsets([a for a, _ in lengths])
    key_lengths = [b for _, b in lengths]
    q = torch.randn(cu_q[-1], heads[0], d, generator=g).to(dtype)
    k_cache, v_cache, table = paged_cache(key_lengths, page, heads[1], d, dtype, g, **kw)
    return q, k_cache, v_cache, table, cu_q, key_lengths


def run(q, k_cache, v_cache, table, cu_q, key_lengths, **kw):
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    cu_k = offsets(key_lengths)
    return cs149gpt.varlen_attention(q, k_cache, v_cache, t(cu_q), t(cu_k), max(b - a for a, b in zip(cu_q, cu_q[1:])),
                                     max(key_lengths), block_table=table, return_lse=True, **kw)


def check(got, want, tol):
    out, lse = got
    ref_out, ref_lse = want
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() <= tol
    seen = torch.isfinite(ref_lse)
    assert torch.equal(lse[~seen], ref_lse[~seen].float())  # −inf: a row that sees no key
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-4
    assert torch.all(out[(~seen).transpose(0, 1)] == 0)


def check_against_reference(q, k_cache, v_cache, table, cu_q, key_lengths, tol, *, is_causal=False, window=None,
                            softcap=0.0, slopes=None):
    got = run(q, k_cache, v_cache, table, cu_q, key_lengths, is_causal=is_causal, window=window, softcap=softcap,
              alibi_slopes=slopes)
    keys, values = gather(k_cache, table, key_lengths), gather(v_cache, table, key_lengths)
    want = reference(q, cu_q, keys, values, scale=q.shape[-1] ** -0.5, causal=is_causal, window=window or (-1, -1),
                     softcap=softcap, slopes=slopes)
    check(got, want, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_prefill_and_decode_every_isa(isa, dtype, causal):
    q, kc, vc, table, cu_q, nk = setup(MIXED, 16, dtype=dtype)
    check_against_reference(q, kc, vc, table, cu_q, nk, TOLS[dtype], is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [7, 24])
def test_odd_and_unaligned_pages_every_isa(isa, dtype, page):
    """Pages that end inside a packed block: 7 (odd: a V pair split between two pages), 24 (a 16-key B tile and a
    32-key VNNI block split between two pages)."""
    q, kc, vc, table, cu_q, nk = setup([(1, 61), (45, 45), (2, 100)], page, heads=(2, 1), d=48, dtype=dtype, seed=1)
    check_against_reference(q, kc, vc, table, cu_q, nk, TOLS[dtype], is_causal=True)


@pytest.mark.parametrize("page", [16, 64, 256, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_sizes(page, dtype):
    q, kc, vc, table, cu_q, nk = setup([(1, 700), (257, 300), (64, 64), (1, 1)], page, dtype=dtype, seed=2)
    for causal in (False, True):
        check_against_reference(q, kc, vc, table, cu_q, nk, TOLS[dtype], is_causal=causal)


@pytest.mark.parametrize("window", [(16, 0), (8, 8), (-1, 4)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_windows_and_gqa(window, heads):
    q, kc, vc, table, cu_q, nk = setup(MIXED, 32, heads=heads, d=32, seed=3)
    for causal in (False, True):
        check_against_reference(q, kc, vc, table, cu_q, nk, 2e-5, is_causal=causal, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_and_alibi(dtype):
    q, kc, vc, table, cu_q, nk = setup(MIXED, 16, dtype=dtype, seed=4)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(5)) * 0.2
    per_sequence = torch.rand(len(MIXED), 4, generator=torch.Generator().manual_seed(6)) * 0.2
    tol = TOLS[dtype]
    check_against_reference(q, kc, vc, table, cu_q, nk, tol, is_causal=True, softcap=5.0)
    check_against_reference(q, kc, vc, table, cu_q, nk, tol, is_causal=True, slopes=slopes)
    check_against_reference(q, kc, vc, table, cu_q, nk, tol, slopes=per_sequence, softcap=3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefix_blocks(dtype):
    """Sequences whose first blocks are the same blocks (a common system prompt), each continuing on its own pages."""
    q, kc, vc, table, cu_q, nk = setup([(1, 200), (1, 150), (40, 230), (1, 64)], 32, dtype=dtype, seed=7,
                                       shared_prefix_pages=2)
    assert torch.equal(table[1, :2], table[0, :2]) and torch.equal(table[2, :2], table[0, :2])
    check_against_reference(q, kc, vc, table, cu_q, nk, TOLS[dtype], is_causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_result_as_the_packed_keys(dtype):
    """The paged call gives what the same call on the keys gathered into packed k, v gives (the kernel is the same;
    only where it reads each key differs)."""
    q, kc, vc, table, cu_q, nk = setup(MIXED, 16, dtype=dtype, seed=8)
    t = lambda cu: torch.tensor(cu, dtype=torch.int32)  # noqa: E731
    k, v = torch.cat(gather(kc, table, nk)), torch.cat(gather(vc, table, nk))
    for causal in (False, True):
        paged, lse_paged = run(q, kc, vc, table, cu_q, nk, is_causal=causal)
        dense, lse_dense = cs149gpt.varlen_attention(q, k, v, t(cu_q), t(offsets(nk)), 130, 300, is_causal=causal,
                                                     return_lse=True)
        torch.testing.assert_close(paged, dense, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)
        torch.testing.assert_close(lse_paged, lse_dense, atol=1e-6, rtol=0)


def test_flash_attn_varlen_func_block_table():
    """FlashAttention's call: cu_seqlens_k gives the lengths (its offsets need not start where k's rows do), lse +inf
    for a row that sees no key, and return_attn_probs from the gathered keys."""
    q, kc, vc, table, cu_q, nk = setup(MIXED, 16, seed=9)
    cu_k = torch.tensor(offsets(nk), dtype=torch.int32) + 1000
    out, lse, probs = flash_attn_varlen_func(q, kc, vc, torch.tensor(cu_q, dtype=torch.int32), cu_k, 130, 300,
                                             causal=True, block_table=table, return_attn_probs=True)
    ref_out, ref_lse = reference(q, cu_q, gather(kc, table, nk), gather(vc, table, nk), scale=1 / 8, causal=True)
    assert (out.double() - ref_out).abs().max().item() <= 2e-5
    seen = torch.isfinite(ref_lse)
    assert torch.all(lse[~seen] == math.inf) and (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-4
    b = 4  # (33 queries, 90 keys): its probabilities, rows summing to 1, applied to its values give its output
    rows = probs[b, :, :33, :90].double()
    assert torch.allclose(rows.sum(-1), torch.ones(4, 33, dtype=torch.float64), atol=1e-5)
    v_b = gather(vc, table, nk)[b].double().repeat_interleave(2, 1).transpose(0, 1)
    assert (rows @ v_b - ref_out[cu_q[b]:cu_q[b + 1]].transpose(0, 1)).abs().max().item() <= 2e-5


def test_bad_block_tables_refused():
    q, kc, vc, table, cu_q, nk = setup([(1, 40), (5, 20)], 16, seed=10)
    cu_q_t, cu_k_t = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(offsets(nk), dtype=torch.int32)
    call = lambda tbl, k=kc, v=vc: cs149gpt.varlen_attention(q, k, v, cu_q_t, cu_k_t, 5, 40, block_table=tbl)  # noqa
    with pytest.raises(TypeError, match="block_table must be int32"):
        call(table.long())
    with pytest.raises(ValueError, match="block_table must be \\(batch, max_blocks\\)"):
        call(table[:1])
    with pytest.raises(ValueError, match="block_table must be \\(batch, max_blocks\\)"):
        call(table[0])
    for bad in (kc.shape[0], -1, 2**31 - 1):  # a block past the cache, or negative, in a page sequence 0 reads
        t = table.clone()
        t[0, 2] = bad
        with pytest.raises(IndexError, match=r"block_table\[0, 2\] = "):
            call(t)
    with pytest.raises(ValueError, match="block_table: sequence 0 has 40 keys, 3 blocks"):
        call(table[:, :2].contiguous())
    with pytest.raises(ValueError, match="k must be \\(num_blocks, page_block_size"):
        call(table, k=kc[:, 0], v=vc[:, 0])
    with pytest.raises(ValueError, match="v must have k's shape"):
        call(table, v=vc[:, :8])
    t = table.clone()
    t[0, 3:] = 10**6  # past the blocks sequence 0 uses: never read, accepted
    t[1, 2:] = -7
    assert torch.equal(call(t), call(table))
    # Inference only: the forward runs with grad mode on (as FlashAttention's tests call it), the backward raises.
    out = cs149gpt.varlen_attention(q.clone().requires_grad_(), kc, vc, cu_q_t, cu_k_t, 5, 40, block_table=table)
    assert torch.equal(out.detach(), call(table))
    with pytest.raises(RuntimeError, match="block_table.*has no backward"):
        out.sum().backward()


def test_fake_and_opcheck():
    """The fake implementation takes the same checks (meta tensors refused alike) and gives the op's shapes."""
    q, kc, vc, table, cu_q, nk = setup([(1, 40), (5, 20)], 16, seed=11)
    args = (q, kc, vc, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(offsets(nk), dtype=torch.int32), 5, 40)
    torch.library.opcheck(torch.ops.cs149gpt.varlen_attention.default, args, {"causal": True, "block_table": table},
                          test_utils=("test_schema", "test_faketensor"))
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in args]
    out, lse = torch.ops.cs149gpt.varlen_attention(*meta, block_table=table.to("meta"))
    assert out.shape == q.shape and lse.shape == (4, 6)
    with pytest.raises(TypeError, match="block_table must be int32"):
        torch.ops.cs149gpt.varlen_attention(*meta, block_table=table.to("meta").long())
