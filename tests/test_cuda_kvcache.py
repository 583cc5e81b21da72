"""attention_with_kvcache and flash_attn_with_kvcache on CUDA tensors (csrc/cuda/flash_decode.cu). Skipped without a GPU.

Against a float64 reference on the gathered (logical) cache, written from the definition (csrc/module.cpp): contiguous
and paged caches (shuffled blocks, unused blocks NaN), k_new/v_new appended in place (the caches checked after),
per-sequence lengths 0, 1 and up to the capacity, cache_leftpad, cache_batch_idx, GQA groups 1/4/8, q_len 1 and 4,
causal and not, sliding windows, softcap, ALiBi, lse, lengths to 20k (the split-KV path and its merge), int32/int64
lengths, the non-finite rule, the CUDA op against the CPU op on the same inputs, and the CUDA-only refusals.
"""
import math

import pytest
import torch

import cs149gpt
from tests._helpers import check_window_wider_than_every_sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

CUDA = "cuda"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Norm-relative error against float64 on the same inputs: the kernel accumulates in float32 and rounds out once.
REL_TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2e-5}
LSE_TOL = 1e-3


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, g, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


def reference(q, k_log, v_log, ends, starts=None, causal=True, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """out (B, Hq, Nq, d) and lse (B, Hq, Nq) in float64: sequence b's queries against rows [starts[b], ends[b]) of its
    logical cache k_log[b] (B, Hkv, rows, d); key j counted from starts[b]; causal and window bottom-right aligned to
    L = ends[b] − starts[b]; softcap then ALiBi (−slope · |i + L − Nq − j|). A row that sees no key: 0 and −inf."""
    B, hq, nq, d = q.shape
    group = hq // k_log.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(B, hq, nq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((B, hq, nq), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(B):
        s0 = 0 if starts is None else int(starts[b])
        n = int(ends[b]) - s0
        if n <= 0:
            continue
        k = k_log[b, :, s0:s0 + n].double().repeat_interleave(group, 0)  # (Hq, n, d)
        v = v_log[b, :, s0:s0 + n].double().repeat_interleave(group, 0)
        s = q[b].double() @ k.transpose(-1, -2) * scale  # (Hq, Nq, n)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        diag = i + n - nq
        if slopes is not None:
            sl = (slopes[b] if slopes.dim() == 2 else slopes).double()[:, None, None]
            s = s - sl * (diag - j).abs()
        shown = torch.ones(nq, n, dtype=torch.bool, device=q.device)
        if causal:
            shown &= j <= diag
        if window[0] >= 0:
            shown &= j >= diag - window[0]
        if window[1] >= 0:
            shown &= j <= diag + window[1]
        s = s.masked_fill(~shown, -math.inf)
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v
    return out, lse


def assert_close(out, ref, dtype, what=""):
    assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), (out.dtype, out.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.3g} > {REL_TOL[dtype]:.3g}"


def assert_lse(lse, ref, what=""):
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), f"{what}: lse -inf at other rows"
    fin = torch.isfinite(ref)
    err = (lse.double()[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= LSE_TOL, f"{what}: lse error {err:.3g}"


def block_table(B, cap, page, g, spare=3):
    """A shuffled table (B, cap / page) int32 over B · cap / page + spare blocks, and the number of blocks."""
    per = cap // page
    num_blocks = B * per + spare
    return torch.randperm(num_blocks, generator=g)[:B * per].view(B, per).to(torch.int32), num_blocks


def to_blocks(x_log, table, num_blocks, page):
    """The logical cache (B, Hkv, cap, d) as blocks (num_blocks, Hkv, page, d) placed by the table, unused ones NaN."""
    B, hkv, cap, d = x_log.shape
    blocks = torch.full((num_blocks, hkv, page, d), float("nan"), dtype=x_log.dtype)
    for b in range(B):
        for i in range(table.shape[1]):
            blocks[table[b, i]] = x_log[b, :, i * page:(i + 1) * page]
    return blocks


def logical(blocks, table):
    """The logical cache (B, Hkv, per · page, d) of blocks and a table."""
    return torch.stack([torch.cat([blocks[t] for t in row.tolist()], dim=1) for row in table])


def make_case(B, hq, hkv, nq, cap, d, dtype, n_new, seed, lengths=None):
    g = gen(seed)
    q = randn((B, hq, nq, d), g, dtype)
    k, v = randn((B, hkv, cap, d), g, dtype), randn((B, hkv, cap, d), g, dtype)
    k_new = randn((B, hkv, n_new, d), g, dtype) if n_new else None
    v_new = randn((B, hkv, n_new, d), g, dtype) if n_new else None
    if lengths is None:
        room = cap - n_new
        lengths = torch.randint(0, room + 1, (B,), generator=g)
        lengths[0] = room
        if B > 1:
            lengths[1] = 0
        if B > 2:
            lengths[2] = 1
    return g, q, k, v, k_new, v_new, torch.as_tensor(lengths, dtype=torch.int32)


def appended(k, k_new, lengths):
    """The logical cache after k_new is written at each sequence's length."""
    k = k.clone()
    if k_new is not None:
        for b in range(k.shape[0]):
            n = int(lengths[b])
            k[b, :, n:n + k_new.shape[2]] = k_new[b]
    return k


def run(q, k, v, lengths, k_new=None, v_new=None, page=None, g=None, device=CUDA, **kw):
    """The op on `device` on copies of the caches, contiguous or paged (page rows a block, a table drawn from g): out,
    lse, and the logical caches after."""
    B, hq, nq, _ = q.shape
    table = None
    if page is not None:
        table, num_blocks = block_table(B, k.shape[2], page, g)
        k, v = to_blocks(k, table, num_blocks, page), to_blocks(v, table, num_blocks, page)
    dev = lambda t: None if t is None else t.to(device)
    kc, vc = k.clone().to(device), v.clone().to(device)
    lse = torch.empty(B, hq, nq, dtype=torch.float32, device=device)
    out = cs149gpt.attention_with_kvcache(dev(q), kc, vc, dev(lengths), k_new=dev(k_new), v_new=dev(v_new),
                                          block_table=dev(table), lse=lse, **kw)
    if table is not None:
        kc, vc = logical(kc.cpu(), table), logical(vc.cpu(), table)
    return out, lse, kc.cpu(), vc.cpu(), table


def check(dtype, B, hq, hkv, nq, cap, d, n_new, page, seed, causal=True, window=(-1, -1), softcap=0.0, alibi=None,
          lengths=None):
    g, q, k, v, k_new, v_new, lengths = make_case(B, hq, hkv, nq, cap, d, dtype, n_new, seed, lengths)
    slopes = None
    if alibi == "head":
        slopes = torch.rand(hq, generator=g) * 0.2
    elif alibi == "batch":
        slopes = torch.rand(B, hq, generator=g) * 0.2
    kw = dict(is_causal=causal, window=None if window == (-1, -1) else window, softcap=softcap,
              alibi_slopes=None if slopes is None else slopes.to(CUDA))
    out, lse, k_after, v_after, _ = run(q, k, v, lengths, k_new, v_new, page, g, **kw)
    k_exp, v_exp = appended(k, k_new, lengths), appended(v, v_new, lengths)
    label = f"{dtype} B{B} Hq{hq} Hkv{hkv} Nq{nq} cap{cap} d{d} new{n_new} page{page} causal{causal} window{window}"
    torch.testing.assert_close(k_after, k_exp, rtol=0, atol=0, msg=f"{label}: k cache after the append")
    torch.testing.assert_close(v_after, v_exp, rtol=0, atol=0, msg=f"{label}: v cache after the append")
    ref, ref_lse = reference(q.to(CUDA), k_exp.to(CUDA), v_exp.to(CUDA), lengths + n_new, causal=causal,
                             window=window, softcap=softcap, slopes=None if slopes is None else slopes.to(CUDA))
    assert_close(out, ref, dtype, label)
    assert_lse(lse, ref_lse, label)


# ---------------------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("n_new", [0, 1, 4], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("nq", [1, 4], ids=lambda n: f"nq{n}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda n: f"group{n}")
@pytest.mark.parametrize("d", [64, 128], ids=lambda n: f"d{n}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode(dtype, d, group, nq, n_new, page):
    """Lengths 0, 1, random and full; appends checked in the caches; causal (bottom-right)."""
    check(dtype, 4, 2 * group, 2, nq, 320, d, n_new, page, seed=d + 10 * group + 100 * nq + 1000 * n_new + (page or 0))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("page", [None, 1, 5, 64], ids=lambda p: f"page{p}")
def test_page_sizes_and_not_causal(page, causal):
    check(torch.bfloat16, 3, 8, 2, 3, 320, 128, 2, page, seed=7, causal=causal)


@pytest.mark.parametrize("window", [(0, 0), (16, 0), (100, 3), (-1, 0), (5, -1)], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window(window, causal):
    check(torch.bfloat16, 3, 8, 2, 4, 320, 128, 1, 16, seed=11, causal=causal, window=window)


@pytest.mark.parametrize("mods", [dict(softcap=1.5), dict(alibi="head"), dict(softcap=3.0, alibi="batch")],
                         ids=["softcap", "alibi", "softcap+alibi_batch"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_and_alibi(dtype, page, mods):
    check(dtype, 3, 8, 2, 2, 256, 64, 1, page, seed=13, window=(40, -1), **mods)


@pytest.mark.parametrize("page", [None, 256], ids=["contiguous", "paged256"])
@pytest.mark.parametrize("nq", [1, 4], ids=lambda n: f"nq{n}")
def test_long_cache_split(page, nq):
    """Lengths to 20k keys at batch 2: many splits per sequence, merged through lse (and one sequence short)."""
    check(torch.bfloat16, 2, 32, 8, nq, 20480, 128, 1, page, seed=17, lengths=[20479, 700])


@pytest.mark.parametrize("dtype, page", [(torch.bfloat16, None), (torch.bfloat16, 256), (torch.float32, None)],
                         ids=["bf16", "bf16-paged256", "float32"])
def test_merge_of_many_splits(dtype, page):
    """One (batch, kv head) against 40k keys: a block a split, so the splits fill the GPU (more than 32 on a GPU of 17
    SMs or more, up to kDecodeMaxSplits = 128): the merge weighs splits past its first 32 too."""
    check(dtype, 1, 4, 1, 1, 40960, 64, 0, page, seed=29, lengths=[40000])


def test_decode_steps_replayed_from_a_cuda_graph():
    """A decoding step (append a token, attend over a long cache: split-KV, its merge launched dependent on the splits)
    captured in a CUDA graph, replayed with new tokens and the lengths advanced in place: each replay gives the eager
    step's bits, and the caches the same rows."""
    g = gen(31)
    B, hq, hkv, cap, d, dt = 2, 8, 2, 8192, 128, torch.bfloat16
    k, v = (randn((B, hkv, cap, d), g, dt).to(CUDA) for _ in "kv")
    tokens = [[randn(shape, g, dt).to(CUDA) for shape in ((B, hq, 1, d), (B, hkv, 1, d), (B, hkv, 1, d))]
              for _ in range(3)]
    lengths = torch.tensor([6000, 8000], dtype=torch.int32, device=CUDA)

    kc, vc, lens = k.clone(), v.clone(), lengths.clone()
    q, k_new, v_new = (t.clone() for t in tokens[0])
    step = lambda: cs149gpt.attention_with_kvcache(q, kc, vc, lens, k_new=k_new, v_new=v_new)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    kc.copy_(k), vc.copy_(v), lens.copy_(lengths)  # the warm-up's append undone

    kr, vr, lens_r = k.clone(), v.clone(), lengths.clone()
    for t, (q_t, k_t, v_t) in enumerate(tokens):
        q.copy_(q_t), k_new.copy_(k_t), v_new.copy_(v_t)
        graph.replay()
        expected = cs149gpt.attention_with_kvcache(q_t, kr, vr, lens_r, k_new=k_t, v_new=v_t)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"step {t}")
        lens.add_(1), lens_r.add_(1)
    torch.cuda.synchronize()
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_rows_over_several_tiles_with_splits(dtype):
    """GQA group 8 at q_len 3: 24 rows, a full row tile and one of 8 rows and 8 padding rows; long caches (several
    splits, the last ending in a partial key tile), a window cutting across the splits, paged."""
    check(dtype, 2, 16, 2, 3, 4096, 64, 1, 16, seed=18, window=(2500, -1), lengths=[4000, 1500])


@pytest.mark.parametrize("window", [(-1, -1), (3000, 0)], ids=["causal", "window"])
def test_long_cache_split_float32(window):
    check(torch.float32, 2, 8, 8, 1, 20480, 64, 0, None, seed=19, lengths=[20480, 9000], window=window)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("n_new", [0, 3], ids=lambda n: f"new{n}")
def test_cache_leftpad(page, n_new):
    g = gen(23)
    B, hq, hkv, nq, cap, d = 4, 8, 2, 2, 256, 128
    q, k, v = randn((B, hq, nq, d), g, torch.bfloat16), *(randn((B, hkv, cap, d), g, torch.bfloat16) for _ in "kv")
    k_new = randn((B, hkv, n_new, d), g, torch.bfloat16) if n_new else None
    v_new = randn((B, hkv, n_new, d), g, torch.bfloat16) if n_new else None
    lengths = torch.tensor([200, 37, 5, 250 - n_new], dtype=torch.int32)
    leftpad = torch.tensor([0, 37, 1, 90], dtype=torch.int32)  # 37: a sequence of no cached key
    for b in range(B):  # the left padding is never read
        k[b, :, :int(leftpad[b])] = float("nan")
        v[b, :, :int(leftpad[b])] = float("nan")
    out, lse, k_after, v_after, _ = run(q, k, v, lengths, k_new, v_new, page, g, cache_leftpad=leftpad.to(CUDA))
    k_exp, v_exp = appended(k, k_new, lengths), appended(v, v_new, lengths)
    torch.testing.assert_close(k_after, k_exp, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_after, v_exp, rtol=0, atol=0, equal_nan=True)
    ref, ref_lse = reference(q.to(CUDA), k_exp.to(CUDA), v_exp.to(CUDA), lengths + n_new, leftpad)
    assert_close(out, ref, torch.bfloat16, "leftpad")
    assert_lse(lse, ref_lse, "leftpad")


@pytest.mark.parametrize("n_new", [0, 2], ids=lambda n: f"new{n}")
def test_cache_batch_idx(n_new):
    """Sequence b reads (and appends to) cache row cache_batch_idx[b] of a larger cache; other rows untouched."""
    g = gen(29)
    B, rows, hq, hkv, nq, cap, d = 3, 6, 8, 2, 1, 192, 64
    q = randn((B, hq, nq, d), g, torch.float16)
    k, v = randn((rows, hkv, cap, d), g, torch.float16), randn((rows, hkv, cap, d), g, torch.float16)
    k_new = randn((B, hkv, n_new, d), g, torch.float16) if n_new else None
    v_new = randn((B, hkv, n_new, d), g, torch.float16) if n_new else None
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    lengths = torch.tensor([100, 0, 190 - n_new], dtype=torch.int32)
    kc, vc = k.to(CUDA), v.to(CUDA)
    lse = torch.empty(B, hq, nq, device=CUDA)
    dev = lambda t: None if t is None else t.to(CUDA)
    out = cs149gpt.attention_with_kvcache(q.to(CUDA), kc, vc, lengths.to(CUDA), k_new=dev(k_new), v_new=dev(v_new),
                                          cache_batch_idx=idx.to(CUDA), lse=lse)
    k_exp, v_exp = k.clone(), v.clone()
    k_exp[idx.long()] = appended(k[idx.long()], k_new, lengths)
    v_exp[idx.long()] = appended(v[idx.long()], v_new, lengths)
    torch.testing.assert_close(kc.cpu(), k_exp, rtol=0, atol=0)
    torch.testing.assert_close(vc.cpu(), v_exp, rtol=0, atol=0)
    ref, ref_lse = reference(q.to(CUDA), k_exp[idx.long()].to(CUDA), v_exp[idx.long()].to(CUDA), lengths + n_new)
    assert_close(out, ref, torch.float16, "cache_batch_idx")
    assert_lse(lse, ref_lse, "cache_batch_idx")


def test_int64_lengths_equal_int32():
    g, q, k, v, _, _, lengths = make_case(3, 8, 2, 1, 300, 128, torch.bfloat16, 0, seed=31)
    a = cs149gpt.attention_with_kvcache(q.to(CUDA), k.to(CUDA), v.to(CUDA), lengths.to(CUDA))
    b = cs149gpt.attention_with_kvcache(q.to(CUDA), k.to(CUDA), v.to(CUDA), lengths.long().to(CUDA))
    assert torch.equal(a, b)


@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("nq,n_new", [(1, 1), (4, 4), (3, 0)], ids=["decode", "speculative4", "chunk3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_equals_cpu(dtype, nq, n_new, page):
    """The same inputs through the CPU op and the CUDA op: the same caches after, outputs and lse within rounding."""
    g, q, k, v, k_new, v_new, lengths = make_case(4, 16, 4, nq, 2048, 128, dtype, n_new, seed=37)
    kw = dict(window=(500, 0), softcap=20.0)
    cpu = run(q, k, v, lengths, k_new, v_new, page, gen(41), device="cpu", **kw)
    gpu = run(q, k, v, lengths, k_new, v_new, page, gen(41), device=CUDA, **kw)
    torch.testing.assert_close(gpu[2], cpu[2], rtol=0, atol=0)
    torch.testing.assert_close(gpu[3], cpu[3], rtol=0, atol=0)
    diff = (gpu[0].cpu().double() - cpu[0].double()).norm() / cpu[0].double().norm()
    assert diff <= 2 * REL_TOL[dtype], f"CUDA vs CPU: relative difference {diff:.3g}"
    torch.testing.assert_close(gpu[1].cpu(), cpu[1], rtol=1e-4, atol=LSE_TOL)


# ---------------------------------------------------------------------------------------------------------
# Non-finite values: the CPU's rule
# ---------------------------------------------------------------------------------------------------------
def test_hidden_keys_never_read():
    """NaN past each sequence's length, in the causally hidden new keys' rows, and in unused blocks: no effect."""
    g = gen(43)
    B, hq, hkv, nq, cap, d = 2, 8, 2, 4, 512, 128
    q = randn((B, hq, nq, d), g, torch.bfloat16)
    k, v = randn((B, hkv, cap, d), g, torch.bfloat16), randn((B, hkv, cap, d), g, torch.bfloat16)
    lengths = torch.tensor([300, 7], dtype=torch.int32)
    k_nan, v_nan = k.clone(), v.clone()
    for b in range(B):
        k_nan[b, :, int(lengths[b]):] = float("nan")
        v_nan[b, :, int(lengths[b]):] = float("inf")
    clean = run(q, k, v, lengths, page=None)[0]
    dirty = run(q, k_nan, v_nan, lengths, page=None)[0]
    assert torch.equal(clean, dirty)
    # Causal, Nq 4: the last cached key is hidden from the first three rows: NaN there reaches the last row only.
    k_nan = k.clone()
    for b in range(B):
        k_nan[b, :, int(lengths[b]) - 1] = float("nan")
    out = run(q, k_nan, v, lengths, page=None)[0]
    assert torch.isnan(out[:, :, 3]).all() and torch.equal(out[:, :, :3], clean[:, :, :3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hidden_nonfinite_values_never_reach_a_row(dtype):
    """NaN/inf in the value row of a key hidden from some rows of a block but shown to others (causal diagonal at q_len
    4, a window's edge, rows that see no key): only the rows that see it change. On tensor cores P V multiplies every
    key into every row of the tile, a hidden one by 0, so 0·NaN must be kept out."""
    g = gen(44)
    B, hq, hkv, nq, cap, d = 3, 16, 4, 4, 640, 128  # G·q_len = 16 rows: one tile
    q = randn((B, hq, nq, d), g, dtype)
    k, v = randn((B, hkv, cap, d), g, dtype), randn((B, hkv, cap, d), g, dtype)
    lengths = torch.tensor([600, 130, 2], dtype=torch.int32)
    for window in ((-1, -1), (8, 0)):
        kw = dict(window=None if window == (-1, -1) else window)
        clean_lse = run(q, k, v, lengths, **kw)[1]
        ref_out, ref_lse = reference(q.to(CUDA), k.to(CUDA), v.to(CUDA), lengths, window=window)
        v_bad = v.clone()
        for b in range(2):
            n = int(lengths[b])
            if window == (-1, -1):  # causal: key L−1 is seen by position 3 only, key L−2 by positions 2 and 3
                v_bad[b, :, n - 1] = float("nan")
                v_bad[b, :, n - 2] = float("inf")
            else:  # window (8, 0): key L−12 is seen by position 0 only
                v_bad[b, :, n - 12] = float("nan")
        v_bad[2, :, 0] = float("nan")  # sequence 2 (2 keys): positions 0 and 1 see no key, 2 and 3 see key 0 (both)
        out, lse = run(q, k, v_bad, lengths, **kw)[:2]
        torch.testing.assert_close(lse, clean_lse, rtol=0, atol=0)  # the logits are unchanged
        for b in range(B):
            bad = [2, 3] if b == 2 or window == (-1, -1) else [0]
            for i in range(nq):
                row, want = out[b, :, i], ref_out[b, :, i]
                if i in bad:
                    assert not torch.isfinite(row).any(dim=-1).any(), (window, b, i)
                elif torch.isinf(ref_lse[b, :, i]).all():
                    assert torch.equal(row.cpu(), torch.zeros_like(row.cpu())), (window, b, i)
                else:
                    assert_close(row.contiguous(), want, dtype, f"{window} sequence {b} position {i}")


def test_nan_and_inf_rows():
    g = gen(47)
    B, hq, hkv, nq, cap, d = 2, 4, 1, 1, 1024, 64
    q = randn((B, hq, nq, d), g, torch.float16)
    k, v = randn((B, hkv, cap, d), g, torch.float16), randn((B, hkv, cap, d), g, torch.float16)
    lengths = torch.tensor([1000, 900], dtype=torch.int32)
    q[0, 1, 0, 3] = float("nan")  # a NaN logit: the row is NaN, lse NaN
    k[1, 0, 800, 5] = float("inf")  # +inf logits for the q that meet it positively, NaN rows
    out, lse, *_ = run(q, k, v, lengths)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1]).all()
    others = [(0, 0), (0, 2), (0, 3)]
    assert all(torch.isfinite(out[b, h]).all() for b, h in others)
    for h in range(hq):  # key 800's logit is +inf where q's column 5 is positive (NaN row), else −inf (weight 0)
        assert bool(torch.isnan(out[1, h]).all()) == bool(q[1, h, 0, 5] > 0), h
    v2 = v.clone()
    v2[0, 0, 10] = float("nan")  # a NaN value row a row sees: NaN in every query head of the group
    out2 = run(q, k, v2, lengths)[0]
    assert torch.isnan(out2[0]).any(dim=-1).all()


def test_single_visible_key_returns_its_value_bitwise():
    """Window (0, 0): each row sees one key: out is that value row exactly, lse its logit; long caches (splits) too."""
    g = gen(53)
    B, hq, hkv, nq, cap, d = 2, 8, 2, 2, 8192, 128
    q = randn((B, hq, nq, d), g, torch.bfloat16)
    k, v = randn((B, hkv, cap, d), g, torch.bfloat16), randn((B, hkv, cap, d), g, torch.bfloat16)
    lengths = torch.tensor([8192, 3000], dtype=torch.int32)
    out = run(q, k, v, lengths, window=(0, 0))[0].cpu()
    for b in range(B):
        for i in range(nq):
            row = int(lengths[b]) - nq + i
            want = v[b, :, row].repeat_interleave(hq // hkv, 0)
            assert torch.equal(out[b, :, i], want)


def test_rows_that_see_no_key():
    """Empty caches, and rows a window hides everything from: out 0, lse −inf."""
    g = gen(59)
    q = randn((2, 4, 3, 64), g, torch.bfloat16)
    k, v = randn((2, 2, 64, 64), g, torch.bfloat16), randn((2, 2, 64, 64), g, torch.bfloat16)
    out, lse, *_ = run(q, k, v, torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu())) and (lse[0] == -math.inf).all()
    assert torch.equal(out[1, :, 0].cpu(), torch.zeros_like(out[1, :, 0].cpu())) and (lse[1, :, 0] == -math.inf).all()


# ---------------------------------------------------------------------------------------------------------
# The flash_attn surface, opcheck, refusals
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
def test_flash_attn_with_kvcache_cuda_equals_cpu(paged_cache):
    from cs149gpt.flash_attn import flash_attn_with_kvcache

    g = gen(61)
    B, s_q, h, h_kv, d, cap, page = 3, 1, 16, 4, 128, 512, 64
    q = randn((B, s_q, h, d), g, torch.bfloat16)
    if paged_cache:
        table = torch.randperm(B * cap // page, generator=g).view(B, cap // page).to(torch.int32)
        k_cache = randn((B * cap // page, page, h_kv, d), g, torch.bfloat16)
    else:
        table = None
        k_cache = randn((B, cap, h_kv, d), g, torch.bfloat16)
    v_cache = torch.randn(k_cache.shape, generator=g).to(torch.bfloat16)
    k, v = randn((B, 1, h_kv, d), g, torch.bfloat16), randn((B, 1, h_kv, d), g, torch.bfloat16)
    seqlens = torch.tensor([0, 300, 511], dtype=torch.int32)
    results = {}
    for device in ("cpu", CUDA):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        out, lse = flash_attn_with_kvcache(q.to(device), kc, vc, k.to(device), v.to(device),
                                           cache_seqlens=seqlens.to(device), causal=True,
                                           block_table=None if table is None else table.to(device),
                                           return_softmax_lse=True)
        results[device] = (out.cpu(), lse.cpu(), kc.cpu(), vc.cpu())
    cpu, gpu = results["cpu"], results[CUDA]
    assert torch.equal(gpu[2], cpu[2]) and torch.equal(gpu[3], cpu[3])
    diff = (gpu[0].double() - cpu[0].double()).norm() / cpu[0].double().norm()
    assert diff <= 2 * REL_TOL[torch.bfloat16]
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-4, atol=LSE_TOL)


@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
def test_decode_step_never_synchronises(paged_cache):
    """A decoding step (append, rotary, attend; lse too) on CUDA makes no device-to-host synchronisation: under
    torch.cuda.set_sync_debug_mode("error") any would raise. It takes the C++ eager path (kvcache_fast), and its
    results match the CPU's (the same positions rotated; the kernel's error against float64 there)."""
    from cs149gpt import _ext
    from cs149gpt.flash_attn import flash_attn_with_kvcache

    g = gen(83)
    B, h, h_kv, d, cap, page = 2, 8, 2, 64, 256, 32
    q = randn((B, 1, h, d), g, torch.bfloat16)
    table = torch.randperm(B * cap // page, generator=g).view(B, cap // page).to(torch.int32) if paged_cache else None
    shape = (B * cap // page, page, h_kv, d) if paged_cache else (B, cap, h_kv, d)
    k_cache, v_cache = randn(shape, g, torch.bfloat16), randn(shape, g, torch.bfloat16)
    k, v = randn((B, 1, h_kv, d), g, torch.bfloat16), randn((B, 1, h_kv, d), g, torch.bfloat16)
    angles = torch.arange(cap)[:, None] * (10000.0 ** (-torch.arange(d // 4) / (d // 4)))[None, :]
    cos, sin = angles.cos(), angles.sin()  # rotary_dim d / 2
    seqlens = torch.tensor([17, 200], dtype=torch.int32)
    results = {}
    for device in ("cpu", CUDA):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        args = dict(k=k.to(device), v=v.to(device), rotary_cos=cos.to(device), rotary_sin=sin.to(device),
                    cache_seqlens=seqlens.to(device), causal=True, return_softmax_lse=True,
                    block_table=None if table is None else table.to(device))
        qd = q.to(device)
        flash_attn_with_kvcache(qd, kc.clone(), vc.clone(), **args)  # (warm-up: first-call work may synchronise)
        if device == CUDA:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, lse = flash_attn_with_kvcache(qd, kc, vc, **args)
            step = cs149gpt.attention_with_kvcache(qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                   args["cache_seqlens"], block_table=args["block_table"])
            fast = _ext.load().kvcache_fast(qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                            args["cache_seqlens"], None, None, args["block_table"], None, True, None,
                                            None, None, 0.0, None, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert fast is not None
        results[device] = (out.cpu(), lse.cpu(), kc.cpu(), vc.cpu(), step.cpu())
    cpu, gpu = results["cpu"], results[CUDA]
    for i in (2, 3):  # the caches: the appended (rotated) rows alike to bf16 rounding, the rest untouched
        assert (gpu[i].float() - cpu[i].float()).abs().max() <= 2.0**-7 * cpu[i].float().abs().max()
    for i in (0, 4):
        diff = (gpu[i].double() - cpu[i].double()).norm() / cpu[i].double().norm()
        assert diff <= 2 * REL_TOL[torch.bfloat16]
    torch.testing.assert_close(gpu[1], cpu[1], rtol=1e-4, atol=LSE_TOL)


def test_opcheck():
    g, q, k, v, k_new, v_new, lengths = make_case(2, 8, 2, 1, 128, 64, torch.bfloat16, 1, seed=67)
    args = (q.to(CUDA), k.to(CUDA), v.to(CUDA), lengths.to(CUDA), k_new.to(CUDA), v_new.to(CUDA))
    torch.library.opcheck(torch.ops.cs149gpt.attention_with_kvcache.default, args)


def test_refusals_alike_in_eager_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = gen(71)
    q = randn((1, 4, 1, 96), g, torch.bfloat16).to(CUDA)
    k = randn((1, 2, 32, 96), g, torch.bfloat16).to(CUDA)
    lengths = torch.tensor([3], dtype=torch.int32, device=CUDA)
    fn = lambda q, k, v, s: cs149gpt.attention_with_kvcache(q, k, v, s)
    with pytest.raises(ValueError, match="head dim d = 64 or 128"):
        fn(q, k, k.clone(), lengths)
    real = (q, k, k.clone(), lengths)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        with pytest.raises(ValueError, match="head dim d = 64 or 128"):
            fn(*fake)
    with pytest.raises(ValueError, match="one device"):
        fn(q[..., :64].contiguous(), k[..., :64].contiguous(), k[..., :64].contiguous(), lengths.cpu())


def test_unaligned_cache_refused():
    g = gen(73)
    q = randn((1, 4, 1, 64), g, torch.bfloat16).to(CUDA)
    big = randn((1, 2, 32, 68), g, torch.bfloat16).to(CUDA)
    k = big[..., 2:66]  # rows 136 bytes apart, starting 4 bytes in
    with pytest.raises(ValueError, match="16-byte loads"):
        cs149gpt.attention_with_kvcache(q, k, k.clone(), torch.tensor([3], dtype=torch.int32, device=CUDA))


@pytest.mark.parametrize("window", [(-1, 2**63 - 1), (2**63 - 1, 2**63 - 1), (2**62, 0)])
def test_a_window_wider_than_every_sequence_is_no_window(window):
    check_window_wider_than_every_sequence(window, CUDA, torch.bfloat16)
