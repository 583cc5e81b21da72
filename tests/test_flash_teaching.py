"""The readable fourth rung, impl="flash_teaching" (csrc/kernels/flash_teaching.cpp): FlashAttention's Algorithm 1 in
float32 scalar C++, against float64 PyTorch. Tiles that do not divide N, Nq != Nk, both causal alignments, GQA, head
dims 32/64/80, strided views; and what it refuses, by argument."""
import math

import pytest
import torch

import cs149gpt

TOL = dict(rtol=2e-5, atol=2e-5)


def reference(q, k, v, scale=None, causal="none"):
    """softmax(scale · q kᵀ, masked) v in float64; a row that sees no key is 0 (as the kernels write it)."""
    q, k, v = q.double(), k.double(), v.double()
    if k.size(-3) != q.size(-3):  # GQA: each kv head serves a group of query heads
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    s = scale * q @ k.transpose(-2, -1)
    n_q, n_k = q.size(-2), k.size(-2)
    if causal != "none":
        offset = n_k - n_q if causal == "bottom_right" else 0
        hidden = torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + offset
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: softmax of all −inf is NaN; the kernel's 0
    return p @ v


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("d", [32, 64, 80])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("n_q, n_k", [(1, 1), (37, 37), (50, 29), (29, 50), (130, 70)])
def test_against_float64(d, causal, n_q, n_k):
    q, k, v = randn(2, 3, n_q, d, seed=n_q + d), randn(2, 3, n_k, d, seed=n_k), randn(2, 3, n_k, d, seed=d)
    mode = "bottom_right" if causal == "bottom_right" else ("top_left" if causal else "none")
    expected = reference(q, k, v, causal=mode)
    for block_q, block_k in [(None, None), (1, 1), (7, 5), (16, 64), (64, 16), (1000, 1000)]:
        out = cs149gpt.attention(q, k, v, impl="flash_teaching", is_causal=causal, block_q=block_q, block_k=block_k)
        assert out.dtype == torch.float32 and out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, **TOL, msg=f"tiles {block_q} x {block_k}")


def test_gqa_scale_and_3d():
    q, k, v = randn(8, 33, 64, seed=1), randn(2, 21, 64, seed=2), randn(2, 21, 64, seed=3)  # (H, N, d), 4 per kv head
    for scale in (0.3, 0.0, -1.5):
        out = cs149gpt.attention(q, k, v, impl="flash_teaching", scale=scale, is_causal=True, block_q=5, block_k=4)
        torch.testing.assert_close(out.double(), reference(q, k, v, scale, "top_left"), **TOL)


def test_strided_views():
    """A GPT's (B, T, 3·H·d) projection viewed as q, k, v of (B, H, T, d): the kernel reads them through strides."""
    B, T, H, d = 2, 45, 4, 32
    qkv = randn(B, T, 3 * H * d, seed=4)
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=-1))
    assert not q.is_contiguous()
    out = cs149gpt.attention(q, k, v, impl="flash_teaching", is_causal=True, block_q=16, block_k=7)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal="top_left"), **TOL)
    # Every other key of a longer sequence: a row stride of two rows.
    k2, v2 = randn(1, 2, 60, 32, seed=5)[:, :, ::2], randn(1, 2, 60, 32, seed=6)[:, :, ::2]
    q2 = randn(1, 2, 17, 32, seed=7)
    out = cs149gpt.attention(q2, k2, v2, impl="flash_teaching", block_q=4, block_k=8)
    torch.testing.assert_close(out.double(), reference(q2, k2, v2), **TOL)


def test_same_as_the_fast_kernel():
    q, k, v = randn(1, 4, 200, 64, seed=8), randn(1, 4, 200, 64, seed=9), randn(1, 4, 200, 64, seed=10)
    for causal in (False, True):
        torch.testing.assert_close(cs149gpt.attention(q, k, v, impl="flash_teaching", is_causal=causal),
                                   cs149gpt.attention(q, k, v, impl="flash", is_causal=causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(return_lse=True), ValueError, "return_lse=True needs impl='flash'"),
    (dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)), ValueError, "attn_mask needs impl='flash'"),
    (dict(window=(2, 0)), ValueError, "window needs impl='flash'"),
    (dict(dropout_p=0.1), ValueError, "dropout_p needs impl='flash'"),
    (dict(block_q=0), ValueError, "block_q must be >= 1"),
])
def test_refuses_what_it_does_not_take(kwargs, error, message):
    q = randn(1, 2, 5, 8, seed=11)
    with pytest.raises(error, match=message):
        cs149gpt.attention(q, q, q, impl="flash_teaching", **kwargs)


def test_refuses_bad_input():
    x = randn(1, 2, 5, 8, seed=12)
    with pytest.raises(TypeError, match="impl='flash_teaching' supports float32 only"):
        cs149gpt.attention(x.bfloat16(), x.bfloat16(), x.bfloat16(), impl="flash_teaching")
    with pytest.raises(ValueError, match="k and v must have head dim d = 8"):
        cs149gpt.attention(x, x[..., :4], x[..., :4], impl="flash_teaching")
    # The operator itself (what the fake kernels and torch.compile see) says the same.
    with pytest.raises(TypeError, match="impl='flash_teaching' supports float32 only"):
        torch.ops.cs149gpt.attention(x.half(), x.half(), x.half(), "flash_teaching")
    with pytest.raises(ValueError, match="k and v must have head dim d = 8"):
        torch.ops.cs149gpt.attention(x.to("meta"), x[..., :4].to("meta"), x[..., :4].to("meta"), "flash_teaching")


def test_not_differentiable():
    q = randn(1, 1, 4, 8, seed=13).requires_grad_()
    out = cs149gpt.attention(q, q, q, impl="flash_teaching")
    with pytest.raises(RuntimeError, match="not differentiable"):
        out.sum().backward()
