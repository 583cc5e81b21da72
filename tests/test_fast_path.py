"""The eager fast path of cs149gpt.attention() and cs149gpt.scaled_dot_product_attention() (module.cpp's
attention_fast and sdpa_fast: the checks and the fallback decision in C++): it computes exactly what the Python path
computes, and leaves to that path every call it must not take (arguments to refuse, autograd to record, torch's
fallbacks), so errors and fallbacks are unchanged.
"""
import pytest
import torch
import torch.nn.functional as F

import cs149gpt
from cs149gpt import _ext
from tests._helpers import gen


def qkv(dtype=torch.float32, hq=4, hkv=2, nq=3, nk=40, d=16):
    g = gen(2000)
    return (torch.randn(2, hq, nq, d, generator=g).to(dtype), torch.randn(2, hkv, nk, d, generator=g).to(dtype),
            torch.randn(2, hkv, nk, d, generator=g).to(dtype))


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True), dict(is_causal="bottom_right"), dict(scale=0.3),
                                    dict(impl="fused"), dict(block_q=5, block_k=7), dict(return_lse=True),
                                    dict(scale=2, impl="naive", is_causal="top_left")], ids=str)
def test_fast_path_equals_the_autograd_path(kwargs):
    """Without grad the call takes the C++ path; with requires_grad the Python one: the same bits."""
    q, k, v = qkv()
    fast = cs149gpt.attention(q, k, v, **kwargs)
    assert _ext.load().attention_fast(q, k, v, kwargs.get("impl", "flash"), kwargs.get("scale"),
                                      kwargs.get("is_causal", False), kwargs.get("block_q"), kwargs.get("block_k"),
                                      kwargs.get("return_lse", False)) is not None
    slow = cs149gpt.attention(q.clone().requires_grad_(), k, v, **kwargs)
    for a, b in zip(fast if isinstance(fast, tuple) else (fast,), slow if isinstance(slow, tuple) else (slow,)):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(is_causal="none"), ValueError, "is_causal must be"),
    (dict(impl="flashy"), ValueError, "impl must be one of"),
    (dict(impl=3), ValueError, "impl must be one of"),
    (dict(impl="fused", return_lse=True), ValueError, "return_lse=True needs impl='flash'"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite float32"),
    (dict(block_q=0), ValueError, "block_q must be >= 1"),
], ids=lambda x: str(x))
def test_fast_path_leaves_errors_to_the_wrapper(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        cs149gpt.attention(q, k, v, **kwargs)


def test_sdpa_fast_path_matches_and_falls_back():
    m = _ext.load()
    q, k, v = qkv(torch.bfloat16, hq=4, hkv=4)
    assert torch.equal(cs149gpt.scaled_dot_product_attention(q, k, v, is_causal=True),
                       cs149gpt.attention(q, k, v, is_causal=True))
    assert m.sdpa_fast(q, k, v, True, None, False) is not None
    # Calls that are torch's (GQA without enable_gqa, a non-bool is_causal, float64, an empty dim): None here, and
    # the wrapper answers what torch does.
    qg, kg, vg = qkv()
    assert m.sdpa_fast(qg, kg, vg, False, None, False) is None
    with pytest.raises(RuntimeError):
        cs149gpt.scaled_dot_product_attention(qg, kg, vg)
    assert m.sdpa_fast(q, k, v, 1, None, False) is None
    q64, k64, v64 = (t.double() for t in qkv(hq=2, hkv=2))
    assert m.sdpa_fast(q64, k64, v64, False, None, False) is None
    assert torch.equal(cs149gpt.scaled_dot_product_attention(q64, k64, v64), F.scaled_dot_product_attention(q64, k64, v64))
    assert m.sdpa_fast(q, k[:, :, :0], v[:, :, :0], False, None, False) is None
    # A gradient to record: the wrapper's path, which records it.
    qr = q.float().requires_grad_()
    assert m.sdpa_fast(qr, k.float(), v.float(), False, None, False) is None
    cs149gpt.scaled_dot_product_attention(qr, k.float(), v.float()).sum().backward()
    assert qr.grad is not None
