"""Bad input to cs149gpt.attention: a Python exception whose message names the problem, never a crash.

Each check runs for every impl (the checks come before any kernel), and the module keeps working after.
"""
import math

import numpy as np
import pytest
import torch

import cs149gpt
from tests._helpers import mismatch

IMPLS = cs149gpt.IMPLS


def qkv(q_shape, kv_shape=None, v_shape=None, dtype=torch.float32):
    kv_shape = kv_shape or q_shape
    return (torch.randn(q_shape).to(dtype), torch.randn(kv_shape).to(dtype),
            torch.randn(v_shape or kv_shape).to(dtype))


@pytest.fixture(autouse=True)
def still_works_afterwards():
    """After each error test, a normal call still gives the right answer."""
    yield
    q, k, v = qkv((1, 2, 9, 8), (1, 2, 11, 8))
    for impl in IMPLS:
        assert mismatch(cs149gpt.attention(q, k, v, impl=impl, is_causal=True), q, k, v, is_causal=True) is None


@pytest.mark.parametrize("impl", IMPLS)
def test_wrong_rank(impl):
    good = torch.randn(4, 8)
    for name, args in (("q", (torch.randn(8), good, good)), ("k", (good, torch.randn(8), good)),
                       ("v", (good, good, torch.randn(8))), ("q", (torch.tensor(1.0), good, good))):
        with pytest.raises(ValueError, match=rf"{name} must have shape \(\.\.\., N, d\), at least 2 dims"):
            cs149gpt.attention(*args, impl=impl)
    with pytest.raises(ValueError, match="same number of dims"):
        cs149gpt.attention(torch.randn(2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_shapes(impl):
    cases = [
        ("head dim d = 8", qkv((1, 2, 5, 8), (1, 2, 5, 7), (1, 2, 5, 8))),  # k's d differs
        ("head dim d = 8", qkv((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 9))),  # v's d differs
        ("k and v must have the same length", qkv((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 7, 8))),
        ("same leading dims", qkv((2, 2, 5, 8), (3, 2, 5, 8))),
        ("same leading dims", qkv((2, 2, 5, 8), (2, 2, 5, 8), (1, 2, 5, 8))),
        ("same leading dims", qkv((2, 3, 2, 5, 8), (2, 4, 2, 5, 8))),
        ("must be a multiple of those of k and v", qkv((1, 6, 5, 8), (1, 4, 5, 8))),
        ("must be a multiple of those of k and v", qkv((1, 2, 5, 8), (1, 4, 5, 8))),  # more kv heads than q
        ("must be a multiple of those of k and v", qkv((6, 5, 8), (4, 5, 8))),  # 3-D: heads are dim 0
        ("k and v must have the same number of heads", qkv((1, 6, 5, 8), (1, 2, 5, 8), (1, 3, 5, 8))),
    ]
    for message, (q, k, v) in cases:
        with pytest.raises(ValueError, match=message):
            cs149gpt.attention(q, k, v, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_dtypes(impl):
    """float32 everywhere, bf16/fp16 in flash only; integers and float64 are TypeErrors."""
    x = torch.randn(1, 2, 5, 8)
    for dtype in (torch.int64, torch.int32, torch.bool, torch.float64):
        t = x.to(dtype)
        with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
            cs149gpt.attention(t, t, t, impl=impl)
    for dtype in (torch.float16, torch.bfloat16):
        t = x.to(dtype)
        if impl == "flash":
            assert cs149gpt.attention(t, t, t, impl=impl).dtype == dtype
        else:
            with pytest.raises(TypeError, match=f"impl='{impl}' supports float32 only"):
                cs149gpt.attention(t, t, t, impl=impl)
    with pytest.raises(TypeError, match="share one dtype"):
        cs149gpt.attention(x, x.double(), x, impl=impl)
    with pytest.raises(TypeError, match="share one dtype"):
        cs149gpt.attention(x, x, x.to(torch.int64), impl=impl)
    with pytest.raises(TypeError, match="share one dtype"):
        cs149gpt.attention(x, x.half(), x.half(), impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_dims(impl):
    with pytest.raises(ValueError, match=r"head dim d \(the last dim of q\) must be >= 1"):
        cs149gpt.attention(*qkv((1, 2, 5, 0)), impl=impl)
    with pytest.raises(ValueError, match="q must have at least one query row"):
        cs149gpt.attention(*qkv((1, 2, 0, 8), (1, 2, 5, 8)), impl=impl)
    with pytest.raises(ValueError, match="k must have at least one key row"):
        cs149gpt.attention(*qkv((1, 2, 5, 8), (1, 2, 0, 8)), impl=impl)
    with pytest.raises(ValueError, match="q must have at least one query row"):
        cs149gpt.attention(*qkv((0, 8)), impl=impl)


@pytest.mark.parametrize("impl", ["blocked", "flash"])
@pytest.mark.parametrize("bad", [0, -1, -(2**40)])
def test_nonpositive_blocks(impl, bad):
    q, k, v = qkv((1, 2, 5, 8))
    with pytest.raises(ValueError, match=f"block_q must be >= 1, got {bad}"):
        cs149gpt.attention(q, k, v, impl=impl, block_q=bad)
    with pytest.raises(ValueError, match=f"block_k must be >= 1, got {bad}"):
        cs149gpt.attention(q, k, v, impl=impl, block_k=bad)
    if impl == "flash":
        with pytest.raises(ValueError, match=f"block_k must be >= 1, got {bad}"):
            cs149gpt.attention(q, k, v, impl=impl, block_q=4, block_k=bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_arguments_of_the_wrong_type_are_named(impl):
    """A float tile or a string scale: a TypeError naming the argument, not the operator's schema dump. Whatever
    the operator converts (ints for the tiles, numbers for scale, numpy scalars) is still taken."""
    q, k, v = qkv((1, 2, 5, 8))
    for name, bad in (("block_q", 16.0), ("block_k", "4"), ("scale", "0.5"), ("scale", [0.5])):
        with pytest.raises(TypeError, match=f"{name} must be an? (int|float) or None, got"):
            cs149gpt.attention(q, k, v, impl=impl, **{name: bad})
    want = cs149gpt.attention(q, k, v, impl=impl, block_q=4, scale=0.5)
    assert torch.equal(cs149gpt.attention(q, k, v, impl=impl, block_q=np.int64(4), scale=np.float32(0.5)), want)


def test_blocked_checks_block_k_even_with_block_q():
    """blocked tiles with block_q; a bad block_k beside it is still an error, not silently ignored."""
    q, k, v = qkv((1, 2, 5, 8))
    with pytest.raises(ValueError, match="block_k must be >= 1"):
        cs149gpt.attention(q, k, v, impl="blocked", block_q=4, block_k=0)


@pytest.mark.parametrize("impl", ["naive", "fused"])
def test_untiled_impls_check_blocks(impl):
    """naive and fused have no tiles, but a bad tile argument is still an error."""
    q, k, v = qkv((1, 2, 5, 8))
    with pytest.raises(ValueError, match="block_q must be >= 1"):
        cs149gpt.attention(q, k, v, impl=impl, block_q=0)


def test_unknown_impl():
    q, k, v = qkv((1, 2, 5, 8))
    for impl in ("Flash", "", "sdpa", None):
        with pytest.raises(ValueError, match="impl must be one of 'naive', 'blocked', 'fused', 'flash'"):
            cs149gpt.attention(q, k, v, impl=impl)
    # The operator itself checks too (the Python wrapper is not the only way in).
    with pytest.raises(ValueError, match="impl must be one of .*; got 'sdpa'"):
        torch.ops.cs149gpt.attention(q, k, v, "sdpa", None, "none", None, None)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_tensor_inputs(impl):
    q = torch.randn(4, 8)
    for bad in (None, [[1.0] * 8] * 4, 3.0, q.numpy()):
        with pytest.raises(TypeError, match="q must be a torch.Tensor"):
            cs149gpt.attention(bad, q, q, impl=impl)
        with pytest.raises(TypeError, match="k must be a torch.Tensor"):
            cs149gpt.attention(q, bad, q, impl=impl)
        with pytest.raises(TypeError, match="v must be a torch.Tensor"):
            cs149gpt.attention(q, q, bad, impl=impl)


def test_options_are_keyword_only():
    q = torch.randn(4, 8)
    with pytest.raises(TypeError):
        cs149gpt.attention(q, q, q, "naive")


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_scale(impl):
    q, k, v = qkv((1, 2, 5, 8))
    for scale in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="scale must be a finite float32"):
            cs149gpt.attention(q, k, v, impl=impl, scale=scale)


@pytest.mark.parametrize("impl", ["naive", "blocked"])
def test_score_matrix_too_large(impl):
    """Nq = Nk = 2**20 would need a 4 TiB score matrix: refused up front (q, k, v are only 4 MiB each)."""
    q, k, v = (torch.empty(1, 1, 2**20, 1) for _ in range(3))
    with pytest.raises(torch.OutOfMemoryError, match="score matrix"):
        cs149gpt.attention(q, k, v, impl=impl)
    # 2**32 x 2**32 floats overflows int64: still refused, not wrapped around (zero-stride views, no memory).
    e = torch.empty(1, 1, 1, 1).expand(1, 1, 2**32, 1)
    with pytest.raises(RuntimeError, match="score matrix"):
        cs149gpt.attention(e, e, e, impl=impl)
