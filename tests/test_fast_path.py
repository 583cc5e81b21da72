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
    assert m.sdpa_fast(q, k, v, None, True, None, False) is not None
    # Calls that are torch's (GQA without enable_gqa, a non-bool is_causal, float64, an empty dim): None here, and
    # the wrapper answers what torch does.
    qg, kg, vg = qkv()
    assert m.sdpa_fast(qg, kg, vg, None, False, None, False) is None
    with pytest.raises(RuntimeError):
        cs149gpt.scaled_dot_product_attention(qg, kg, vg)
    assert m.sdpa_fast(q, k, v, None, 1, None, False) is None
    q64, k64, v64 = (t.double() for t in qkv(hq=2, hkv=2))
    assert m.sdpa_fast(q64, k64, v64, None, False, None, False) is None
    assert torch.equal(cs149gpt.scaled_dot_product_attention(q64, k64, v64), F.scaled_dot_product_attention(q64, k64, v64))
    assert m.sdpa_fast(q, k[:, :, :0], v[:, :, :0], None, False, None, False) is None
    # A gradient to record: the wrapper's path, which records it.
    qr = q.float().requires_grad_()
    assert m.sdpa_fast(qr, k.float(), v.float(), None, False, None, False) is None
    cs149gpt.scaled_dot_product_attention(qr, k.float(), v.float()).sum().backward()
    assert qr.grad is not None


def masks(q, k):
    """The masks models pass, in each dtype our kernel reads: (B,1,Nq,Nk) bool, (B,1,1,Nk) bool, (Nq,Nk) additive
    float32 and additive in q's dtype with −inf entries, a strided (non-contiguous) bool one."""
    g = gen(2010)
    b, nq, nk = q.shape[0], q.shape[-2], k.shape[-2]
    padded = torch.rand(b, 1, nq, nk, generator=g) > 0.3
    keys = torch.ones(b, 1, 1, nk, dtype=torch.bool)
    keys[0, ..., nk // 2:] = False
    bias = torch.randn(nq, nk, generator=g).masked_fill(torch.rand(nq, nk, generator=g) > 0.8, float("-inf"))
    strided = (torch.rand(b, 1, nk, nq, generator=g) > 0.5).transpose(-1, -2)
    return {"padded": padded, "keys": keys, "bias f32": bias, "bias q dtype": bias.to(q.dtype), "strided": strided}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_fast_path_takes_masks_and_equals_the_autograd_path(dtype, is_causal):
    """A mask our kernel reads is taken in C++ (sdpa_fast answers), with the bits of the Python path (the same call
    with requires_grad) — GQA included; and the result is torch's within the dtype's tolerance."""
    m = _ext.load()
    q, k, v = qkv(dtype, hq=4, hkv=2, nq=5, nk=40)
    for name, mask in masks(q, k).items():
        assert m.sdpa_fast(q, k, v, mask, is_causal, None, True) is not None, name
        fast = cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        slow = cs149gpt.scaled_dot_product_attention(q.clone().requires_grad_(), k, v, attn_mask=mask,
                                                     is_causal=is_causal, enable_gqa=True)
        assert torch.equal(fast, slow.detach()), name
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask if mask.dtype ==
                                             torch.bool else mask.double(), is_causal=is_causal, enable_gqa=True)
        ref = torch.nan_to_num(ref, nan=0.0)  # rows that see no key: 0 (README), NaN in torch's math path
        assert (fast.double() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2), name


def test_sdpa_fast_path_leaves_masks_it_does_not_read_to_the_wrapper():
    """Masks torch must handle (a gradient wanted, float64, an int dtype, a shape that does not broadcast, one on
    another device type than the queries'): sdpa_fast answers None and the wrapper gives torch's result or error."""
    m = _ext.load()
    q, k, v = qkv(hq=2, hkv=2, nq=5, nk=40)
    bias = torch.randn(5, 40, generator=gen(2011))
    learned = bias.clone().requires_grad_()
    assert m.sdpa_fast(q, k, v, learned, False, None, False) is None
    out = cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=learned)
    out.sum().backward()
    assert learned.grad is not None  # torch's SDPA computed the mask's gradient
    assert m.sdpa_fast(q, k, v, bias.double(), False, None, False) is None
    assert m.sdpa_fast(q, k, v, (bias > 0).int(), False, None, False) is None
    assert m.sdpa_fast(q, k, v, bias[:, :7], False, None, False) is None
    with pytest.raises(RuntimeError):
        cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :7])
    assert m.sdpa_fast(q, k, v, bias.to("meta"), False, None, False) is None
    with torch.no_grad():
        assert m.sdpa_fast(q, k, v, learned, False, None, False) is not None  # no gradient wanted: ours


# --- attention_with_kvcache: module.cpp's kvcache_fast ---
def kvcache_case(paged=False, append=False, lse=False, **kwargs):
    """(positional args, keyword args) of an attention_with_kvcache call: B 2, Hq 4, Hkv 2, Nq 2, d 16."""
    g = gen(2100)
    q = torch.randn(2, 4, 2, 16, generator=g)
    shape = (10, 2, 8, 16) if paged else (2, 2, 40, 16)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    seqlens = torch.tensor([13, 30], dtype=torch.int32)
    if paged:
        kwargs["block_table"] = torch.tensor([[5, 0, 3, 1, 4], [2, 9, 6, 8, 7]], dtype=torch.int32)
    if append:
        kwargs["k_new"], kwargs["v_new"] = (torch.randn(2, 2, 3, 16, generator=g) for _ in range(2))
    if lse:
        kwargs["lse"] = torch.empty(2, 4, 2)
    return [q, k, v, seqlens], kwargs


def op_kwargs(kwargs):
    """The wrapper's keywords as the operator's (window=(l, r) -> window_left, window_right)."""
    kwargs = dict(kwargs)
    window = kwargs.pop("window", None)
    if window is not None:
        kwargs["window_left"], kwargs["window_right"] = window
    return kwargs


@pytest.mark.parametrize("case", [
    dict(), dict(paged=True), dict(append=True), dict(paged=True, append=True, lse=True), dict(lse=True, scale=0.25),
    dict(is_causal=False, window=(5, 0)), dict(softcap=3.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    dict(cache_leftpad=torch.tensor([2, 7], dtype=torch.int32), window=(4, -1)),
    dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32), append=True, softcap=2),
], ids=str)
def test_kvcache_fast_path_equals_the_operator(case):
    """The C++ path writes the same caches and lse and returns the same bits as the operator called through the
    dispatcher (Autograd and ADInplaceOrView included), and bumps the versions of what it writes as that one does;
    both agree with float64 attention over the keys each sequence sees."""
    args, kwargs = kvcache_case(**case)
    twin_args, twin_kwargs = kvcache_case(**case)
    assert _ext.load().kvcache_fast(*(t.clone() for t in args), kwargs.get("k_new"), kwargs.get("v_new"),
                                    kwargs.get("block_table"), kwargs.get("scale"), kwargs.get("is_causal", True),
                                    kwargs.get("cache_batch_idx"), kwargs.get("cache_leftpad"), kwargs.get("window"),
                                    kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"),
                                    None if kwargs.get("lse") is None else kwargs["lse"].clone()) is not None
    written = [args[1], args[2]] + ([kwargs["lse"]] if "lse" in kwargs else [])
    before = [t._version for t in written]
    fast = cs149gpt.attention_with_kvcache(*args, **kwargs)
    bumps = [t._version - b for t, b in zip(written, before)]
    twin_written = [twin_args[1], twin_args[2]] + ([twin_kwargs["lse"]] if "lse" in twin_kwargs else [])
    before = [t._version for t in twin_written]
    slow = torch.ops.cs149gpt.attention_with_kvcache(*twin_args, **op_kwargs(twin_kwargs))
    assert bumps == [t._version - b for t, b in zip(twin_written, before)] and min(bumps) >= 1
    assert torch.equal(fast, slow)
    for a, b in zip(written, twin_written):
        assert torch.equal(a, b)
    if case == dict():  # the plain decode against float64 SDPA over each sequence's cached keys
        q, k, v, seqlens = args
        for b, n in enumerate(seqlens.tolist()):
            ref = F.scaled_dot_product_attention(q[b:b + 1].double(), k[b:b + 1, :, :n].double(),
                                                 v[b:b + 1, :, :n].double(), enable_gqa=True,
                                                 attn_mask=torch.ones(2, n, dtype=torch.bool).tril(n - 2))
            assert (fast[b:b + 1].double() - ref).abs().max() < 1e-5


def test_kvcache_fast_path_leaves_calls_to_the_wrapper():
    """What the wrapper or the operator's other layers must answer: kvcache_fast returns None, and the call raises or
    runs as before (a gradient refused, a tangent refused, a window to word, a tensor subclass's optional)."""
    m = _ext.load()
    args, _ = kvcache_case()
    q, k, v, seqlens = args
    nones = [None] * 3

    def fast(*a, window=None, softcap=0.0, lse=None, is_causal=True, scale=None, k_new=None):
        return m.kvcache_fast(*a, k_new, k_new, *nones[:1], scale, is_causal, None, None, window, softcap, None, lse)

    wanting_grad = q.clone().requires_grad_()
    assert fast(wanting_grad, k, v, seqlens) is None
    with pytest.raises(ValueError, match="q requires grad"):
        cs149gpt.attention_with_kvcache(wanting_grad, k, v, seqlens)
    with torch.no_grad():
        assert fast(wanting_grad, k, v, seqlens) is not None
    assert fast(q, k, v, seqlens, window=[3, 0]) is None  # a list: the wrapper's to take
    assert torch.equal(cs149gpt.attention_with_kvcache(q, k, v, seqlens, window=[3, 0]),
                       cs149gpt.attention_with_kvcache(q, k, v, seqlens, window=(3, 0)))
    for window in ((3,), (3, 0.5), (-2, 0), (True, 0)):
        assert fast(q, k, v, seqlens, window=window) is None
    with pytest.raises(TypeError, match="window must be a pair of ints"):
        cs149gpt.attention_with_kvcache(q, k, v, seqlens, window=(3, 0.5))
    with pytest.raises(ValueError, match="window must be"):
        cs149gpt.attention_with_kvcache(q, k, v, seqlens, window=(-2, 0))
    assert fast(q, k, v, seqlens, is_causal=1) is None and fast(q, k, v, seqlens, softcap=True) is None
    assert fast(q, k, v, seqlens, scale=float("inf")) is None
    with pytest.raises(ValueError, match="scale"):
        cs149gpt.attention_with_kvcache(q, k, v, seqlens, scale=float("inf"))

    class Sub(torch.Tensor):
        pass

    assert fast(q, k, v, seqlens, lse=torch.empty(2, 4, 2).as_subclass(Sub)) is None
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        assert fast(dual, k, v, seqlens) is None
        with pytest.raises(NotImplementedError, match="forward AD"):
            cs149gpt.attention_with_kvcache(dual, k, v, seqlens)


def test_kvcache_fast_path_raises_the_operators_errors():
    """Bad values reach the operator's checks from the C++ path too: the same exception and words."""
    args, kwargs = kvcache_case()
    args[3] = torch.tensor([13, 41], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 41 exceed the cache's capacity of 40"):
        cs149gpt.attention_with_kvcache(*args, **kwargs)
    args, kwargs = kvcache_case(paged=True)
    kwargs["block_table"][1, 2] = 10
    with pytest.raises(IndexError, match=r"block_table\[1, 2\] = 10 is not a block of the cache"):
        cs149gpt.attention_with_kvcache(*args, **kwargs)
