"""cs149gpt.attention_with_kvcache against a float64 reference written from its definition.

Covered: contiguous and paged caches (block sizes 1..128, blocks in shuffled order, spare blocks), MHA/GQA/MQA,
Nq 1..16 and a longer chunk, per-sequence lengths from 0 to the capacity, k_new/v_new appended in place (and
nothing else in the caches touched), causal (bottom-right) and not, float32/bfloat16/float16, every ISA, bitwise
equality for 1, 2 and 3 threads, keys past a sequence's length never read (NaN there changes nothing),
torch.library.opcheck, fake tensors, and every argument error (block ids, lengths past capacity, dtypes, shapes,
devices) as a clear exception before anything is read or written.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cs149gpt
from tests._helpers import check_window_wider_than_every_sequence, gen, isa  # noqa: F401  (isa: fixture)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float32: max abs error on randn inputs; bf16/fp16: norm-relative error against float64 on the same (upcast)
# inputs: the kernel computes in float32 and rounds the output once (unit roundoff u = 2^-8, 2^-11).
F32_TOL = 1e-4
REL_TOL = {torch.bfloat16: 2.0**-8 + 1e-5, torch.float16: 2.0**-11 + 1e-5}


def reference(q, k_cache, v_cache, lengths, is_causal=True, scale=None):
    """(B, Hq, Nq, d) float64: sequence b's Nq queries against keys [0, lengths[b]) of its (logical) cache rows,
    k_cache and v_cache here (B, Hkv, >= max length, d), GQA by repeat_interleave, bottom-right causal."""
    B, hq, nq, d = q.shape
    group = hq // k_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(B, hq, nq, d, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        k = k_cache[b, :, :n].double().repeat_interleave(group, 0)  # (Hq, n, d)
        v = v_cache[b, :, :n].double().repeat_interleave(group, 0)
        s = q[b].double() @ k.transpose(-1, -2) * scale  # (Hq, Nq, n)
        if is_causal:
            visible = torch.arange(n)[None, :] <= torch.arange(nq)[:, None] + n - nq
            s = s.masked_fill(~visible, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: 0
        out[b] = p @ v
    return out


def error_of(out, ref, dtype):
    """None when out is close enough to ref, else what is wrong."""
    if out.dtype != dtype or out.shape != ref.shape or not out.is_contiguous():
        return f"out is {out.dtype} {tuple(out.shape)} contiguous={out.is_contiguous()}"
    diff = (out.double() - ref)
    if dtype == torch.float32:
        err = diff.abs().max().item() if diff.numel() else 0.0
        return None if err <= F32_TOL else f"max abs error {err:.3g}"
    err = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    return None if err <= REL_TOL[dtype] else f"relative error {err:.3g}"


def block_table_for(batch, length, block_size, g, spare=3):
    """A block table (B, ceil(length / block_size)) int32 over B · that + `spare` physical blocks, shuffled."""
    per = -(-length // block_size)
    num_blocks = batch * per + spare
    return torch.randperm(num_blocks, generator=g)[:batch * per].view(batch, per).to(torch.int32), num_blocks


def to_paged(k, table, num_blocks, block_size):
    """A logical cache (B, Hkv, N, d) as physical blocks (num_blocks, Hkv, block_size, d) placed by the table;
    blocks (and rows) that no sequence uses hold NaN."""
    B, hkv, n, d = k.shape
    blocks = torch.full((num_blocks, hkv, block_size, d), float("nan"), dtype=k.dtype)
    for b in range(B):
        for i in range(table.shape[1]):
            rows = k[b, :, i * block_size:(i + 1) * block_size]
            blocks[table[b, i], :, :rows.shape[1]] = rows
    return blocks


def from_paged(blocks, table, n):
    """The logical cache (B, Hkv, n, d) of physical blocks and a block table."""
    B, per = table.shape
    bs = blocks.shape[2]
    rows = [torch.cat([blocks[table[b, i]] for i in range(per)], dim=1)[:, :n] for b in range(B)]
    return torch.stack(rows)


def randn(shape, g, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------------------
# (B, Hq, Hkv, Nq, capacity, d): MHA, GQA, MQA; Nq 1..16 and a longer chunk; head dims off the vector width.
SHAPES = [(2, 4, 4, 1, 300, 64), (3, 8, 2, 3, 530, 32), (2, 6, 1, 16, 300, 40), (1, 32, 8, 1, 700, 128),
          (2, 4, 2, 37, 290, 17)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_cache(isa, dtype):
    """Lengths 0..capacity (one sequence at each end), with and without appending, causal and not."""
    g = gen(1000)
    failures = []
    for B, hq, hkv, nq, cap, d in SHAPES:
        q = randn((B, hq, nq, d), g, dtype)
        k0, v0 = randn((B, hkv, cap, d), g, dtype), randn((B, hkv, cap, d), g, dtype)
        k_new, v_new = randn((B, hkv, nq, d), g, dtype), randn((B, hkv, nq, d), g, dtype)
        for append in (False, True):
            room = cap - (nq if append else 0)
            seqlens = torch.randint(0, room + 1, (B,), generator=g)
            seqlens[0] = room  # full to the last row
            if B > 1:
                seqlens[1] = 0  # empty (with append: only the new keys)
            for is_causal in (True, False):
                k, v = k0.clone(), v0.clone()
                kw = dict(k_new=k_new, v_new=v_new) if append else {}
                out = cs149gpt.attention_with_kvcache(q, k, v, seqlens.to(torch.int32), is_causal=is_causal, **kw)
                k_exp, v_exp = k0.clone(), v0.clone()
                if append:
                    for b in range(B):
                        k_exp[b, :, seqlens[b]:seqlens[b] + nq] = k_new[b]
                        v_exp[b, :, seqlens[b]:seqlens[b] + nq] = v_new[b]
                label = f"{(B, hq, hkv, nq, cap, d)} append={append} causal={is_causal}"
                if not (torch.equal(k, k_exp) and torch.equal(v, v_exp)):
                    failures.append(f"{label}: the caches are not the old ones with k_new/v_new at cache_seqlens")
                lengths = seqlens + (nq if append else 0)
                problem = error_of(out, reference(q, k_exp, v_exp, lengths, is_causal), dtype)
                if problem:
                    failures.append(f"{label}: {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("block_size", [1, 5, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_cache(isa, dtype, block_size):
    """The same through a block table (shuffled blocks, unused NaN blocks): the same answer as the reference on
    the logical cache, and the appended rows land in the right block and row, under every ISA."""
    g = gen(1100 + block_size)
    failures = []
    for B, hq, hkv, nq, cap, d in SHAPES[:4]:
        q = randn((B, hq, nq, d), g, dtype)
        logical_k, logical_v = randn((B, hkv, cap, d), g, dtype), randn((B, hkv, cap, d), g, dtype)
        k_new, v_new = randn((B, hkv, nq, d), g, dtype), randn((B, hkv, nq, d), g, dtype)
        seqlens = torch.randint(0, cap - nq + 1, (B,), generator=g)
        seqlens[0] = cap - nq
        table, num_blocks = block_table_for(B, cap, block_size, g)
        blocks_k = to_paged(logical_k, table, num_blocks, block_size)
        blocks_v = to_paged(logical_v, table, num_blocks, block_size)
        out = cs149gpt.attention_with_kvcache(q, blocks_k, blocks_v, seqlens, k_new=k_new, v_new=v_new,
                                              block_table=table)
        k_exp, v_exp = logical_k.clone(), logical_v.clone()
        for b in range(B):
            k_exp[b, :, seqlens[b]:seqlens[b] + nq] = k_new[b]
            v_exp[b, :, seqlens[b]:seqlens[b] + nq] = v_new[b]
        label = f"{(B, hq, hkv, nq, cap, d)} block_size={block_size}"
        if not (torch.equal(from_paged(blocks_k, table, cap), k_exp)
                and torch.equal(from_paged(blocks_v, table, cap), v_exp)):
            failures.append(f"{label}: the appended rows are not where the block table puts them")
        problem = error_of(out, reference(q, k_exp, v_exp, seqlens + nq), dtype)
        if problem:
            failures.append(f"{label}: {problem}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_query_rows_in_every_group_size(isa, dtype):
    """The key micro-kernel takes a task's query rows 4, 2 and 1 at a time (the keys W/4, W/2 and W at a time),
    and its last keys one by one: row counts 1, 6, 7 and 15 (GQA group × chunk rows: 4 + 2, 4 + 2 + 1, ...), key
    counts that are no multiple of 16, head dims of a partial chunk, whole chunks and one and a half (bf16's
    chunk is 32 columns, float32's 16)."""
    g = gen(1150)
    failures = []
    for hq, hkv, nq, n, d in [(7, 7, 1, 77, 48), (3, 1, 2, 131, 32), (5, 1, 3, 45, 17), (6, 2, 5, 200, 64),
                              (4, 4, 7, 99, 8)]:
        q = randn((2, hq, nq, d), g, dtype)
        k, v = randn((2, hkv, n, d), g, dtype), randn((2, hkv, n, d), g, dtype)
        seqlens = torch.tensor([n, n - 13], dtype=torch.int32)
        for is_causal in (True, False):
            out = cs149gpt.attention_with_kvcache(q, k, v, seqlens, is_causal=is_causal)
            problem = error_of(out, reference(q, k, v, seqlens, is_causal), dtype)
            if problem:
                failures.append(f"{(hq, hkv, nq, n, d)} causal={is_causal}: {problem}")
    assert not failures, "\n".join(failures)


def test_paged_equals_contiguous_for_one_block():
    """A paged cache whose block holds a whole sequence computes exactly what the contiguous cache does."""
    g = gen(1200)
    q = randn((2, 8, 2, 64), g, torch.float32)
    k, v = randn((2, 2, 512, 64), g, torch.float32), randn((2, 2, 512, 64), g, torch.float32)
    seqlens = torch.tensor([512, 300], dtype=torch.int64)
    contiguous = cs149gpt.attention_with_kvcache(q, k, v, seqlens)
    paged = cs149gpt.attention_with_kvcache(q, k, v, seqlens, block_table=torch.tensor([[0], [1]], dtype=torch.int32))
    assert torch.equal(contiguous, paged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keys_past_the_length_are_never_read(isa, dtype):
    """NaN in every cache row past a sequence's length (and past the causal diagonal's rows are real keys): the
    output is finite and equals the reference on the valid rows, under every ISA, float32 and bf16."""
    g = gen(1300)
    q = randn((2, 4, 3, 32), g, dtype)
    k, v = randn((2, 2, 100, 32), g, dtype), randn((2, 2, 100, 32), g, dtype)
    seqlens = torch.tensor([40, 97], dtype=torch.int32)
    for b, n in enumerate(seqlens.tolist()):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("inf")
    out = cs149gpt.attention_with_kvcache(q, k, v, seqlens)
    assert torch.isfinite(out).all()
    assert error_of(out, reference(q, k, v, seqlens), dtype) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_in_a_visible_key_makes_the_row_nan(isa, dtype):
    """The README's rule: a NaN among the visible logits turns the row NaN; rows that cannot see that key (the
    causal diagonal of a chunk) are untouched."""
    g = gen(1310)
    q = randn((1, 2, 4, 32), g, dtype)
    k, v = randn((1, 1, 50, 32), g, dtype), randn((1, 1, 50, 32), g, dtype)
    k[0, 0, 49] = float("nan")  # the last key: only the last query row (of 4) sees it
    out = cs149gpt.attention_with_kvcache(q, k, v, torch.tensor([50]))
    assert torch.isnan(out[:, :, 3]).all()
    assert torch.isfinite(out[:, :, :3]).all()
    ref = reference(q, k, v, [50])
    assert error_of(out[:, :, :3].contiguous(), ref[:, :, :3], dtype) is None


def test_scale_and_strided_inputs():
    """scale is applied; q, k_new and the caches may be strided views (rows contiguous)."""
    g = gen(1400)
    q = randn((2, 1, 8, 48), g, torch.float32).transpose(1, 2)  # (2, 8, 1, 48), strided
    big_k, big_v = randn((2, 4, 200, 48), g, torch.float32), randn((2, 4, 200, 48), g, torch.float32)
    k, v = big_k[:, ::2], big_v[:, 1::2]  # every other kv head: strided caches
    k_new = randn((2, 1, 2, 48), g, torch.float32).transpose(1, 2)[:, :, :1]  # (2, 2, 1, 48), strided
    v_new = randn((2, 2, 1, 48), g, torch.float32)
    seqlens = torch.tensor([10, 150])
    out = cs149gpt.attention_with_kvcache(q, k, v, seqlens, k_new=k_new, v_new=v_new, scale=0.3)
    assert torch.equal(big_k[:, ::2][0, :, 10], k_new[0, :, 0]) and torch.equal(big_v[:, 1::2][1, :, 150], v_new[1, :, 0])
    assert error_of(out, reference(q, k, v, seqlens + 1, scale=0.3), torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_thread_count_does_not_change_bits(dtype, restore_threads):
    """1, 2 and 3 threads give torch.equal results, for shapes large enough to take the parallel path (several
    key splits per sequence), contiguous and paged, and through cs149gpt.attention's decode path too."""
    g = gen(1500)
    q = randn((2, 8, 2, 64), g, dtype)
    k, v = randn((2, 2, 3000, 64), g, dtype), randn((2, 2, 3000, 64), g, dtype)
    seqlens = torch.tensor([3000, 1777], dtype=torch.int32)
    table, num_blocks = block_table_for(2, 3000, 64, gen(1))
    paged_k, paged_v = to_paged(k, table, num_blocks, 64), to_paged(v, table, num_blocks, 64)
    runs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        runs.append((cs149gpt.attention_with_kvcache(q, k, v, seqlens),
                     cs149gpt.attention_with_kvcache(q, paged_k, paged_v, seqlens, block_table=table),
                     *cs149gpt.attention(q, k, v, is_causal="bottom_right", return_lse=True)))
    for threads, run in zip((2, 3), runs[1:]):
        for name, a, b in zip(("contiguous", "paged", "attention out", "attention lse"), run, runs[0]):
            assert torch.equal(a, b), f"{name}: {threads} threads differ from 1"
    assert error_of(runs[0][0], reference(q, k, v, seqlens), dtype) is None


@pytest.mark.parametrize("n", [200, 1500])
def test_thread_count_does_not_change_bits_at_any_size(n, restore_threads):
    """On both sides of the kernel's serial threshold (256 KB of K and V or 2^19 multiply-adds: 200 keys are 200 KB
    and 409,600, run on the calling thread; 1500 keys take the parallel path): 1, 2 and 4 threads compute the same
    bits, batch 1, Llama's GQA group of 4, d = 128."""
    g = gen(1550)
    q = randn((1, 8, 1, 128), g, torch.bfloat16)
    k, v = randn((1, 2, n, 128), g, torch.bfloat16), randn((1, 2, n, 128), g, torch.bfloat16)
    seqlens = torch.tensor([n], dtype=torch.int32)
    runs = []
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        runs.append(cs149gpt.attention_with_kvcache(q, k, v, seqlens))
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    assert error_of(runs[0], reference(q, k, v, seqlens), torch.bfloat16) is None


def test_decode_path_of_attention_matches_the_reference(isa):
    """cs149gpt.attention with 1..16 query rows (the decode kernel) and lse, GQA, both causal alignments."""
    g = gen(1600)
    failures = []
    for nq in (1, 2, 7, 16):
        for dtype in DTYPES:
            q = randn((2, 12, nq, 64), g, dtype)
            k, v = randn((2, 3, 333, 64), g, dtype), randn((2, 3, 333, 64), g, dtype)
            out, lse = cs149gpt.attention(q, k, v, is_causal="bottom_right", return_lse=True)
            ref = reference(q, k, v, [333, 333])
            problem = error_of(out, ref, dtype)
            kk = k.double().repeat_interleave(4, 1)
            s = q.double() @ kk.transpose(-1, -2) / 8.0
            visible = torch.arange(333)[None, :] <= torch.arange(nq)[:, None] + 333 - nq
            ref_lse = s.masked_fill(~visible, -math.inf).logsumexp(-1)
            if problem or (lse.double() - ref_lse).abs().max() > 1e-4:
                failures.append(f"nq={nq} {dtype}: {problem or 'lse'}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# The operator: opcheck, fake tensors, autograd's version counter
# ---------------------------------------------------------------------------------------------------------
def small_case(paged=False, append=True, dtype=torch.float32):
    g = gen(1700)
    q = randn((2, 4, 2, 8), g, dtype)
    if paged:
        k, v = randn((6, 2, 4, 8), g, dtype), randn((6, 2, 4, 8), g, dtype)
        table = torch.tensor([[5, 0, 2], [1, 3, 4]], dtype=torch.int32)
    else:
        k, v = randn((2, 2, 12, 8), g, dtype), randn((2, 2, 12, 8), g, dtype)
        table = None
    seqlens = torch.tensor([3, 10], dtype=torch.int32)
    k_new = randn((2, 2, 2, 8), g, dtype) if append else None
    v_new = randn((2, 2, 2, 8), g, dtype) if append else None
    return q, k, v, seqlens, k_new, v_new, table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_opcheck(paged, append):
    q, k, v, seqlens, k_new, v_new, table = small_case(paged, append)
    torch.library.opcheck(torch.ops.cs149gpt.attention_with_kvcache.default,
                          (q, k, v, seqlens, k_new, v_new, table, None, True))


def test_fake_tensors_give_the_shape_and_the_errors():
    q, k, v, seqlens, k_new, v_new, table = small_case(paged=True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fs, fkn, fvn, ft = (mode.from_tensor(t) for t in (q, k, v, seqlens, k_new, v_new, table))
        out = cs149gpt.attention_with_kvcache(fq, fk, fv, fs, k_new=fkn, v_new=fvn, block_table=ft)
        assert out.shape == q.shape and out.dtype == q.dtype
        with pytest.raises(ValueError, match="k_new must have shape"):
            cs149gpt.attention_with_kvcache(fq, fk, fv, fs, k_new=fkn[:, :1], v_new=fvn, block_table=ft)


def test_compiled_decode_step_matches_eager():
    """torch.compile(fullgraph=True) of a decode step that appends and attends: same output, same caches."""
    q, k, v, seqlens, k_new, v_new, _ = small_case()

    def step(q, k, v, seqlens, k_new, v_new):
        return cs149gpt.attention_with_kvcache(q, k, v, seqlens, k_new=k_new, v_new=v_new) * 2

    k2, v2 = k.clone(), v.clone()
    eager = step(q, k, v, seqlens, k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k2, v2, seqlens, k_new, v_new)
    assert torch.equal(eager, compiled) and torch.equal(k, k2) and torch.equal(v, v2)


def test_writing_the_cache_bumps_its_version():
    q, k, v, seqlens, k_new, v_new, _ = small_case()
    before = k._version, v._version
    cs149gpt.attention_with_kvcache(q, k, v, seqlens, k_new=k_new, v_new=v_new)
    assert k._version > before[0] and v._version > before[1]


# ---------------------------------------------------------------------------------------------------------
# Bad input: a clear exception, and the caches untouched
# ---------------------------------------------------------------------------------------------------------
def bad_cases():
    q, k, v, seqlens, k_new, v_new, _ = small_case()
    _, pk, pv, _, _, _, table = small_case(paged=True)
    i32 = torch.int32
    return [
        ("block id past the blocks", (q, pk, pv, seqlens, k_new, v_new, torch.tensor([[5, 0, 9], [1, 3, 6]], dtype=i32)),
         IndexError, r"block_table\[1, 2\] = 6 is not a block"),  # [0, 2] = 9 is past sequence 0's 5 keys: unused
        ("negative block id", (q, pk, pv, seqlens, k_new, v_new, torch.tensor([[5, 0, 2], [-1, 3, 4]], dtype=i32)),
         IndexError, r"block_table\[1, 0\] = -1"),
        ("length past capacity", (q, k, v, torch.tensor([3, 11], dtype=i32), k_new, v_new, None),
         ValueError, r"cache_seqlens\[1\] = 11 plus the 2 new keys of k_new exceed the cache's capacity of 12"),
        ("paged length past capacity", (q, pk, pv, torch.tensor([11, 3], dtype=i32), k_new, v_new, table),
         ValueError, r"^block_table: row 0 maps 3 blocks of 4 keys, 12 keys in all, too few for cache_seqlens\[0\] = 11 plus"),
        ("negative length", (q, k, v, torch.tensor([-1, 3], dtype=i32), None, None, None),
         ValueError, r"cache_seqlens\[0\] must be >= 0"),
        ("huge length", (q, k, v, torch.tensor([2**62, 3]), k_new, v_new, None), ValueError, "capacity"),
        ("cache dtype", (q, k.double(), v, seqlens, None, None, None), TypeError, "k_cache must have q's dtype"),
        ("k_new dtype", (q, k, v, seqlens, k_new.half(), v_new, None), TypeError, "k_new must have q's dtype"),
        ("q dtype", (q.double(), k.double(), v.double(), seqlens, None, None, None), TypeError,
         "q must be float32, bfloat16 or float16"),
        ("seqlens dtype", (q, k, v, seqlens.float(), None, None, None), TypeError, "cache_seqlens must be int32"),
        ("table dtype", (q, pk, pv, seqlens, None, None, table.long()), TypeError, "block_table must be int32"),
        ("seqlens shape", (q, k, v, seqlens[:1], None, None, None), ValueError, r"cache_seqlens must have shape \(B,\)"),
        ("cache batch", (q, k[:1], v[:1], seqlens, None, None, None), ValueError, "k_cache must have shape"),
        ("v_cache shape", (q, k, v[:, :, :5], seqlens, None, None, None), ValueError, "v_cache must have k_cache's shape"),
        ("head dim", (q[..., :4], k, v, seqlens, None, None, None), ValueError, "head dim d = 4"),
        ("GQA", (q[:, :3], k, v, seqlens, None, None, None), ValueError, "multiple of the kv heads"),
        ("no kv heads", (q, k[:, :0], v[:, :0], seqlens, None, None, None), ValueError,
         r"k_cache must have at least one kv head \(dim 1\), got k_cache of shape \[2, 0, 12, 8\]"),
        ("k_new shape", (q, k, v, seqlens, k_new[..., :1], v_new, None), ValueError, "k_new must have shape"),
        ("v_new length", (q, k, v, seqlens, k_new, v_new[:, :, :1], None), ValueError, "v_new must have shape"),
        ("k_new alone", (q, k, v, seqlens, k_new, None, None), ValueError, "k_new and v_new must be given together"),
        ("q rank", (q[0], k, v, seqlens, None, None, None), ValueError, r"q must have shape \(B, Hq, Nq, d\)"),
        ("table rank", (q, pk, pv, seqlens, None, None, table[0]), ValueError, "block_table must have shape"),
        ("last dim strided", (q, torch.empty(2, 2, 12, 16)[..., ::2], v, seqlens, None, None, None), ValueError,
         "k_cache must have a contiguous last dim"),
        ("meta cache", (q, k.to("meta"), v, seqlens, None, None, None), ValueError, "must be on one device"),
        ("scale", (q, k, v, seqlens, None, None, None, float("inf")), ValueError, "scale must be a finite float32"),
        # Appending into memory that two cache elements share would write one head's new row over another's.
        ("expanded cache appended to", (q, k[:, :1].expand(k.shape), v, seqlens, k_new, v_new, None), ValueError,
         "k_cache has elements that share memory"),
        ("one cache for k and v appended to", (q, k, k, seqlens, k_new, v_new, None), ValueError,
         "k_cache and v_cache share memory"),
        # A row a sequence appends (cache_seqlens 3 and 10, 2 new keys each, blocks of 4) that another entry of the
        # block tables sees would hand that sequence a key not its own.
        ("append where another sequence reads", (q, pk, pv, seqlens, k_new, v_new,
                                                 torch.tensor([[5, 0, 2], [1, 3, 0]], dtype=i32)), ValueError,
         r"block_table: sequence 0 writes k_new and v_new into rows 0\.\.0 of block 0, which block_table\[1, 2\] "
         r"names too, its rows 0\.\.3 read by sequence 1"),
        ("append into a shared prefix block", (q, pk, pv, seqlens, k_new, v_new,
                                               torch.tensor([[5, 0, 2], [5, 3, 4]], dtype=i32)), ValueError,
         r"sequence 0 writes k_new and v_new into rows 3\.\.3 of block 5, which block_table\[1, 0\] names too"),
        ("another sequence reads the new rows", (q, pk, pv, torch.tensor([4, 10], dtype=i32), k_new, v_new,
                                                 torch.tensor([[5, 4, 2], [1, 3, 4]], dtype=i32)), ValueError,
         r"sequence 0 writes k_new and v_new into rows 0\.\.1 of block 4, which block_table\[1, 2\] names too, "
         r"its rows 0\.\.3 read by sequence 1"),
        ("two sequences append into one row", (q, pk, pv, torch.tensor([4, 8], dtype=i32), k_new, v_new,
                                               torch.tensor([[5, 4, 2], [1, 3, 4]], dtype=i32)), ValueError,
         r"sequence 0 writes k_new and v_new into rows 0\.\.1 of block 4, which block_table\[1, 2\] names too, "
         r"its rows 0\.\.1 read by sequence 1"),
        ("one table naming a block twice", (q[:1], pk, pv, seqlens[:1], k_new[:1], v_new[:1],
                                            torch.tensor([[5, 5, 2]], dtype=i32)), ValueError,
         r"sequence 0 writes k_new and v_new into rows 0\.\.0 of block 5, which block_table\[0, 0\] names too, "
         r"its rows 0\.\.3 read by sequence 0"),
    ]


@pytest.mark.parametrize("case", bad_cases(), ids=lambda c: c[0])
def test_bad_input_is_a_clear_error(case):
    _, args, error, match = case
    q, k, v, seqlens, k_new, v_new, table, *scale = args
    before = [t.clone() for t in (k, v) if t.device.type == "cpu"]
    with pytest.raises(error, match=match):
        cs149gpt.attention_with_kvcache(q, k, v, seqlens, k_new=k_new, v_new=v_new, block_table=table,
                                        scale=scale[0] if scale else None)
    after = [t for t in (k, v) if t.device.type == "cpu"]
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(after, before)), "a refused call wrote"


def test_shared_blocks_that_appends_do_not_touch():
    """Block tables may share blocks as long as no row one sequence appends is seen by another: sequences 0 and 1
    share their first block (a common prefix, read only); sequence 0 names block 7 past its length (never read),
    into which sequence 2 appends."""
    g = gen(1701)
    bs, d = 4, 8
    q = randn((3, 4, 2, d), g, torch.float32)
    blocks_k, blocks_v = randn((8, 2, bs, d), g, torch.float32), randn((8, 2, bs, d), g, torch.float32)
    k_new, v_new = randn((3, 2, 2, d), g, torch.float32), randn((3, 2, 2, d), g, torch.float32)
    table = torch.tensor([[5, 0, 7], [5, 3, 4], [6, 7, 1]], dtype=torch.int32)
    seqlens = torch.tensor([4, 8, 5], dtype=torch.int32)  # new rows: block 0's 0-1, block 4's 0-1, block 7's 1-2
    k_exp, v_exp = from_paged(blocks_k, table, 3 * bs), from_paged(blocks_v, table, 3 * bs)
    out = cs149gpt.attention_with_kvcache(q, blocks_k, blocks_v, seqlens, k_new=k_new, v_new=v_new, block_table=table)
    for b in range(3):
        k_exp[b, :, seqlens[b]:seqlens[b] + 2] = k_new[b]
        v_exp[b, :, seqlens[b]:seqlens[b] + 2] = v_new[b]
    problem = error_of(out, reference(q, k_exp, v_exp, seqlens + 2), torch.float32)
    assert not problem, problem
    # every sequence's rows, the new ones where its table puts them, the shared block untouched (rows past a
    # sequence's length may be another's: sequence 0's block 7)
    after_k, after_v = from_paged(blocks_k, table, 3 * bs), from_paged(blocks_v, table, 3 * bs)
    for b in range(3):
        n = seqlens[b] + 2
        assert torch.equal(after_k[b, :, :n], k_exp[b, :, :n]) and torch.equal(after_v[b, :, :n], v_exp[b, :, :n])


def test_inputs_that_require_grad_are_refused():
    """attention_with_kvcache has no backward: a q (or k_new, v_new, cache) that requires grad would get a None
    gradient, so it is refused, naming it; under torch.no_grad(), or detached, it runs."""
    q, k, v, seqlens, k_new, v_new, _ = small_case()
    for name in ("q", "k_new", "v_new"):
        args = {"q": q, "k_new": k_new, "v_new": v_new}
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(ValueError, match=f"{name} requires grad, but attention_with_kvcache has no backward"):
            cs149gpt.attention_with_kvcache(args["q"], k.clone(), v.clone(), seqlens, k_new=args["k_new"],
                                            v_new=args["v_new"])
        with torch.no_grad():
            out = cs149gpt.attention_with_kvcache(args["q"], k.clone(), v.clone(), seqlens, k_new=args["k_new"],
                                                  v_new=args["v_new"])
        assert torch.equal(out, cs149gpt.attention_with_kvcache(q, k.clone(), v.clone(), seqlens, k_new=k_new,
                                                                v_new=v_new))


def test_arguments_of_the_wrong_type_are_named():
    """A list for cache_seqlens, a float scale given as a string: a TypeError naming the argument, not the
    operator's schema dump."""
    q, k, v, seqlens, k_new, v_new, table = small_case(paged=True)
    cases = [("cache_seqlens", dict(cache_seqlens=[3, 10]), "cache_seqlens must be a torch.Tensor, got list"),
             ("k_cache", dict(k_cache=k.numpy()), "k_cache must be a torch.Tensor, got ndarray"),
             ("block_table", dict(block_table=[[5, 0, 2], [1, 3, 4]]), "block_table must be a torch.Tensor or None"),
             ("k_new", dict(k_new=1.0), "k_new must be a torch.Tensor or None, got float"),
             ("scale", dict(scale="0.5"), "scale must be a float or None, got str")]
    for _, change, message in cases:
        args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, block_table=table)
        args.update(change)
        with pytest.raises(TypeError, match=message):
            cs149gpt.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                            args.pop("cache_seqlens"), **args)


def test_lengths_past_the_block_table_name_it():
    """A paged cache whose block table has too few blocks for a sequence's length: the message names
    block_table (the table points past the cache it maps), not only cache_seqlens."""
    q, k, v, _, _, _, table = small_case(paged=True, append=False)
    with pytest.raises(ValueError, match=r"^block_table: row 1 maps 3 blocks of 4 keys, 12 keys in all, too few for "
                                         r"cache_seqlens\[1\] = 13$"):
        cs149gpt.attention_with_kvcache(q, k, v, torch.tensor([3, 13], dtype=torch.int32), block_table=table)


@pytest.mark.parametrize("window", [(-1, 2**63 - 1), (2**63 - 1, 2**63 - 1), (2**62, 0)])
def test_a_window_wider_than_every_sequence_is_no_window(window):
    check_window_wider_than_every_sequence(window, "cpu", torch.float32)
