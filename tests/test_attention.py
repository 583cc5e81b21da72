"""cs149gpt.attention against a float64 reference: every impl, shape, tile size, mask, layout and ISA.

Each test builds inputs from a fixed seed, runs the kernel and compares with tests._helpers.reference
(softmax(scale · q kᵀ + mask) v in float64). Where a test loops over configurations it collects every
mismatch and reports them all, so one failure names each (config, error) pair.
"""
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cs149gpt
from tests._helpers import ALL_ISAS, TOL, expected_strides, gen, isa, mismatch, module, randn, reference  # noqa: F401  (isa: fixture)

ROOT = Path(__file__).resolve().parent.parent

# Tile sizes for each impl: (block_q, block_k). 1000 is larger than every N below; 3 and 17 divide none.
BLOCKS = {
    "naive": [(None, None), (3, 17)],  # naive and fused have no tiles: the arguments must be harmless
    "fused": [(None, None), (17, 3)],
    "blocked": [(None, None), (1, None), (3, None), (17, None), (1000, None), (None, 5)],
    "flash": [(None, None), (1, 1), (1, 3), (3, 17), (17, 3), (17, 1000), (1000, 17), (1000, 1000)],
    "flash_teaching": [(None, None), (1, 1), (3, 17), (17, 3), (1000, 1000)],
}

# (B, H, Nq, Nk, d): N and d mostly not multiples of any tile or SIMD width; Nq != Nk both ways.
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 1, 1, 1, 64),
    (1, 1, 33, 33, 17),
    (2, 3, 33, 33, 17),
    (1, 2, 1, 40, 32),
    (1, 2, 40, 1, 32),
    (2, 2, 17, 45, 64),
    (2, 2, 45, 17, 64),
    (1, 2, 65, 65, 128),
    (1, 1, 70, 70, 1),
]


def run_configs(q, k, v, impl, configs, *, scale=None, tol=TOL):
    """Runs attention for every (block_q, block_k, is_causal) in configs; returns the list of failures."""
    failures = []
    for block_q, block_k, is_causal in configs:
        out = cs149gpt.attention(q, k, v, impl=impl, scale=scale, is_causal=is_causal, block_q=block_q,
                                 block_k=block_k)
        problem = mismatch(out, q, k, v, scale=scale, is_causal=is_causal, tol=tol)
        if problem:
            failures.append(f"block_q={block_q} block_k={block_k} is_causal={is_causal} scale={scale}: {problem}")
    return failures


def test_reference_matches_torch_sdpa():
    """The float64 reference means what torch's SDPA means: causal top-left with Nq != Nk, GQA, scale."""
    g = gen(0)
    for (hq, hkv, n_q, n_k, d) in [(4, 4, 9, 9, 8), (6, 2, 5, 12, 16), (6, 1, 12, 5, 7), (3, 3, 1, 7, 4)]:
        q, k, v = randn(2, hq, n_q, d, gen=g), randn(2, hkv, n_k, d, gen=g), randn(2, hkv, n_k, d, gen=g)
        for scale in (None, 0.3):
            for is_causal in (False, True):
                want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                                      scale=scale, enable_gqa=hq != hkv)
                got = reference(q, k, v, scale=scale, is_causal=is_causal)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_shapes_and_blocks(isa, impl, shape, is_causal):
    B, H, n_q, n_k, d = shape
    g = gen(hash(shape) % 2**31)
    q, k, v = randn(B, H, n_q, d, gen=g), randn(B, H, n_k, d, gen=g), randn(B, H, n_k, d, gen=g)
    failures = run_configs(q, k, v, impl, [(bq, bk, is_causal) for bq, bk in BLOCKS[impl]])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_explicit_scale(isa, impl):
    """scale multiplies q·k instead of 1/sqrt(d); 0 gives a plain (prefix) mean of v, negative flips it."""
    g = gen(1)
    failures = []
    for B, H, n_q, n_k, d in [(2, 2, 33, 21, 17), (1, 3, 21, 33, 64)]:
        q, k, v = randn(B, H, n_q, d, gen=g), randn(B, H, n_k, d, gen=g), randn(B, H, n_k, d, gen=g)
        for scale in (0.3, 1.0, 0.0, -0.7, 2.5):
            configs = [(bq, bk, c) for bq, bk in BLOCKS[impl][:3] for c in (False, True)]
            failures += run_configs(q, k, v, impl, configs, scale=scale)
    assert not failures, "\n".join(failures)


def test_scale_none_is_one_over_sqrt_d():
    g = gen(2)
    q, k, v = randn(1, 2, 9, 17, gen=g), randn(1, 2, 9, 17, gen=g), randn(1, 2, 9, 17, gen=g)
    for impl in cs149gpt.IMPLS:
        default = cs149gpt.attention(q, k, v, impl=impl)
        explicit = cs149gpt.attention(q, k, v, impl=impl, scale=1 / math.sqrt(17))
        torch.testing.assert_close(default, explicit, rtol=0, atol=1e-6)
        assert (default - cs149gpt.attention(q, k, v, impl=impl, scale=1.0)).abs().max() > 1e-3


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_n256_d64(isa, impl):
    g = gen(3)
    q, k, v = randn(1, 2, 256, 64, gen=g), randn(1, 2, 256, 64, gen=g), randn(1, 2, 256, 64, gen=g)
    failures = run_configs(q, k, v, impl, [(None, None, False), (None, None, True), (48, 80, True)])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl", ["blocked", "flash"])
def test_huge_blocks(impl):
    """Tile sizes far beyond N mean "the whole sequence", with no overflow in the tile arithmetic."""
    g = gen(16)
    q, k, v = randn(1, 2, 9, 8, gen=g), randn(1, 2, 11, 8, gen=g), randn(1, 2, 11, 8, gen=g)
    huge = [2**31, 2**40, 2**62] + ([2**63 - 1] if impl == "flash" else [])
    configs = [cfg for b in huge for cfg in ((b, None, True), (None, b, False), (b, b, True), (3, b, True))]
    failures = run_configs(q, k, v, impl, configs)
    assert not failures, "\n".join(failures)


def test_blocked_int64_max_tile():
    """(q_len + T - 1) / T must not overflow: a tile beyond every dimension is the whole matrix."""
    g = gen(17)
    q, k, v = randn(1, 2, 9, 8, gen=g), randn(1, 2, 9, 8, gen=g), randn(1, 2, 9, 8, gen=g)
    out = cs149gpt.attention(q, k, v, impl="blocked", block_q=2**63 - 1)
    assert mismatch(out, q, k, v) is None, mismatch(out, q, k, v)


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_scale_beyond_float32(impl):
    """A scale that float32 cannot hold (the kernels compute in float32) is refused, never a NaN output."""
    g = gen(18)
    q, k, v = randn(1, 2, 9, 8, gen=g), randn(1, 2, 9, 8, gen=g), randn(1, 2, 9, 8, gen=g)
    with pytest.raises(ValueError, match="scale must be a finite float32"):
        cs149gpt.attention(q, k, v, impl=impl, scale=1e39)


# ---------------------------------------------------------------------------------------------------------
# Strided inputs: read in place (never modified), whatever the layout.
# ---------------------------------------------------------------------------------------------------------
def _layout(name, g, B=2, H=3, n_q=21, n_k=26, d=17):
    if name == "gpt_qkv":  # x.view(B, T, 3, H, d), split, .transpose(1, 2): what a GPT block does
        n_k = n_q  # self-attention: one sequence
        x = randn(B, n_q, 3 * H * d, gen=g).view(B, n_q, 3, H, d)
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    elif name == "bnhd_transposed":
        q, k, v = (randn(B, n, H, d, gen=g).transpose(1, 2) for n in (n_q, n_k, n_k))
    elif name == "every_other_row":
        q = randn(B, H, 2 * n_q, d, gen=g)[:, :, ::2]
        k = randn(B, H, 2 * n_k, d, gen=g)[:, :, ::2]
        v = randn(B, H, 2 * n_k + 1, d, gen=g)[:, :, 1::2]  # storage offset too
    elif name == "column_slice":  # rows longer than d, starting part-way in
        q = randn(B, H, n_q, 2 * d, gen=g)[..., :d]
        k = randn(B, H, n_k, d + 5, gen=g)[..., 3:3 + d]
        v = randn(B, H, n_k, 3 * d, gen=g)[..., d:2 * d]
    elif name == "last_dim_strided":  # the head_dim columns themselves are strided
        q = randn(B, H, d, n_q, gen=g).transpose(-1, -2)
        k = randn(B, H, n_k, 2 * d, gen=g)[..., ::2]
        v = randn(B, H, d, n_k, gen=g).transpose(-1, -2)
    elif name == "broadcast":  # zero strides: expanded batch, heads and rows
        q = randn(1, H, n_q, d, gen=g).expand(B, H, n_q, d)
        k = randn(1, 1, n_k, d, gen=g).expand(B, H, n_k, d)
        v = randn(B, 1, 1, d, gen=g).expand(B, H, n_k, d)  # every key row the same value row
    elif name == "heads_batch_swapped":
        q, k, v = (randn(H, B, n, d, gen=g).transpose(0, 1) for n in (n_q, n_k, n_k))
    else:
        raise AssertionError(name)
    assert q.shape == (B, H, n_q, d) and k.shape == v.shape == (B, H, n_k, d)
    return q, k, v


@pytest.mark.parametrize("layout", ["contiguous", "gpt_qkv", "bnhd_transposed", "heads_batch_swapped", "one_row"])
def test_output_laid_out_as_torchs(layout):
    """The output's memory layout is torch's CPU SDPA's for the same q (the rule expected_strides() writes down, which
    every correctness check here applies): a model's out.transpose(1, 2).contiguous() costs what it does on torch."""
    g = gen(41)
    if layout == "one_row":  # decoding: (B, N, H·d) with N = 1
        q = randn(2, 1, 4 * 16, gen=g).view(2, 1, 4, 16).transpose(1, 2)
        k = v = randn(2, 4, 9, 16, gen=g)
    elif layout == "contiguous":
        q, k, v = (randn(2, 4, 9, 16, gen=g) for _ in range(3))
    else:
        q, k, v = _layout(layout, g)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert theirs.stride() == expected_strides(q), (theirs.stride(), expected_strides(q))
    for out in (cs149gpt.scaled_dot_product_attention(q, k, v), cs149gpt.attention(q, k, v),
                cs149gpt.attention(q, k, v, impl="fused")):
        assert out.stride() == theirs.stride()


LAYOUTS = ["gpt_qkv", "bnhd_transposed", "every_other_row", "column_slice", "last_dim_strided", "broadcast",
           "heads_batch_swapped"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_strided_inputs(isa, impl, layout):
    q, k, v = _layout(layout, gen(4))
    if layout not in ("broadcast", "last_dim_strided"):
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    before = [t.clone() for t in (q, k, v)]
    strides = [t.stride() for t in (q, k, v)]
    configs = [(bq, bk, c) for bq, bk in BLOCKS[impl][:4] for c in (False, True)]
    failures = run_configs(q, k, v, impl, configs)
    assert not failures, "\n".join(failures)
    for t, t0, s in zip((q, k, v), before, strides):
        assert torch.equal(t, t0) and t.stride() == s, "an input was modified"


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_strided_and_gqa_match_contiguous_bitwise(impl):
    """Strided views are read in place: same kernels, same numbers as the contiguous copy (bitwise), also
    for GQA, where kv heads are shared rather than copied."""
    g = gen(5)
    for layout in ("gpt_qkv", "every_other_row", "column_slice", "heads_batch_swapped"):
        q, k, v = _layout(layout, g)
        for c in (False, True):
            a = cs149gpt.attention(q, k, v, impl=impl, is_causal=c, block_q=3, block_k=17)
            b = cs149gpt.attention(q.contiguous(), k.contiguous(), v.contiguous(), impl=impl, is_causal=c,
                                   block_q=3, block_k=17)
            assert torch.equal(a, b), f"{layout} is_causal={c}"
    q, k, v = randn(2, 6, 19, 24, gen=g), randn(2, 2, 19, 24, gen=g), randn(2, 2, 19, 24, gen=g)
    a = cs149gpt.attention(q, k, v, impl=impl, is_causal=True)
    b = cs149gpt.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), impl=impl, is_causal=True)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# Ranks and grouped-query attention
# ---------------------------------------------------------------------------------------------------------
RANK_CASES = {
    # name: (q shape, k/v shape)
    "2d": ((33, 17), (26, 17)),
    "3d": ((3, 33, 17), (3, 26, 17)),
    "3d_gqa": ((6, 21, 16), (2, 30, 16)),
    "5d": ((2, 3, 2, 21, 17), (2, 3, 2, 26, 17)),
    "5d_gqa": ((2, 2, 6, 21, 17), (2, 2, 3, 26, 17)),
    "6d": ((2, 1, 2, 2, 9, 8), (2, 1, 2, 2, 12, 8)),
}


@pytest.mark.parametrize("case", list(RANK_CASES))
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_ranks(impl, case):
    q_shape, kv_shape = RANK_CASES[case]
    g = gen(6)
    q, k, v = randn(*q_shape, gen=g), randn(*kv_shape, gen=g), randn(*kv_shape, gen=g)
    configs = [(bq, bk, c) for bq, bk in BLOCKS[impl][:3] for c in (False, True)]
    failures = run_configs(q, k, v, impl, configs)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_5d_non_flattenable_leading_dims(impl):
    """Leading dims whose strides cannot be merged into one batch dim (a permuted 5-D view)."""
    g = gen(7)
    q = randn(3, 2, 4, 13, 8, gen=g).transpose(0, 1)
    k = randn(3, 2, 2, 15, 8, gen=g).transpose(0, 1)
    v = randn(2, 3, 2, 15, 8, gen=g)
    failures = run_configs(q, k, v, impl, [(None, None, False), (3, 5, True)])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_gqa(isa, impl):
    """Hq = 6 query heads over Hkv in {6, 3, 2, 1}: query head h reads kv head h // (Hq / Hkv)."""
    g = gen(8)
    failures = []
    for h_kv in (6, 3, 2, 1):
        for n_q, n_k, d in ((33, 33, 17), (12, 40, 32)):
            q, k, v = randn(2, 6, n_q, d, gen=g), randn(2, h_kv, n_k, d, gen=g), randn(2, h_kv, n_k, d, gen=g)
            kt, vt = (randn(2, n_k, h_kv, d, gen=g).transpose(1, 2) for _ in range(2))  # strided kv heads
            configs = [(bq, bk, c) for bq, bk in BLOCKS[impl][:3] for c in (False, True)]
            failures += [f"Hkv={h_kv} Nq={n_q} Nk={n_k} d={d}: " + f for f in run_configs(q, k, v, impl, configs)]
            failures += [f"Hkv={h_kv} transposed kv: " + f for f in run_configs(q, kt, vt, impl, configs)]
    assert not failures, "\n".join(failures)


def test_empty_batch():
    """A zero-size batch is not an error: the output is empty with q's shape."""
    q, k = torch.randn(0, 2, 5, 8), torch.randn(0, 2, 7, 8)
    for impl in cs149gpt.IMPLS:
        out = cs149gpt.attention(q, k, k, impl=impl)
        assert out.shape == q.shape and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# Large logits: the softmax is stabilised (max subtracted, online rescaling in flash)
# ---------------------------------------------------------------------------------------------------------
LARGE_TOL = 1e-3


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_large_logits_random(isa, impl):
    """Logits of magnitude ~1e4 (q, k scaled by 100, scale 1): the softmax is nearly one-hot."""
    g = gen(9)
    q, k, v = 100 * randn(2, 2, 37, 16, gen=g), 100 * randn(2, 2, 45, 16, gen=g), randn(2, 2, 45, 16, gen=g)
    logits = q.double() @ k.double().transpose(-1, -2)
    assert logits.abs().max() > 1e4
    # The data test something only if each row's winner is clear: no near-tie that float32 cannot resolve.
    hidden = ~torch.ones(37, 45, dtype=torch.bool).tril()
    for masked in (logits, logits.masked_fill(hidden, float("-inf"))):
        top2 = masked.topk(2, dim=-1).values
        assert (top2[..., 0] - top2[..., 1]).min() > 1.0
    configs = [(bq, bk, c) for bq, bk in BLOCKS[impl] for c in (False, True)]
    failures = run_configs(q, k, v, impl, configs, scale=1.0, tol=LARGE_TOL)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_large_logits_monotone(isa, impl):
    """Logits 5000·(j+1) growing along the keys (every new tile has a larger max: flash must rescale each
    time), shrinking (the first key wins), and all equal to 1e4 (a uniform average)."""
    g = gen(10)
    n_q, n_k, d = 23, 29, 8
    u = randn(d, gen=g)
    u = u / u.norm()
    v = randn(1, 2, n_k, d, gen=g)
    growth = torch.arange(1, n_k + 1, dtype=torch.float32)[:, None]
    q = (100 * u).expand(1, 2, n_q, d)
    cases = {
        "growing": (50 * growth * u).expand(1, 2, n_k, d),
        "shrinking": (50 * growth.flip(0) * u).expand(1, 2, n_k, d),
        "equal": (100 * u).expand(1, 2, n_k, d),
    }
    failures = []
    for name, k in cases.items():
        for bq, bk in BLOCKS[impl]:
            for c in (False, True):
                out = cs149gpt.attention(q, k, v, impl=impl, scale=1.0, is_causal=c, block_q=bq, block_k=bk)
                problem = mismatch(out, q, k, v, scale=1.0, is_causal=c, tol=LARGE_TOL)
                # The exact answers, independent of any softmax: one-hot rows, or prefix means of v.
                rows = torch.arange(n_q)
                last_visible = rows.clamp(max=n_k - 1) if c else torch.full((n_q,), n_k - 1)
                if name == "growing":
                    exact = v[:, :, last_visible]
                elif name == "shrinking":
                    exact = v[:, :, :1].expand(1, 2, n_q, d)
                else:
                    exact = (v.double().cumsum(2) / torch.arange(1, n_k + 1)[:, None])[:, :, last_visible]
                err = (out.double() - exact.double()).abs().max().item()
                if problem or err > LARGE_TOL:
                    failures.append(f"{name} block_q={bq} block_k={bk} is_causal={c}: {problem} exact err={err}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------------------
# Threads: torch.set_num_threads controls the kernels; results do not depend on the thread count
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_one_and_two_threads_bitwise_equal(isa, impl, restore_threads):
    g = gen(11)
    q, k, v = randn(2, 4, 130, 40, gen=g), randn(2, 2, 97, 40, gen=g), randn(2, 2, 97, 40, gen=g)
    results = {}
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        for c in (False, True):
            out = cs149gpt.attention(q, k, v, impl=impl, is_causal=c, block_q=7, block_k=20)
            if (threads, c) in results:
                assert torch.equal(out, results[threads, c]), f"not repeatable: threads={threads} is_causal={c}"
            results[threads, c] = out
    for c in (False, True):
        assert torch.equal(results[1, c], results[2, c]), f"1 vs 2 threads differ, is_causal={c}"
        assert mismatch(results[1, c], q, k, v, is_causal=c) is None


def test_set_num_threads_controls_the_kernels():
    """In a fresh process (the OpenMP thread pool is per process): with torch.set_num_threads(1) the kernels
    start no thread; with 2 they do. Fails if the extension ran its own OpenMP runtime, ignoring torch's."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux /proc to count threads")
    script = textwrap.dedent("""
        import os, torch, cs149gpt
        def threads(): return len(os.listdir("/proc/self/task"))
        torch.set_num_threads(1)
        q = torch.randn(2, 4, 300, 64)
        cs149gpt.attention(q[:, :, :2], q[:, :, :2], q[:, :, :2])  # loads the module; tiny, still 1 thread
        n0 = threads()
        for impl in cs149gpt.IMPLS:
            cs149gpt.attention(q, q, q, impl=impl, is_causal=True)
        n1 = threads()
        torch.set_num_threads(2)
        cs149gpt.attention(q, q, q, impl="flash", is_causal=True)
        n2 = threads()
        print(n0, n1, n2)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    n0, n1, n2 = map(int, res.stdout.split()[-3:])
    assert n1 == n0, f"with 1 thread the kernels started {n1 - n0} threads"
    assert n2 > n1, "with torch.set_num_threads(2) the kernels still ran on one thread"


# ---------------------------------------------------------------------------------------------------------
# ISA selection and the operator registration
# ---------------------------------------------------------------------------------------------------------
def test_isa_api():
    m = module()
    assert m.isa() in ALL_ISAS
    assert cs149gpt.isa() == m.isa()
    assert m._testing.cpu_supports(m.isa())
    assert m._testing.cpu_supports("scalar")
    assert not m._testing.cpu_supports("neon") and not m._testing.cpu_supports("")
    if m._testing.cpu_supports("avx512"):
        assert m._testing.cpu_supports("avx2"), "an AVX-512 CPU with our feature set also runs the AVX2 kernels"
    for wider, narrower in (("amx", "avx512_bf16"), ("amx_emulated", "avx512_bf16"), ("avx512_bf16", "amx_emulated"),
                            ("avx512_bf16", "avx512")):
        if m._testing.cpu_supports(wider):
            assert m._testing.cpu_supports(narrower), f"{wider} implies {narrower}"
    with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
        m._testing.set_isa("sse9")
    assert m.isa() in ALL_ISAS


def test_set_isa_unsupported_raises():
    m = module()
    unsupported = [n for n in ALL_ISAS if not m._testing.cpu_supports(n)]
    if not unsupported:
        pytest.skip("this CPU runs every ISA")
    original = m.isa()
    with pytest.raises(ValueError, match="does not support"):
        m._testing.set_isa(unsupported[0])
    assert m.isa() == original


def test_default_isa_is_widest_supported():
    m = module()
    if os.environ.get("CS149GPT_ISA"):
        pytest.skip("CS149GPT_ISA forces the ISA")
    widest = next(n for n in ALL_ISAS if m._testing.cpu_supports(n))
    script = "import cs149gpt; print(cs149gpt.isa())"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == widest


def test_cs149gpt_isa_environment_variable():
    """CS149GPT_ISA=scalar forces the portable kernels; a bad name is a ValueError at first use, no crash."""
    script = textwrap.dedent("""
        import torch, cs149gpt
        print(cs149gpt.isa())
    """)
    bad = textwrap.dedent("""
        import torch, cs149gpt
        q = torch.randn(3, 4)
        try:
            cs149gpt.attention(q, q, q)
        except ValueError as e:
            print("ValueError:", e)
    """)
    base = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", s], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(base, CS149GPT_ISA=isa_name), cwd=ROOT)
             for s, isa_name in ((script, "scalar"), (bad, "bogus"))]
    (out_ok, err_ok), (out_bad, err_bad) = (p.communicate(timeout=600) for p in procs)
    assert procs[0].returncode == 0, err_ok
    assert out_ok.split()[-1] == "scalar"
    assert procs[1].returncode == 0, err_bad
    assert "ValueError:" in out_bad and "bogus" in out_bad


def test_torch_ops_registration_matches_python_api():
    g = gen(12)
    q, k, v = randn(2, 2, 19, 24, gen=g), randn(2, 2, 25, 24, gen=g), randn(2, 2, 25, 24, gen=g)
    for impl in cs149gpt.IMPLS:
        a = cs149gpt.attention(q, k, v, impl=impl, scale=0.3, is_causal=True, block_q=5, block_k=6)
        b = torch.ops.cs149gpt.attention(q, k, v, impl, 0.3, "top_left", 5, 6)
        assert torch.equal(a, b)
    # the schema's defaults: impl='flash', scale=None, causal="none"
    assert torch.equal(torch.ops.cs149gpt.attention(q, k, v), cs149gpt.attention(q, k, v))


def test_isas_agree(restore_threads):
    """Every supported ISA gives the same answer up to rounding (each is also checked against float64)."""
    m = module()
    names = [n for n in ALL_ISAS if m._testing.cpu_supports(n)]
    if len(names) < 2:
        pytest.skip("only one ISA here")
    g = gen(13)
    q, k, v = randn(2, 3, 45, 33, gen=g), randn(2, 3, 38, 33, gen=g), randn(2, 3, 38, 33, gen=g)
    original = m.isa()
    try:
        for impl in cs149gpt.IMPLS:
            outs = []
            for n in names:
                m._testing.set_isa(n)
                outs.append(cs149gpt.attention(q, k, v, impl=impl, is_causal=True, block_q=3, block_k=17))
            for o in outs[1:]:
                torch.testing.assert_close(o, outs[0], rtol=0, atol=1e-5)
    finally:
        m._testing.set_isa(original)


# ---------------------------------------------------------------------------------------------------------
# Optional sweeps: pytest -m slow
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("impl", cs149gpt.IMPLS)
def test_sweep_lengths_dims_blocks(isa, impl):
    """Every Nq, Nk in a range against every tile size, for several d."""
    g = gen(14)
    failures = []
    for d in (1, 3, 8, 15, 16, 17, 31, 33, 64, 100, 200):
        for n_q in (1, 2, 5, 8, 16, 31, 64, 97):
            for n_k in (1, 3, 8, 17, 63, 96):
                q, k, v = randn(1, 2, n_q, d, gen=g), randn(1, 2, n_k, d, gen=g), randn(1, 2, n_k, d, gen=g)
                blocks = BLOCKS[impl] + ([(2, 5), (8, 8), (16, 64), (97, 96)] if impl == "flash" else [])
                configs = [(bq, bk, c) for bq, bk in blocks for c in (False, True)]
                failures += [f"Nq={n_q} Nk={n_k} d={d}: " + f for f in run_configs(q, k, v, impl, configs)]
    assert not failures, "\n".join(failures[:50])


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "flash", "blocked"])
def test_long_sequence(impl):
    g = gen(15)
    q, k, v = randn(1, 4, 2048, 64, gen=g), randn(1, 2, 2048, 64, gen=g), randn(1, 2, 2048, 64, gen=g)
    failures = run_configs(q, k, v, impl, [(None, None, True), (None, None, False)])
    assert not failures, "\n".join(failures)
