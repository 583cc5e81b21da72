"""Non-finite values: one rule in every impl, path, ISA, dtype and tile size (README, "Non-finite values").

With s_j = scale · q·k_j the logits of a query row's *visible* keys (the causal mask hides the others):
  - a NaN or +inf among them makes the whole output row NaN, and its lse NaN (as torch: exp(inf − inf));
  - −inf is a weight of 0; a row whose logits are all −inf, or that sees no key, gets 0 and lse −inf;
  - a NaN/±Inf in a visible key's value row reaches the output through Σ p_j v_j (even at p_j = 0: 0 · NaN);
  - a key hidden by the mask never touches the row: neither its k nor its v is read for it.
The reference below applies that rule in float64, written from the definition; hypothesis plants NaN and
±Inf at random places of q, k and v over random shapes, tiles, layouts, causal modes, dtypes and ISAs, and
checks the NaN pattern, the ±Inf pattern and the finite values. The backward must give NaN gradients for
every row whose output is NaN, and agree with float64 autograd wherever that is finite.
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cs149gpt
from tests._helpers import ALL_ISAS, module, visible_mask

# CI runs the same examples every time (derandomize); elsewhere each run draws new ones.
EXAMPLES = settings(max_examples=int(os.environ.get("CS149GPT_HYPOTHESIS_EXAMPLES", 150)), deadline=None,
                    derandomize=bool(os.environ.get("CI")), suppress_health_check=[HealthCheck.too_slow])
NONFINITE = (float("nan"), float("inf"), float("-inf"))
# Max abs error on finite outputs of unit-scale inputs: float32 arithmetic, or one rounding to bf16/fp16.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def reference(q, k, v, scale, is_causal):
    """(out, lse) in float64 under the rule above. q (B, Hq, Nq, d); k, v (B, Hkv, Nk, d)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    n_q, n_k = q.shape[-2], k.shape[-2]
    visible = visible_mask(n_q, n_k, is_causal)
    if visible is None:
        visible = torch.ones(n_q, n_k, dtype=torch.bool)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, -math.inf)  # a hidden key's NaN is dropped here
    m = s.amax(-1, keepdim=True)  # NaN if any visible logit is NaN
    no_weight = m == -math.inf
    p = torch.exp(s - m.masked_fill(no_weight, 0.0))  # exp(inf − inf) = NaN; all −inf: 0
    l = p.sum(-1, keepdim=True)
    p = torch.where(l == 0, 0.0, p / l)
    v_seen = v[..., None, :, :].masked_fill(~visible[..., None], 0.0)  # (B, H, Nq, Nk, d): hidden values unread
    out = (p[..., None] * v_seen).sum(-2)
    lse = torch.where(l == 0, -math.inf, m + torch.log(l)).squeeze(-1)
    return out, lse


def same_class(got, want, tol):
    """Lines saying where got and want (float64) differ: NaN where NaN, ±inf where ±inf, else within tol."""
    got = got.double()
    found = []
    if not torch.equal(got.isnan(), want.isnan()):
        where = (got.isnan() != want.isnan()).nonzero()[:4].tolist()
        found.append(f"NaN pattern differs at {where} (got NaN: {got.isnan().sum()}, want {want.isnan().sum()})")
    inf = want.isinf() | got.isinf()
    if not torch.equal(got[inf], want[inf]):
        found.append(f"±inf pattern differs at {inf.nonzero()[:4].tolist()}")
    finite = want.isfinite() & got.isfinite()
    if finite.any():
        err = (got[finite] - want[finite]).abs().max().item()
        if not err <= tol:
            found.append(f"max abs error {err:.3g} > {tol:g} on finite values")
    return found


def plant(t, places):
    """t with the given (flat index, value) pairs written in."""
    t = t.clone()
    flat = t.view(-1)
    for index, value in places:
        flat[index % flat.numel()] = value
    return t


def as_layout(t, transposed):
    """t itself, or the same values as a (B, N, H, d) tensor's transpose view (the GPT's layout)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t


@st.composite
def cases(draw, impls=cs149gpt.IMPLS):
    impl = draw(st.sampled_from(impls))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16))) if impl == "flash" else torch.float32
    b, h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_q, n_k, d = draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.sampled_from((False, "top_left", "bottom_right")))
    tiles = draw(st.sampled_from(((None, None), (1, 3), (5, 7), (24, 16), (40, 40)))) if impl in ("flash", "blocked") \
        else (None, None)
    place = st.tuples(st.integers(0, 1 << 30), st.sampled_from(NONFINITE))
    planted = {name: draw(st.lists(place, max_size=2)) for name in "qkv"}
    return dict(impl=impl, dtype=dtype, shapes=((b, h_kv * group, n_q, d), (b, h_kv, n_k, d)), causal=causal,
                tiles=tiles, planted=planted, transposed=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                isa=draw(st.sampled_from([n for n in ALL_ISAS if module()._testing.cpu_supports(n)])))  # no example wasted


def inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    q_shape, kv_shape = case["shapes"]
    q, k, v = (torch.randn(s, generator=g).to(case["dtype"]) for s in (q_shape, kv_shape, kv_shape))
    q, k, v = (as_layout(plant(t, case["planted"][name]), case["transposed"]) for name, t in zip("qkv", (q, k, v)))
    return q, k, v


def use_isa(name):
    """Switches to the ISA if this CPU runs it; returns the one to restore, or None to skip."""
    m = module()
    if not m._testing.cpu_supports(name):
        return None
    original = m.isa()
    m._testing.set_isa(name)
    return original


@given(case=cases())
@EXAMPLES
def test_forward_follows_the_nonfinite_rule(case):
    original = use_isa(case["isa"])
    if original is None:
        return  # this CPU lacks the ISA; another example covers the others
    try:
        q, k, v = inputs(case)
        block_q, block_k = case["tiles"]
        scale = 1.0 / math.sqrt(q.shape[-1])
        kwargs = dict(impl=case["impl"], is_causal=case["causal"], block_q=block_q, block_k=block_k)
        if case["impl"] == "flash":
            out, lse = cs149gpt.attention(q, k, v, return_lse=True, **kwargs)
        else:
            out, lse = cs149gpt.attention(q, k, v, **kwargs), None
    finally:
        module()._testing.set_isa(original)
    want, want_lse = reference(q, k, v, scale, case["causal"])
    found = same_class(out, want, TOL[case["dtype"]])
    if lse is not None:
        found += [f"lse: {line}" for line in same_class(lse, want_lse, 1e-4)]
    assert not found, found


# ---------------------------------------------------------------------------------------------------------
# The classes the rule was written for, each checked explicitly on every impl and ISA.
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(params=ALL_ISAS)
def each_isa(request):
    original = use_isa(request.param)
    if original is None:
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    yield request.param
    module()._testing.set_isa(original)


def run_all(q, k, v, is_causal=False):
    """{(impl, dtype, path): out} over every impl, flash's dtypes, and flash's decode path where it applies."""
    results = {}
    for impl in cs149gpt.IMPLS:
        results[impl] = cs149gpt.attention(q, k, v, impl=impl, is_causal=is_causal)
    for dtype in (torch.bfloat16, torch.float16):
        results[f"flash-{dtype}"] = cs149gpt.attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=is_causal)
    results["flash-tiles-3x5"] = cs149gpt.attention(q, k, v, is_causal=is_causal, block_q=3, block_k=5)
    module().set_float32_products("bf16_tiles")  # float32 on the bf16 tiles in three parts (amx, amx_emulated)
    try:
        results["flash-float32-on-bf16-tiles"] = cs149gpt.attention(q, k, v, is_causal=is_causal)
    finally:
        module().set_float32_products("auto")
    return results


@pytest.mark.parametrize("value", NONFINITE[:2])
def test_nan_or_inf_in_a_query_row_makes_that_row_nan(each_isa, value):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 24, generator=g) for n in (40, 40, 40))
    q[0, 1, 17] = value  # the whole row: +inf·k has mixed signs → ±inf logits → NaN
    for n_q in (40, 3):  # 3 rows: the decode path
        for name, out in run_all(q[:, :, :n_q], k, v).items():
            nan_rows = out.isnan().any(-1)
            expected = torch.zeros_like(nan_rows)
            if n_q > 17:
                expected[0, 1, 17] = True
            assert torch.equal(nan_rows, expected), (name, n_q, nan_rows.nonzero().tolist())
            assert out[0, 1, 17].isnan().all() if n_q > 17 else True, name
    _, lse = cs149gpt.attention(q, k, v, return_lse=True)
    assert lse[0, 1, 17].isnan() and lse.isfinite().sum() == lse.numel() - 1


def test_nan_in_one_key_at_every_lane_position(each_isa):
    """A NaN in key j reaches exactly the rows that see key j, whatever lane of a vector j falls in."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 40, 16, generator=g) for _ in range(3))
    for j in range(40):
        k_nan = k.clone()
        k_nan[0, 0, j, 5] = float("nan")
        for causal in (False, True):
            expected = torch.ones(40, dtype=torch.bool) if not causal else torch.arange(40) >= j
            for name, out in run_all(q, k_nan, v, is_causal=causal).items():
                assert torch.equal(out[0, 0].isnan().all(-1), expected), (name, j, causal)
                assert not out[0, 0][~expected].isnan().any(), (name, j, causal)
            # decode: one query row, sees every key
            assert cs149gpt.attention(q[:, :, :1], k_nan, v).isnan().all(), j


def test_hidden_keys_never_touch_a_row(each_isa):
    """NaN in the k and v of keys the causal mask hides changes nothing (torch's math path would spread the
    NaN of v through 0 · NaN; we never read a hidden key for a row)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 50, 20, generator=g) for _ in range(3))
    clean = cs149gpt.attention(q, k, v, impl="naive", is_causal=True)
    for j in (1, 13, 23, 24, 25, 47, 49):
        k_nan, v_nan = k.clone(), v.clone()
        k_nan[:, :, j] = float("nan")
        v_nan[:, :, j, 3] = float("nan")
        for name, out in run_all(q, k_nan, v_nan, is_causal=True).items():
            tol = 1e-4 if "-" not in name or "tiles" in name else 2e-2
            assert torch.allclose(out[:, :, :j].float(), clean[:, :, :j], atol=tol), (name, j)
            assert out[:, :, j:].isnan().all(-1).all(), (name, j)


def test_all_logits_minus_inf_is_a_row_with_no_key(each_isa):
    """−inf logits weigh 0: a row whose logits are all −inf gives 0 and lse −inf, as one that sees no key."""
    q = torch.ones(1, 1, 30, 8)
    k = torch.randn(1, 1, 30, 8)
    k[..., 0] = -float("inf")  # q·k = −inf for every key
    v = torch.randn(1, 1, 30, 8)
    for name, out in run_all(q, k, v).items():
        assert torch.equal(out.float(), torch.zeros_like(out, dtype=torch.float32)), name
    _, lse = cs149gpt.attention(q, k, v, return_lse=True)
    assert (lse == -math.inf).all()
    # ... but a NaN value row of a visible key still shows, through 0 · NaN (as torch's math path)
    v[0, 0, 11, 2] = float("nan")
    for name, out in run_all(q, k, v).items():
        assert out[..., 2].isnan().all() and not out[..., [0, 1, 3]].isnan().any(), name


def test_huge_finite_logits_stay_finite(each_isa):
    """Finite logits, however large (scale up to 1e20, or inputs of 1e5 and 1e18), give finite rows: the softmax is
    then one-hot on the largest logit, out its value row, as the float64 reference says. (The bf16 path folded log2 e
    into one FMA with the scale, so the row max's own exponent kept the product's rounding residue, up to 2^-25 of
    it: 2^860 at logits of 1e10, inf / inf = NaN.)"""
    g = torch.Generator().manual_seed(1900)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (20, 30, 30))
    failures = []
    for scale, mult in ((1e9, 1.0), (1e20, 1.0), (None, 1e5), (None, 1e18)):
        for n_q in (20, 3):  # the tiled kernels and the decode kernel
            qm, km = (q[:, :, :n_q] * mult), k * mult
            for name, out in run_all(qm, km, v).items() if scale is None else \
                    {d: cs149gpt.attention(qm.to(d), km.to(d), v.to(d), scale=scale)
                     for d in (torch.float32, torch.bfloat16, torch.float16)}.items():
                dtype = out.dtype
                if not (torch.isfinite(qm.to(dtype)).all() and torch.isfinite(km.to(dtype)).all()):
                    continue  # float16 holds neither 1e5 nor 1e18: inf inputs, which the rule makes NaN
                qd, kd = qm.to(dtype).double(), km.to(dtype).double()
                s = (qd @ kd.transpose(-1, -2)) * (scale if scale is not None else 16 ** -0.5)
                want = torch.softmax(s, -1) @ v.to(dtype).double()
                err = (out.double() - want).abs().max().item()
                if not (torch.isfinite(out).all() and err <= 2e-2):
                    failures.append(f"{each_isa} {name} scale={scale} inputs x{mult} Nq={n_q}: "
                                    f"{int((~torch.isfinite(out)).any(-1).sum())} non-finite rows, max error {err:.3g}")
    assert not failures, "\n".join(failures)


def packing_split_cases():
    """(name, q, k, v, shown, bad, seen, block_k) for the test below: the index of a hidden NaN value and a hidden inf
    key, and of a NaN value every row of its heads sees. shown: True = the key takes part, rows that differ (no key
    range stops a block early, so a tile holding a NaN value takes P V row by row only if its flags say so)."""
    g = torch.Generator().manual_seed(5)
    j, i = torch.arange(300), torch.arange(300).view(-1, 1)
    # One head, one key tile of 300 keys (whole chunks and a cut one): keys 250.. hidden, but 280 shown to even rows.
    one = [torch.randn(1, 1, 300, 32, generator=g) for _ in range(3)]
    shown = ((j < 250) | ((j == 280) & (i % 2 == 0))).view(1, 1, 300, 300)
    yield "one head", *one, shown, ((0, 0, 260), (0, 0, 290)), (0, 0, 100), None
    # Two batches of 4 query heads on 2 kv heads, three key tiles of 128 keys: the NaN and inf in late chunks of the
    # middle tile of batch 1's second kv head, keys 190..249 hidden but 240 shown to even rows. A mask per batch
    # element takes the interleaved schedule; one shared by the batch (stride 0) every chunk first.
    q = torch.randn(2, 4, 300, 32, generator=g)
    k, v = (torch.randn(2, 2, 300, 32, generator=g) for _ in range(2))
    shown = (~((j >= 190) & (j < 250)) | ((j == 240) & (i % 2 == 0))).view(1, 1, 300, 300)
    bad, seen = ((1, 1, 200), (1, 1, 230)), (1, 1, 100)
    yield "GQA, a mask per batch element", q, k, v, shown.expand(2, 1, 300, 300).contiguous(), bad, seen, 128
    yield "GQA, a batch-shared mask", q, k, v, shown, bad, seen, 128


@pytest.mark.parametrize("case", list(packing_split_cases()), ids=lambda c: c[0] if isinstance(c, tuple) else "")
def test_packing_split_among_threads_keeps_each_chunks_flags(each_isa, restore_threads, case):
    """Few key tiles on many threads: each tile is packed in chunks by several threads (flash_common.h's
    split_packing), and each chunk keeps its own finite flag. A NaN value and an inf key in late chunks, hidden by the
    mask, never touch a row, however many threads split the packing; a NaN value that every row of its heads sees
    makes its column NaN in exactly those heads. The outputs are the same bits on 1, 3 and 16 threads."""
    name, q, k, v, shown, ((vb_at, kb_at)), seen_at, block_k = case
    k_bad, v_bad, v_seen = k.clone(), v.clone(), v.clone()
    v_bad[vb_at][3] = float("nan")
    k_bad[kb_at][7] = float("inf")
    v_seen[seen_at][5] = float("nan")
    group = q.shape[1] // k.shape[1]
    seen_heads = torch.zeros(q.shape[:2], dtype=torch.bool)
    seen_heads[seen_at[0], seen_at[1] * group:(seen_at[1] + 1) * group] = True
    failures = []
    for dtype, products in ((torch.float32, "auto"), (torch.float32, "bf16_tiles"), (torch.bfloat16, "auto"),
                            (torch.float16, "auto")):
        qd, kd, vd, kb, vb, vs = (t.to(dtype) for t in (q, k, v, k_bad, v_bad, v_seen))
        module().set_float32_products(products)
        try:
            by_threads = {}
            for threads in (1, 3, 16):
                torch.set_num_threads(threads)
                clean, hidden_bad, seen_bad = (cs149gpt.attention(qd, kk, vv, attn_mask=shown, block_k=block_k)
                                               for kk, vv in ((kd, vd), (kb, vb), (kd, vs)))
                by_threads[threads] = (clean, hidden_bad, seen_bad)
                label = f"{name}, {dtype} {products}, {threads} threads"
                # (Not the same bits: an inf in K_j's tile sends the parts kernels' S through float32 arithmetic.)
                if not (hidden_bad.isfinite().all() and torch.allclose(hidden_bad, clean, atol=TOL[dtype], rtol=0)):
                    failures.append(f"{label}: a hidden NaN/inf changed {int((hidden_bad != clean).any(-1).sum())} rows")
                nan_column = seen_bad[..., 5].isnan()
                if not (nan_column.all(-1) == seen_heads).all() or not (nan_column.any(-1) == seen_heads).all() \
                        or seen_bad[..., :5].isnan().any():
                    failures.append(f"{label}: a seen NaN value reached the wrong heads or columns")
            for threads in (3, 16):
                if not all(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
                           for a, b in zip(by_threads[1], by_threads[threads])):
                    failures.append(f"{name}, {dtype} {products}: {threads} threads differ from 1")
        finally:
            module().set_float32_products("auto")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1), attn_mask=shown)
    torch.set_num_threads(16)
    err = (cs149gpt.attention(q, k_bad, v_bad, attn_mask=shown, block_k=block_k).double() - want).abs().max()
    assert err < 1e-5, (name, err)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("value", NONFINITE)
def test_nonfinite_value_rows_propagate_as_in_torch(each_isa, value):
    """NaN/±inf in a visible value row: the output column becomes what Σ p_j v_j gives, as torch computes."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 33, 16, generator=g) for _ in range(3))
    v[0, 0, 7, 4] = value
    torch_out = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    for name, out in run_all(q, k, v).items():
        assert torch.equal(out.isnan(), torch_out.isnan()) and torch.equal(out.isinf(), torch_out.isinf()), name


# ---------------------------------------------------------------------------------------------------------
# Backward: NaN where the forward is NaN, and the float64 gradients wherever those are finite.
# ---------------------------------------------------------------------------------------------------------
@given(case=cases(impls=("flash",)))
@EXAMPLES
def test_backward_agrees_with_the_forward(case):
    if case["dtype"] != torch.float32:
        case = {**case, "dtype": torch.float32}  # the low-precision backward is checked in test_backward.py
    original = use_isa(case["isa"])
    if original is None:
        return
    q, k, v = (t.detach().requires_grad_() for t in inputs(case))
    block_q, block_k = case["tiles"]
    # Every backward algorithm (heuristics.h picks one by shape and CPU count), by the seed: one pass, one pass with
    # each kv head's keys split into 2 tasks, two passes.
    module()._testing.set_backward_path(("one_pass", "one_pass", "two_pass")[case["seed"] % 3])
    module()._testing.set_backward_key_chunks(2 if case["seed"] % 3 == 1 else 0)
    try:
        out = cs149gpt.attention(q, k, v, is_causal=case["causal"], block_q=block_q, block_k=block_k)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(case["seed"] + 1))
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        module()._testing.set_isa(original)
        module()._testing.set_backward_path("auto")
        module()._testing.set_backward_key_chunks(0)
    # 1. every NaN row of the forward has a NaN in its dq row
    nan_rows = out.isnan().any(-1)
    assert grads[0].isnan().any(-1)[nan_rows].all(), "a NaN output row with a finite dq row"
    # 2. wherever float64 autograd of the reference is finite, ours is finite and agrees
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want_out, _ = reference(q64, k64, v64, 1.0 / math.sqrt(q.shape[-1]), case["causal"])
    want = torch.autograd.grad(want_out, (q64, k64, v64), dout.double(), allow_unused=True)
    for name, got, ref in zip("qkv", grads, want):
        ref = torch.zeros_like(got, dtype=torch.float64) if ref is None else ref
        finite = ref.isfinite()
        assert got[finite].isfinite().all(), f"d{name}: NaN/inf where float64 autograd is finite"
        err = (got[finite].double() - ref[finite]).abs().max().item() if finite.any() else 0.0
        assert err <= 1e-3 * max(1.0, ref[finite].abs().max().item() if finite.any() else 1.0), f"d{name}: {err}"
