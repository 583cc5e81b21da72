"""Packed variable-length sequences on CUDA: cs149gpt.varlen_attention and cs149gpt.flash_attn's functions on GPU
tensors, one launch over every sequence, forward and backward on Hopper's kernels (sm_90, without attn_mask, window or
logit options) or FlashAttention-2's (each block on its own sequence); the tests taking `forward_path` run on both.
Skipped where torch sees no GPU.

References are float64 on the GPU, computed sequence by sequence from the definition (causal bottom-right in each
sequence, FlashAttention's). For bfloat16/float16 the bar is tests/test_cuda.py's: our error against float64 at most a
small multiple of torch SDPA's in the same dtype (run on each sequence alone), and under an absolute cap.
"""
import math

import pytest
import torch

import cs149gpt
from cs149gpt.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                 flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                 flash_attn_varlen_qkvpacked_func)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

CUDA = "cuda"
FAST_DTYPES = (torch.bfloat16, torch.float16)
CAPS = {torch.bfloat16: 3e-2, torch.float16: 4e-3}  # forward; the gradients' (relative to their largest): x4/3, x2.5
# (Nq, Nk) per sequence: lengths 0, 1, 77, 300 and 1000 mixed; Nq > Nk (causal rows that see no key) and Nq < Nk;
# sequences without queries, without keys, without either.
MIXED = [(77, 77), (0, 5), (1, 1), (300, 300), (1000, 1000), (5, 0), (0, 0), (300, 77), (77, 300), (1, 1000),
         (1000, 1), (1, 77)]
HEADS = [(4, 4), (8, 2), (4, 1)]  # (Hq, Hkv): MHA, GQA, MQA


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def int32(cu):
    return torch.tensor(cu, dtype=torch.int32, device=CUDA)


def rand(shape, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(shape, generator=g, device=CUDA, dtype=torch.float32).to(dtype)


def packed(lengths, heads_q, heads_kv, d, dtype, seed=0):
    """q (total_q, Hq, d), k and v (total_k, Hkv, d) on the GPU, and the offsets as lists."""
    cu_q, cu_k = offsets([a for a, _ in lengths]), offsets([b for _, b in lengths])
    return (rand((cu_q[-1], heads_q, d), dtype, seed), rand((cu_k[-1], heads_kv, d), dtype, seed + 1),
            rand((cu_k[-1], heads_kv, d), dtype, seed + 2), cu_q, cu_k)


def call(q, k, v, cu_q, cu_k, **kw):
    longest = lambda cu: max(b - a for a, b in zip(cu, cu[1:]))  # noqa: E731
    return cs149gpt.varlen_attention(q, k, v, int32(cu_q), int32(cu_k), longest(cu_q), longest(cu_k),
                                     return_lse=True, **kw)


def shown(n_q, n_k, causal):
    """(n_q, n_k) bool: key j visible to query i (causal: bottom-right, j <= i + n_k - n_q)."""
    i = torch.arange(n_q, device=CUDA)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=CUDA)[None, :]
    return j <= i if causal else torch.ones(n_q, n_k, dtype=torch.bool, device=CUDA)


def sequence_reference(qs, ks, vs, causal, scale):
    """One sequence, (H, N, d) float64 with kv heads repeated: (out, lse); a row that sees no key gets 0, lse -inf."""
    n_q, n_k = qs.shape[1], ks.shape[1]
    mask = shown(n_q, n_k, causal)
    seen = mask.any(-1)[:, None]
    s = (scale * qs @ ks.transpose(-1, -2)).masked_fill(~mask & seen, -math.inf).masked_fill(~seen, 0.0)
    out = (torch.softmax(s, -1) @ vs) * seen if n_k > 0 else qs.new_zeros(qs.shape[0], n_q, vs.shape[-1])
    lse = torch.logsumexp(s, -1).masked_fill(~seen[:, 0], -math.inf) if n_k > 0 else \
        qs.new_full((qs.shape[0], n_q), -math.inf)
    return out, lse


def sequence_sdpa(qs, ks, vs, causal, scale):
    """torch's SDPA on one sequence in its dtype (the yardstick); rows that see no key 0."""
    if qs.shape[1] == 0 or ks.shape[1] == 0:
        return qs.new_zeros(qs.shape[0], qs.shape[1], vs.shape[-1])
    mask = shown(qs.shape[1], ks.shape[1], causal)
    out = torch.nn.functional.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask,
                                                           scale=scale)[0]
    return out.masked_fill(~mask.any(-1)[:, None], 0.0)


def per_sequence(fn, q, k, v, cu_q, cu_k, causal, scale=None):
    """fn over each sequence ((H, N, d) views, kv heads repeated), packed back: out (total_q, Hq, d) and, when fn
    returns it, lse (Hq, total_q)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        result = fn(qs, ks, vs, causal, scale)
        out, lse = result if isinstance(result, tuple) else (result, None)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses, -1)) if lses[0] is not None else out


def reference(q, k, v, cu_q, cu_k, causal, scale=None):
    return per_sequence(sequence_reference, q.double(), k.double(), v.double(), cu_q, cu_k, causal, scale)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def poison_allocator():
    """Memory the caching allocator hands out next full of NaN: an output row left unwritten fails the checks."""
    x = torch.full((64 << 20,), float("nan"), device=CUDA)
    del x


def check_forward(out, lse, q, k, v, cu_q, cu_k, causal, what, scale=None):
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal, scale)
    assert out.dtype == q.dtype and out.shape == ref.shape, what
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    sdpa = per_sequence(sequence_sdpa, q, k, v, cu_q, cu_k, causal, scale)
    ours_err, sdpa_err, cap = max_err(out, ref), max_err(sdpa, ref), CAPS[q.dtype]
    assert ours_err <= max(2 * sdpa_err, cap / 4) and ours_err <= cap, \
        f"{what}: max abs error {ours_err:.3g} vs SDPA's {sdpa_err:.3g} (cap {cap})"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse -inf exactly where a row sees no key"
    assert (lse[~finite] == -math.inf).all(), what
    assert max_err(lse[finite], ref_lse[finite]) < 1e-3, what
    assert (out.transpose(0, 1)[~finite] == 0).all(), f"{what}: a row that sees no key is 0"


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return torch.autograd.grad(out, (q, k, v), dout)


def check_backward(fn, q, k, v, cu_q, cu_k, causal, dout, what):
    """Gradients of fn (q, k, v) -> out against float64's, SDPA's error per sequence as the yardstick."""
    ours = grads(fn, q, k, v, dout)
    ref = grads(lambda a, b, c: reference(a, b, c, cu_q, cu_k, causal)[0], q.double(), k.double(), v.double(),
                dout.double())
    sdpa = grads(lambda a, b, c: per_sequence(sequence_sdpa, a, b, c, cu_q, cu_k, causal), q, k, v, dout)
    scale = max(g.abs().max().item() for g in ref if g.numel()) + 1e-6
    cap = 4e-2 if q.dtype == torch.bfloat16 else 1e-2
    for name, got, want, theirs in zip(("dq", "dk", "dv"), ours, ref, sdpa):
        assert got.dtype == q.dtype and got.shape == want.shape, f"{what}: {name}"
        assert torch.isfinite(got).all(), f"{what}: {name} non-finite"
        e_ours, e_sdpa = max_err(got, want) / scale, max_err(theirs.nan_to_num(0.0), want) / scale
        assert e_ours <= max(2 * e_sdpa, cap / 4) and e_ours <= cap, \
            f"{what}: {name} relative max error {e_ours:.3g} vs SDPA's {e_sdpa:.3g}"


# ---------------------------------------------------------------------------------------------------------
# varlen_attention: forward, lse, backward
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_forward_and_lse(dtype, d, causal, heads, forward_path):
    q, k, v, cu_q, cu_k = packed(MIXED, *heads, d, dtype, seed=d + heads[0])
    poison_allocator()
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
    check_forward(out, lse, q, k, v, cu_q, cu_k, causal, f"{dtype} d={d} causal={causal} heads={heads}")


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_backward(dtype, d, causal, heads, forward_path):
    q, k, v, cu_q, cu_k = packed(MIXED, *heads, d, dtype, seed=3 * d + heads[1])
    dout = rand(q.shape, dtype, 99)
    poison_allocator()
    check_backward(lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0], q, k, v, cu_q, cu_k, causal, dout,
                   f"{dtype} d={d} causal={causal} heads={heads}")


@pytest.mark.parametrize("causal", [False, True])
def test_backward_gqa_one_block_per_kv_head(causal, forward_path, monkeypatch):
    """CS149GPT_BWD_GQA_SPLIT=0 (each block sums its kv head's group) and the default (a block per query head, the
    group's shares summed afterwards) agree, both against float64."""
    q, k, v, cu_q, cu_k = packed(MIXED, 6, 2, 128, torch.bfloat16, seed=11)
    dout = rand(q.shape, torch.bfloat16, 12)
    fn = lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0]  # noqa: E731
    split = grads(fn, q, k, v, dout)
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", "0")
    check_backward(fn, q, k, v, cu_q, cu_k, causal, dout, "one block per kv head")
    whole = grads(fn, q, k, v, dout)
    scale = max(g.abs().max().item() for g in whole)
    for name, a, b in zip(("dq", "dk", "dv"), split, whole):
        assert max_err(a, b) / scale < 1e-2, f"{name}: split and whole differ"


@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_gets_its_dense_call(causal, forward_path):
    """A packed call's sequence b is a dense call on that sequence alone (the same kernel family and, at these lengths,
    the same tiles): the same bits, out and lse, though the packed call's last key tile of a sequence reads the next
    sequence's rows."""
    lengths = [(96, 96), (33, 70), (200, 200), (70, 33)]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 2, 128, torch.bfloat16, seed=4)
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
    for b in range(len(lengths)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense, dense_lse = cs149gpt.attention(q[rows].transpose(0, 1), k[keys].transpose(0, 1),
                                              v[keys].transpose(0, 1), is_causal="bottom_right" if causal else False,
                                              return_lse=True)
        assert torch.equal(out[rows], dense.transpose(0, 1)), f"sequence {b}"
        assert torch.equal(lse[:, rows], dense_lse), f"sequence {b}: lse"


@pytest.mark.parametrize("longest", [3000, 4500])
@pytest.mark.parametrize("causal", [False, True])
def test_sequences_past_2048_keys(causal, longest, forward_path):
    """A longest sequence past 2048 keys beside short ones: d 128 without the causal mask then takes the Hopper
    forward's wider key tile for every sequence (Bc 160 at 3000 keys; Bc 192, O staged in Q's buffer, at 4500); and
    the backward."""
    lengths = [(2500, 2500), (300, longest), (77, 77), (longest, 300)]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 2, 128, torch.bfloat16, seed=13)
    poison_allocator()
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
    check_forward(out, lse, q, k, v, cu_q, cu_k, causal, f"past 2048 keys, causal={causal}")
    check_backward(lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0], q, k, v, cu_q, cu_k, causal,
                   rand(q.shape, torch.bfloat16, 14), f"past 2048 keys, causal={causal}")


def test_many_short_sequences():
    """3000 sequences x 32 heads: more (sequence, head) pairs than a grid's y dimension holds (65535)."""
    g = torch.Generator().manual_seed(5)
    lengths = [(int(a), int(b)) for a, b in torch.randint(0, 24, (3000, 2), generator=g)]
    q, k, v, cu_q, cu_k = packed(lengths, 32, 8, 64, torch.bfloat16, seed=6)
    dout = rand(q.shape, torch.bfloat16, 7)
    for causal in (False, True):
        out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
        ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal)
        assert max_err(out, ref) < CAPS[torch.bfloat16], f"causal={causal}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite) and max_err(lse[finite], ref_lse[finite]) < 1e-3
        ours = grads(lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0], q, k, v, dout)
        want = grads(lambda a, b, c: reference(a, b, c, cu_q, cu_k, causal)[0], q.double(), k.double(), v.double(),
                     dout.double())
        scale = max(w.abs().max().item() for w in want)
        for name, a, b in zip(("dq", "dk", "dv"), ours, want):
            assert max_err(a, b) / scale < 4e-2, f"causal={causal}: {name}"


def test_backward_memory_follows_the_tokens_not_the_longest_sequence(forward_path):
    """2000 one-token sequences beside one of 4096: the backward's workspaces scale with the packed tokens (its row
    statistics laid out by packed row, not by sequence x longest length: 42x the tokens' float32 size here), and its
    gradients are right."""
    lengths = [(1, 1)] * 2000 + [(4096, 4096)]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 4, 64, torch.bfloat16, seed=41)
    dout = rand(q.shape, torch.bfloat16, 42)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = call(q, k, v, cu_q, cu_k, is_causal=True)[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 6 * q.numel() * 4, "a workspace grew with the longest sequence"
    # A one-token sequence attends to itself with weight 1: dq = dk = 0 and dv = dout, up to rounding.
    short = slice(0, 2000)
    assert dq[short].abs().max().item() < 1e-2 and dk[short].abs().max().item() < 1e-2
    assert max_err(dv[short], dout[short]) < 2e-2
    ref = grads(lambda a, b, c: reference(a, b, c, [0, 4096], [0, 4096], True)[0], q[2000:].double(),
                k[2000:].double(), v[2000:].double(), dout[2000:].double())
    scale = max(r.abs().max().item() for r in ref)
    for name, got, want in zip(("dq", "dk", "dv"), (dq[2000:], dk[2000:], dv[2000:]), ref):
        assert max_err(got, want) / scale < 4e-2, name


def test_one_launch_for_every_sequence(forward_path):
    """The forward is one kernel launch over all sequences, the backward one (and one of its row statistics'):
    Hopper's on sm_90, else FlashAttention-2's."""
    q, k, v, cu_q, cu_k = packed(MIXED, 4, 2, 64, torch.bfloat16)
    q.requires_grad_()

    def kernels_run(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    forward = "flash_fwd_hopper_kernel" if forward_path == "hopper" else "flash_fwd_kernel"
    for causal in (False, True):
        names = kernels_run(lambda: call(q, k, v, cu_q, cu_k, is_causal=causal))
        assert sum(forward in n for n in names) == 1 and sum("flash_fwd" in n for n in names) == 1, names
    names = kernels_run(lambda: call(q, k, v, cu_q, cu_k, is_causal=True)[0].sum().backward())
    backward, delta = (("flash_bwd_hopper_kernel", "flash_bwd_delta_vec_kernel") if forward_path == "hopper" else
                       ("flash_bwd_kernel", "flash_bwd_delta_kernel"))
    assert sum(backward in n for n in names) == 1 and sum(delta in n for n in names) == 1, names
    assert sum("flash_bwd" in n for n in names) == 2, names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_sequence_never_reads_the_next_ones_keys(causal, d, forward_path):
    """NaN and inf in a sequence's k and v (its rows 0..20, inside the key tile where the sequence before it ends)
    change nothing in the other sequences: they are another sequence's keys, never weighed, not even by 0."""
    lengths = [(100, 100), (50, 70), (130, 30)]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 2, d, torch.bfloat16, seed=d)
    clean, _ = call(q, k, v, cu_q, cu_k, is_causal=causal)
    for poisoned in (1, 2):
        k2, v2 = k.clone(), v.clone()
        for t in (k2, v2):
            t[cu_k[poisoned]:cu_k[poisoned] + 20:3] = float("nan")
            t[cu_k[poisoned] + 1:cu_k[poisoned] + 20:3] = float("inf")
        out, _ = call(q, k2, v2, cu_q, cu_k, is_causal=causal)
        for b in range(len(lengths)):
            rows = slice(cu_q[b], cu_q[b + 1])
            if b != poisoned:
                assert torch.equal(out[rows], clean[rows]), f"sequence {b} read sequence {poisoned}'s keys"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_a_sequences_gradients_never_see_the_next_ones(causal, d, forward_path):
    """NaN and inf in a sequence's q, k, v and dout (its rows 0..20, inside the query and key tiles where the sequence
    before it ends) change no other sequence's dq, dk or dv, bit for bit: the backward weighs those rows by 0, and
    0 · inf is NaN, so they must never reach its products (nor the poisoned sequence's dq rows past its end the
    next sequence's dq). Keys at most one tile per sequence: each dq row then sums in a fixed order."""
    lengths = [(100, 100), (50, 70), (120, 30)]
    q, k, v, cu_q, cu_k = packed(lengths, 4, 2, d, torch.bfloat16, seed=d + 1)
    dout = rand(q.shape, torch.bfloat16, 21)
    fn = lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0]  # noqa: E731
    clean = grads(fn, q, k, v, dout)
    for poisoned in (1, 2):
        q2, k2, v2, dout2 = (t.clone() for t in (q, k, v, dout))
        for t, cu in ((q2, cu_q), (k2, cu_k), (v2, cu_k), (dout2, cu_q)):
            t[cu[poisoned]:cu[poisoned] + 20:3] = float("nan")
            t[cu[poisoned] + 1:cu[poisoned] + 20:3] = float("inf")
        got = grads(fn, q2, k2, v2, dout2)
        for b in range(len(lengths)):
            if b == poisoned:
                continue
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            for name, g, c, at in zip(("dq", "dk", "dv"), got, clean, (rows, keys, keys)):
                assert torch.equal(g[at], c[at]), f"sequence {b}'s {name} saw sequence {poisoned}'s values"


@pytest.mark.parametrize("split", ["1", "0"], ids=["split", "whole"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_stay_in_their_sequence_past_the_first_tiles(causal, split, forward_path, monkeypatch):
    """As above with a first sequence of two query and two key tiles (the tiles that run into the next sequence start
    past 0), GQA with one block per query head or per kv head, and NaN/inf in rows after the last sequence (cu_seqlens
    not covering the tensor): every other sequence's dk, dv bit for bit, its dq (summed over key tiles in any order)
    finite and within rounding."""
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", split)
    q, k, v, cu_q, cu_k = packed([(200, 230), (50, 70), (120, 30), (10, 10)], 4, 2, 64, torch.bfloat16, seed=31)
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]  # the last 10 rows belong to no sequence
    dout = rand(q.shape, torch.bfloat16, 32)
    fn = lambda a, b, c: call(a, b, c, cu_q, cu_k, is_causal=causal)[0]  # noqa: E731
    clean = grads(fn, q, k, v, dout)
    q2, k2, v2, dout2 = (t.clone() for t in (q, k, v, dout))
    for t, cu in ((q2, cu_q), (k2, cu_k), (v2, cu_k), (dout2, cu_q)):
        t[cu[1]:cu[1] + 20:3] = float("nan")
        t[cu[1] + 1:cu[1] + 20:3] = float("inf")
        t[cu[-1]::2] = float("nan")
        t[cu[-1] + 1::2] = float("-inf")
    got = grads(fn, q2, k2, v2, dout2)
    for b in (0, 2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert torch.equal(got[1][keys], clean[1][keys]) and torch.equal(got[2][keys], clean[2][keys]), \
            f"sequence {b}'s dk or dv saw another sequence's values"
        assert torch.isfinite(got[0][rows]).all(), f"sequence {b}'s dq saw another sequence's values"
        assert max_err(got[0][rows], clean[0][rows]) <= 1e-2 * clean[0][rows].abs().max().item(), f"sequence {b}: dq"


def test_strided_views_read_in_place():
    """q, k, v as views into one (total, 3, H, d) projection, the layout of a fused qkv Linear; and kv packed."""
    lengths = [(100, 100), (1, 1), (110, 110)]
    cu = offsets([a for a, _ in lengths])
    qkv = rand((cu[-1], 3, 4, 64), torch.bfloat16, 8)
    out = flash_attn_varlen_qkvpacked_func(qkv, int32(cu), 110, causal=True)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    check_forward(out, call(q, k, v, cu, cu, is_causal=True)[1], q, k, v, cu, cu, True, "qkv packed")
    kv = rand((150, 2, 2, 64), torch.bfloat16, 9)
    cu_k = [0, 50, 100, 150]
    out = flash_attn_varlen_kvpacked_func(q, kv, int32(cu), int32(cu_k), 110, 50)
    check_forward(out, call(q, kv[:, 0], kv[:, 1], cu, cu_k)[1], q, kv[:, 0], kv[:, 1], cu, cu_k, False, "kv packed")


def test_rows_outside_every_sequence_get_zeros():
    q, k, v, _, _ = packed([(10, 10)], 2, 2, 64, torch.float16, seed=10)
    cu = [2, 6, 8]  # rows 0, 1 and 8, 9 belong to no sequence
    poison_allocator()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = cs149gpt.varlen_attention(q, k, v, int32(cu), int32(cu), 4, 4, return_lse=True)
    assert torch.all(out[:2] == 0) and torch.all(out[8:] == 0) and torch.all(lse[:, :2] == -math.inf)
    assert torch.all(lse[:, 8:] == -math.inf)
    ref, _ = reference(q.detach(), k.detach(), v.detach(), cu, cu, False)
    assert max_err(out[2:8], ref) < CAPS[torch.float16]
    dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and torch.all(g[:2] == 0) and torch.all(g[8:] == 0)


@pytest.mark.parametrize("empty", ["queries", "keys", "both"])
def test_empty_packed_batch(empty):
    """total_q or total_k 0: out of zeros where no key is seen, lse -inf, zero gradients, as on the CPU."""
    n_q = 0 if empty in ("queries", "both") else 10
    n_k = 0 if empty in ("keys", "both") else 10
    cu_q = [0, 0, 0] if n_q == 0 else [0, 4, 10]
    cu_k = [0, 0, 0] if n_k == 0 else [0, 4, 10]
    q, k, v = (rand((n, h, 64), torch.bfloat16, i) for i, (n, h) in enumerate([(n_q, 4), (n_k, 2), (n_k, 2)]))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = cs149gpt.varlen_attention(q, k, v, int32(cu_q), int32(cu_k), 6, 6, is_causal=True, return_lse=True)
    assert out.shape == (n_q, 4, 64) and lse.shape == (4, n_q)
    assert not out.any() and torch.all(lse == -math.inf)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not (dq.any() or dk.any() or dv.any())


@pytest.mark.parametrize("causal", [False, True])
def test_float32_forward_runs_the_teaching_kernel(causal):
    """float32 packed sequences run the teaching kernel (forward only, as dense float32 on CUDA)."""
    q, k, v, cu_q, cu_k = packed(MIXED[:10], 4, 2, 48, torch.float32, seed=13)
    out, lse = call(q, k, v, cu_q, cu_k, is_causal=causal)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, causal)
    assert out.dtype == torch.float32 and max_err(out, ref) < 1e-4
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and max_err(lse[finite], ref_lse[finite]) < 1e-4
    q.requires_grad_()
    with pytest.raises(TypeError, match="CUDA flash backward takes bfloat16 or float16"):
        call(q, k, v, cu_q, cu_k, is_causal=causal)[0].sum().backward()


# ---------------------------------------------------------------------------------------------------------
# cs149gpt.flash_attn on CUDA tensors
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func(dtype, causal):
    q, k, v, cu_q, cu_k = packed(MIXED, 8, 2, 128, dtype, seed=14)
    out, lse, probs = flash_attn_varlen_func(q, k, v, int32(cu_q), int32(cu_k), 1000, 1000, causal=causal,
                                             return_attn_probs=True)
    ours_lse = torch.where(lse == math.inf, -math.inf, lse)  # FlashAttention's +inf for a row that sees no key
    check_forward(out, ours_lse, q, k, v, cu_q, cu_k, causal, "flash_attn_varlen_func")
    assert probs.shape == (len(MIXED), 8, 1000, 1000) and probs.device.type == "cuda"
    b = 3  # (300, 300): the probabilities times v give the output
    vs = v[cu_k[b]:cu_k[b + 1]].double().transpose(0, 1).repeat_interleave(4, 0)
    assert max_err(probs[b, :, :300, :300].double() @ vs, out[cu_q[b]:cu_q[b + 1]].transpose(0, 1)) < CAPS[dtype]
    dout = rand(q.shape, dtype, 15)
    check_backward(lambda a, b, c: flash_attn_varlen_func(a, b, c, int32(cu_q), int32(cu_k), 1000, 1000,
                                                          causal=causal),
                   q, k, v, cu_q, cu_k, causal, dout, "flash_attn_varlen_func backward")


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_dense_functions(dtype, causal):
    """flash_attn_func and its packed variants, (batch, seqlen, heads, d) on the GPU: each batch row is a sequence."""
    B, n_q, n_k = 3, 77, 300
    q, k, v = rand((B, n_q, 8, 64), dtype, 16), rand((B, n_k, 2, 64), dtype, 17), rand((B, n_k, 2, 64), dtype, 18)
    cu_q, cu_k = offsets([n_q] * B), offsets([n_k] * B)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    ours_lse = torch.where(lse == math.inf, -math.inf, lse).transpose(0, 1).reshape(8, -1)
    check_forward(flat(out), ours_lse, flat(q), flat(k), flat(v), cu_q, cu_k, causal, "flash_attn_func")
    kv = torch.stack((k, v), dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, causal=causal), out, atol=0, rtol=0)
    qkv = torch.stack((q, k[:, :n_q].repeat_interleave(4, 2), v[:, :n_q].repeat_interleave(4, 2)), dim=2)
    out = flash_attn_qkvpacked_func(qkv, causal=causal)
    cu = offsets([n_q] * B)
    q2, k2, v2 = (flat(qkv[:, :, i]) for i in range(3))
    check_forward(flat(out), call(q2, k2, v2, cu, cu, is_causal=causal)[1], q2, k2, v2, cu, cu, causal,
                  "flash_attn_qkvpacked_func")
    dout = rand(q.shape, dtype, 19)
    check_backward(lambda a, b, c: flat(flash_attn_func(a.view(q.shape), b.view(k.shape), c.view(v.shape),
                                                        causal=causal)),
                   flat(q), flat(k), flat(v), cu_q, cu_k, causal, flat(dout), "flash_attn_func backward")


# ---------------------------------------------------------------------------------------------------------
# the operators: opcheck, torch.compile, errors
# ---------------------------------------------------------------------------------------------------------
def test_opcheck():
    ops = torch.ops.cs149gpt
    q, k, v, cu_q, cu_k = packed([(12, 12), (5, 9), (0, 3)], 4, 2, 64, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(ops.varlen_attention.default, (q, k, v, int32(cu_q), int32(cu_k), 12, 12),
                          {"causal": True})
    out, lse = ops.varlen_attention(q, k, v, int32(cu_q), int32(cu_k), 12, 12, causal=True)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, int32(cu_q), int32(cu_k),
            12, 12)
    torch.library.opcheck(ops.varlen_attention_backward.default, args, {"causal": True},
                          test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = packed(MIXED, 8, 2, 64, torch.bfloat16, seed=20)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w = rand(q.shape, torch.bfloat16, 21)
    t_q, t_k = int32(cu_q), int32(cu_k)

    def fn(q, k, v):
        return (flash_attn_varlen_func(q, k, v, t_q, t_k, 1000, 1000, causal=True) * w).float().sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        loss = f(q, k, v)
        results.append((loss.detach(), torch.autograd.grad(loss, (q, k, v))))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    # dK, dV bit for bit; dQ is summed with float32 atomics in the order blocks finish: a bf16 ulp or two apart
    torch.testing.assert_close(g1[0], g0[0], rtol=1e-2, atol=1e-4)
    for a, b in zip(g0[1:], g1[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_what_cuda_does_not_take_is_refused_alike_in_eager_and_fake():
    """A paged KV cache (block_table) in a float32 varlen call is refused on CUDA (the float32 kernel reads packed k
    and v only), by the check the fake shares: the same error in eager mode and in FakeTensorMode (so torch.compile
    refuses it while tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cu_q, cu_k = packed([(12, 12), (5, 9)], 4, 2, 64, torch.float32)
    cache = rand((4, 16, 2, 64), torch.float32, 3)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=CUDA)
    fn = lambda q, k, v, cq, ck, t: cs149gpt.varlen_attention(q, k, v, cq, ck, 12, 12, block_table=t)  # noqa: E731
    args = (q, cache, cache, int32(cu_q), int32(cu_k), table)
    with pytest.raises(NotImplementedError, match="block_table.*float32") as eager:
        fn(*args)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args]
        with pytest.raises(NotImplementedError, match="block_table") as traced:
            fn(*fake)
    assert str(eager.value) == str(traced.value)


# ---------------------------------------------------------------------------------------------------------
# A paged KV cache (block_table): FlashAttention-2's forward gathers each key tile's rows through the sequence's table
# (any page size; pages shuffled, shared between sequences); against float64 from the definition on the keys gathered
# from the pages (tests/test_varlen_paged.py's reference), and bit for bit against the same kernel on those keys packed.
# ---------------------------------------------------------------------------------------------------------
def paged_setup(lengths, page, heads, d, dtype, seed, **kw):
    """q on the GPU; k_cache, v_cache, block_table on the GPU and their CPU copies (paged_cache's), the offsets."""
    from tests.test_varlen_paged import paged_cache

    g = torch.Generator().manual_seed(seed)
    cu_q, key_lengths = offsets([a for a, _ in lengths]), [b for _, b in lengths]
    q = torch.randn(cu_q[-1], heads[0], d, generator=g).to(dtype)
    kc, vc, table = paged_cache(key_lengths, page, heads[1], d, dtype, g, **kw)
    return q.to(CUDA), kc.to(CUDA), vc.to(CUDA), table.to(CUDA), (q, kc, vc, table), cu_q, key_lengths


def paged_call(q, kc, vc, table, cu_q, key_lengths, **kw):
    longest = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    return cs149gpt.varlen_attention(q, kc, vc, int32(cu_q), int32(offsets(key_lengths)), longest, max(key_lengths),
                                     block_table=table, return_lse=True, **kw)


def paged_call_on(hopper, *args, **kw):
    """paged_call's result, asserting (torch.profiler) that one forward kernel ran: Hopper's, or FlashAttention-2's."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = paged_call(*args, **kw)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel = "flash_fwd_hopper_kernel" if hopper else "flash_fwd_kernel"
    assert sum(kernel in n for n in names) == 1 and sum("flash_fwd" in n for n in names) == 1, names
    return got


def paged_reference(cpu, cu_q, key_lengths, **kw):
    from tests.test_varlen_paged import gather, reference

    q, kc, vc, table = cpu
    return reference(q, cu_q, gather(kc, table, key_lengths), gather(vc, table, key_lengths), scale=q.shape[-1] ** -0.5,
                     **kw)


def check_paged(got, want, dtype):
    out, lse = (t.cpu() for t in got)
    ref_out, ref_lse = want
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and out.dtype == dtype
    assert (out.double() - ref_out).abs().max().item() <= CAPS[dtype]
    seen = torch.isfinite(ref_lse)
    assert torch.equal(lse[~seen], ref_lse[~seen].float())  # −inf: a row that sees no key
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 1e-3
    assert torch.all(out[(~seen).transpose(0, 1)] == 0)


# (Nq, Nk): decode steps beside prefills, chunked prefill (Nq < Nk), empty sequences, keys without queries, queries
# without keys, and sequences of several key tiles.
PAGED = [(1, 40), (70, 70), (0, 0), (1, 1), (33, 90), (0, 17), (1, 300), (3, 0), (130, 200), (200, 1000)]


@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("dtype", FAST_DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
def test_paged_cache_forward(page, dtype, d, causal, heads):
    """Pages of 16 (FlashAttention-2's forward) and of 128 (Hopper's on sm_90)."""
    q, kc, vc, table, cpu, cu_q, nk = paged_setup(PAGED, page, heads, d, dtype, seed=d + causal)
    check_paged(paged_call(q, kc, vc, table, cu_q, nk, is_causal=causal), paged_reference(cpu, cu_q, nk, causal=causal),
                dtype)


@pytest.mark.parametrize("page", [1, 5, 64, 100, 256])
def test_paged_cache_page_sizes(page):
    """Pages of one key, of an odd count, as long as a key tile, ending inside one, longer than one."""
    q, kc, vc, table, cpu, cu_q, nk = paged_setup([(1, 700), (257, 300), (64, 64), (1, 1)], page, (4, 2), 128,
                                                  torch.bfloat16, seed=page)
    for causal in (False, True):
        check_paged(paged_call(q, kc, vc, table, cu_q, nk, is_causal=causal),
                    paged_reference(cpu, cu_q, nk, causal=causal), torch.bfloat16)


def test_paged_cache_options_and_shared_prefix():
    """Windows, softcap and ALiBi (the general kernel) through the table, with sequences sharing their first blocks."""
    q, kc, vc, table, cpu, cu_q, nk = paged_setup([(1, 200), (1, 150), (40, 230), (1, 64), (90, 90)], 32, (4, 2), 64,
                                                  torch.float16, seed=11, shared_prefix_pages=2)
    assert torch.equal(table[1, :2], table[0, :2])
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(5)) * 0.2
    for kw in (dict(window=(16, 0)), dict(softcap=5.0), dict(alibi_slopes=slopes)):
        ref_kw = dict(window=kw.get("window", (-1, -1)), softcap=kw.get("softcap", 0.0), slopes=kw.get("alibi_slopes"))
        dev_kw = {**kw, **({"alibi_slopes": slopes.to(CUDA)} if "alibi_slopes" in kw else {})}
        check_paged(paged_call(q, kc, vc, table, cu_q, nk, is_causal=True, **dev_kw),
                    paged_reference(cpu, cu_q, nk, causal=True, **ref_kw), torch.float16)


@pytest.mark.parametrize("page", [128, 256, 48])
@pytest.mark.parametrize("d", [64, 128])
def test_paged_cache_on_both_paths(page, d, forward_path):
    """Pages of a multiple of 128 rows, one after another in memory: on sm_90 Hopper's forward reads each key tile with
    one TMA copy at its page's row (a profiler count); other pages, and CS149GPT_HOPPER=0: FlashAttention-2's. The
    slots past each sequence's last key (its last page's rest, every unused block) are NaN: never in an output. A
    sequence of 3000 keys: d 128 past 2048 keys keeps the paged tile (Bc 128) without the causal mask too."""
    lengths = PAGED + [(64, 3000)]
    q, kc, vc, table, cpu, cu_q, nk = paged_setup(lengths, page, (8, 2), d, torch.bfloat16, seed=page + d)
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(nk):
        for t in range(n):
            used[cpu[3][b, t // page], t % page] = True
    kc[~used.to(CUDA)] = float("nan")
    vc[~used.to(CUDA)] = float("nan")
    hopper = forward_path == "hopper" and page % 128 == 0
    for causal in (False, True):
        got = paged_call_on(hopper, q, kc, vc, table, cu_q, nk, is_causal=causal)
        check_paged(got, paged_reference(cpu, cu_q, nk, causal=causal), torch.bfloat16)


def test_paged_cache_layouts(forward_path):
    """Pages of 128 rows whose rows are not one page after another (every other block of a larger buffer) take
    FlashAttention-2's forward on every GPU; a cache stored (Hkv, num_blocks, page, d) and permuted to the call's
    shape has them one after another within each head: Hopper's on sm_90. Both as the reference."""
    q, kc, vc, table, cpu, cu_q, nk = paged_setup(PAGED, 128, (4, 2), 128, torch.float16, seed=21)
    want = paged_reference(cpu, cu_q, nk, causal=True)
    apart_k = torch.full((2 * kc.shape[0],) + kc.shape[1:], float("nan"), dtype=kc.dtype, device=CUDA)
    apart_v = apart_k.clone()
    apart_k[::2], apart_v[::2] = kc, vc
    head_major_k = kc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    head_major_v = vc.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    for k, v, hopper in ((apart_k[::2], apart_v[::2], False), (head_major_k, head_major_v, forward_path == "hopper")):
        check_paged(paged_call_on(hopper, q, k, v, table, cu_q, nk, is_causal=True), want, torch.float16)


@pytest.mark.parametrize("dtype", FAST_DTYPES)
def test_paged_cache_equals_packed_keys(dtype, monkeypatch):
    """The paged call gives, bit for bit, what FlashAttention-2's kernel gives on the keys gathered into packed k, v:
    only where a key is read from differs."""
    from tests.test_varlen_paged import gather

    monkeypatch.setenv("CS149GPT_HOPPER", "0")
    q, kc, vc, table, cpu, cu_q, nk = paged_setup(PAGED, 16, (8, 2), 128, dtype, seed=3)
    k = torch.cat(gather(cpu[1], cpu[3], nk)).to(CUDA)
    v = torch.cat(gather(cpu[2], cpu[3], nk)).to(CUDA)
    for causal in (False, True):
        out, lse = paged_call(q, kc, vc, table, cu_q, nk, is_causal=causal)
        out_packed, lse_packed = call(q, k, v, cu_q, offsets(nk), is_causal=causal)
        assert torch.equal(out, out_packed) and torch.equal(lse, lse_packed)


def test_paged_cache_flash_attn_varlen_func():
    """FlashAttention's call on CUDA: cu_seqlens_k gives the lengths only, lse +inf where a row sees no key; a bad
    table entry is an IndexError (also a RuntimeError, as FlashAttention raises it) naming it."""
    q, kc, vc, table, cpu, cu_q, nk = paged_setup(PAGED, 16, (4, 2), 64, torch.bfloat16, seed=9)
    cu_k = int32(offsets(nk)) + 1000
    out, lse, _ = flash_attn_varlen_func(q, kc, vc, int32(cu_q), cu_k, 200, 1000, causal=True, block_table=table,
                                         return_attn_probs=True)
    ref_out, ref_lse = paged_reference(cpu, cu_q, nk, causal=True)
    assert (out.cpu().double() - ref_out).abs().max().item() <= CAPS[torch.bfloat16]
    seen = torch.isfinite(ref_lse)
    assert torch.all(lse.cpu()[~seen] == math.inf)
    bad = table.clone()
    bad[1, 2] = kc.shape[0]
    with pytest.raises(IndexError, match=r"block_table\[1, 2\] = ") as e:
        flash_attn_varlen_func(q, kc, vc, int32(cu_q), cu_k, 200, 1000, block_table=bad)
    assert isinstance(e.value, RuntimeError)


# ---------------------------------------------------------------------------------------------------------
# Windows, softcap, ALiBi, dropout and a negative scale in varlen calls: the general kernel over packed sequences,
# each block on its sequence's view; against the CPU's varlen kernel (tested against float64 in test_varlen.py; a
# negative scale there only in test_attention.py's dense calls) on the same inputs in float32, and the same (seed,
# offset) for dropout (both devices draw the same keep mask).
# ---------------------------------------------------------------------------------------------------------
FEATURES = {
    "window (16, 0)": dict(window_left=16, window_right=0),
    "window (40, 7) causal": dict(window_left=40, window_right=7, causal=True),
    "softcap": dict(softcap=5.0, scale=0.5),
    "alibi (H,)": dict(alibi="heads"),
    "alibi (B,H) causal": dict(alibi="rows", causal=True),
    "softcap+alibi+window causal": dict(softcap=8.0, alibi="heads", window_left=30, window_right=-1, causal=True),
    "dropout 0.2": dict(dropout_p=0.2),
    "dropout 0.1 causal alibi": dict(dropout_p=0.1, alibi="heads", causal=True),
    "scale -0.3 causal": dict(scale=-0.3, causal=True),
}
FEATURE_LENGTHS = [(77, 77), (0, 5), (1, 1), (300, 300), (5, 0), (300, 77), (77, 300), (1, 200)]


def op_call(q, k, v, cu_q, cu_k, seed, alibi_slopes, kw, device):
    """torch.ops.cs149gpt.varlen_attention on `device` with an explicit dropout (seed, offset)."""
    longest = lambda cu: max(b - a for a, b in zip(cu, cu[1:]))  # noqa: E731
    to = lambda t: t.to(device) if t is not None else None  # noqa: E731
    return torch.ops.cs149gpt.varlen_attention(
        to(q), to(k), to(v), to(int32(cu_q)), to(int32(cu_k)), longest(cu_q), longest(cu_k), kw.get("scale"),
        bool(kw.get("causal", False)), kw.get("window_left", -1), kw.get("window_right", -1),
        float(kw.get("dropout_p", 0.0)), seed, float(kw.get("softcap", 0.0)), to(alibi_slopes), None)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_features_forward_backward_equal_the_cpu(dtype, feature):
    kw = FEATURES[feature]
    hq, hkv, d = 4, 2, 64
    q, k, v, cu_q, cu_k = packed(FEATURE_LENGTHS, hq, hkv, d, dtype, seed=41)
    batch = len(cu_q) - 1
    slopes = {None: None, "heads": torch.linspace(0.05, 0.5, hq, device=CUDA),
              "rows": torch.linspace(0.05, 0.5, batch * hq, device=CUDA).reshape(batch, hq)}[kw.get("alibi")]
    seed = torch.tensor([1234, 56], dtype=torch.int64) if kw.get("dropout_p") else None
    out, lse = op_call(q, k, v, cu_q, cu_k, seed, slopes, kw, CUDA)
    want, want_lse = op_call(q.float(), k.float(), v.float(), cu_q, cu_k, seed, slopes, kw, "cpu")
    err = max_err(out.cpu(), want)
    assert err <= CAPS[dtype], f"{feature}: out max abs error {err:.3g} against the CPU's float32"
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), f"{feature}: lse -inf at other rows"
    assert max_err(lse.cpu()[finite], want_lse[finite]) <= 1e-2, feature

    # Gradients: the CUDA backward against the CPU's, through autograd on both devices.
    dout = rand(q.shape, dtype, 43)

    def grads_on(device, cast):
        leaves = [cast(t).to(device).detach().requires_grad_() for t in (q, k, v)]
        o = op_call(*leaves, cu_q, cu_k, seed, slopes, kw, device)[0]
        return torch.autograd.grad(o, leaves, cast(dout).to(device))

    ours = grads_on(CUDA, lambda t: t)
    theirs = grads_on("cpu", lambda t: t.float())
    scale = max(g.abs().max().item() for g in theirs if g.numel()) + 1e-6
    cap = 4e-2 if dtype == torch.bfloat16 else 1e-2
    for name, got, ref in zip(("dq", "dk", "dv"), ours, theirs):
        assert torch.isfinite(got).all(), f"{feature}: {name} non-finite"
        e = max_err(got.cpu(), ref) / scale
        assert e <= cap, f"{feature}: {name} relative max error {e:.3g} against the CPU's float32"


@pytest.mark.parametrize("cu_q, cu_k, max_q, error, match", [
    ([0, 5, 3], [0, 5, 9], 5, ValueError, r"cu_seqlens_q must not decrease"),
    ([0, 5, 11], [0, 5, 9], 6, ValueError, r"cu_seqlens_q\[-1\] = 11 reaches past the 10 rows of q"),
    ([0, 5, 10], [0, 5, 9], 4, ValueError, r"max_seqlen_q = 4 is less than the longest sequence"),
])
def test_bad_offsets_are_refused_as_on_the_cpu(cu_q, cu_k, max_q, error, match):
    """cu_seqlens are read once on the host and checked as the CPU checks them: the same errors, no kernel launched."""
    q, k, v = rand((10, 2, 64), torch.bfloat16, 0), rand((9, 2, 64), torch.bfloat16, 1), rand((9, 2, 64),
                                                                                             torch.bfloat16, 2)
    with pytest.raises(error, match=match) as on_gpu:
        cs149gpt.varlen_attention(q, k, v, int32(cu_q), int32(cu_k), max_q, 9)
    with pytest.raises(error) as on_cpu:
        cs149gpt.varlen_attention(q.cpu(), k.cpu(), v.cpu(), int32(cu_q).cpu(), int32(cu_k).cpu(), max_q, 9)
    assert str(on_gpu.value) == str(on_cpu.value)
    with pytest.raises(ValueError, match="one device"):
        cs149gpt.varlen_attention(q, k, v, int32(cu_q).cpu(), int32(cu_k), max_q, 9)


@pytest.mark.parametrize("window", [None, (150, 0)], ids=["no_window", "window"])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_of_packed_sequences(causal, window, forward_path):
    """torch.use_deterministic_algorithms(True): the packed backward adds each sequence's dQ blocks in key order, so
    repeated calls give the same bits, the same as each sequence's own dense deterministic call. window: the general
    kernel's turns from the first key tile a query tile's window reaches, with each sequence's own offset."""
    lengths = [(700, 700), (1, 300), (1030, 900), (300, 1)]
    q, k, v, cu_q, cu_k = packed(lengths, 8, 2, 128, torch.bfloat16, seed=12)
    dout = rand(q.shape, torch.bfloat16, 13)

    def packed_grads():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = call(*leaves, cu_q, cu_k, is_causal=causal, window=window)
        torch.autograd.backward(out, dout)
        return [t.grad for t in leaves]

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = packed_grads()
        for _ in range(3):
            for name, a, b in zip(("dq", "dk", "dv"), first, packed_grads()):
                assert torch.equal(a, b), f"{name}: bits differ between two deterministic calls"
        # (packed calls with a window take FlashAttention-2's kernel, dense ones Hopper's where it runs: other bits)
        for s in range(len(lengths) if window is None or forward_path == "fa2" else 0):
            rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            leaves = [t.transpose(0, 1).detach().requires_grad_() for t in (q[rows], k[keys], v[keys])]
            out = cs149gpt.attention(*leaves, is_causal="bottom_right" if causal else False, window=window)
            torch.autograd.backward(out, dout[rows].transpose(0, 1))
            assert torch.equal(first[0][rows], leaves[0].grad.transpose(0, 1)), f"sequence {s}: dq"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
