"""The CUDA kernels (csrc/cuda/) behind the same operators: forward, lse, backward, GQA, masks, strides, errors,
opcheck and torch.compile. Skipped where torch sees no GPU.

References are float64 on the GPU, from the definition. For bfloat16/float16 the bar is torch's own SDPA in the
same dtype: our error against float64 may be at most a small multiple of SDPA's (both round P and the
inputs to 16 bits), and under an absolute cap.
"""
import math

import pytest
import torch

import cs149gpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here")

CUDA = "cuda"
FAST_DTYPES = (torch.bfloat16, torch.float16)
CAUSAL = (False, "top_left", "bottom_right")
# (B, Hq, Hkv, Nq, Nk): square, ragged (not tile multiples), Nq < Nk, Nq > Nk, one query row, GQA, MQA, past 2048
# keys (d 128's wider key tiles on Hopper: Bc 192 at 2100 keys, 160 at 3000)
SHAPES = [
    (2, 3, 3, 128, 128),
    (1, 2, 2, 200, 333),
    (1, 2, 2, 333, 200),
    (2, 2, 2, 1, 77),
    (1, 8, 2, 257, 190),
    (2, 4, 1, 64, 1000),
    (1, 2, 2, 200, 2100),
    (1, 2, 2, 200, 3000),
]


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def kernels_run(fn):
    """Names of the CUDA kernels fn() launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def poison_allocator():
    """Fills memory the caching allocator will hand out next with NaN: a kernel that leaves part of its
    output unwritten then fails the finiteness checks."""
    x = torch.full((64 << 20,), float("nan"), device=CUDA)
    del x


def visible(n_q, n_k, causal, device):
    if causal is False:
        return None
    offset = 0 if causal in (True, "top_left") else n_k - n_q
    return torch.arange(n_k, device=device)[None, :] <= torch.arange(n_q, device=device)[:, None] + offset


def reference(q, k, v, scale=None, causal=False):
    """(out, lse) in float64: softmax(scale q kᵀ, masked) v; a row that sees no key gets 0 and lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    mask = visible(q.shape[-2], k.shape[-2], causal, q.device)
    if mask is None:
        return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)
    seen = mask.any(-1)[:, None]  # rows that see some key; the others: out 0, lse -inf, no gradient (no NaN)
    s = s.masked_fill(~mask & seen, float("-inf")).masked_fill(~seen, 0.0)
    out = (torch.softmax(s, dim=-1) @ v) * seen
    return out, torch.logsumexp(s, dim=-1).masked_fill(~seen[:, 0], float("-inf"))


def sdpa(q, k, v, causal):
    """torch's SDPA in q's dtype, with our mask conventions (bottom_right through an explicit mask)."""
    if k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    mask = visible(q.shape[-2], k.shape[-2], causal, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if mask is not None:
        out = out.masked_fill(~mask.any(-1)[:, None], 0.0)  # rows that see nothing: 0, as ours
    return out


def rand(shape, dtype, seed):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(shape, generator=g, device=CUDA, dtype=torch.float32).to(dtype)


def make_qkv(B, Hq, Hkv, Nq, Nk, d, dtype, seed=0):
    return (rand((B, Hq, Nq, d), dtype, seed), rand((B, Hkv, Nk, d), dtype, seed + 1),
            rand((B, Hkv, Nk, d), dtype, seed + 2))


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check_close_to_sdpa(ours, q, k, v, causal, what):
    """ours (in q's dtype) against float64, with torch SDPA's own error in q's dtype as the yardstick."""
    ref, _ = reference(q, k, v, causal=causal)
    assert ours.dtype == q.dtype and ours.shape == ref.shape, what
    assert torch.isfinite(ours).all(), f"{what}: non-finite output"
    ours_err, sdpa_err = max_err(ours, ref), max_err(sdpa(q, k, v, causal), ref)
    cap = 3e-2 if q.dtype == torch.bfloat16 else 4e-3
    assert ours_err <= max(2 * sdpa_err, cap / 4) and ours_err <= cap, \
        f"{what}: max abs error {ours_err:.3g} vs SDPA's {sdpa_err:.3g} (cap {cap})"


# ---------------------------------------------------------------------------------------------------------
# forward: FlashAttention-2 (bf16/f16) and the teaching kernel (f32)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_forward_and_lse(dtype, d, causal, shape, forward_path):
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, d, dtype, seed=Nq + Nk + d)
    poison_allocator()
    out, lse = cs149gpt.attention(q, k, v, is_causal=causal, return_lse=True)
    check_close_to_sdpa(out, q, k, v, causal, f"{dtype} d={d} causal={causal} {shape}")
    _, ref_lse = reference(q, k, v, causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Nq)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where a row sees no key"
    assert (lse[~finite] == float("-inf")).all()
    assert max_err(lse[finite], ref_lse[finite]) < 1e-3 if finite.any() else True


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", [(4, 8, 2, 1024, 1024), (8, 8, 8, 1000, 300), (4, 8, 4, 600, 2100),
                                   (2, 8, 2, 600, 3000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_with_more_query_tiles_than_sms(d, causal, shape, forward_path):
    """Several query tiles a block where a grid is persistent (one block an SM walking the tiles), tiles whose rows
    see no key among them (Nq > Nk, bottom-right), and past 2048 keys (d 128's wider key tiles when not causal,
    Bc 192 and 160): out and lse against float64."""
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, d, torch.bfloat16, seed=d + Nq)
    poison_allocator()
    out, lse = cs149gpt.attention(q, k, v, is_causal=causal, return_lse=True)
    check_close_to_sdpa(out, q, k, v, causal, f"d={d} causal={causal} {shape}")
    _, ref_lse = reference(q, k, v, causal=causal)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse is -inf exactly where a row sees no key"
    assert max_err(lse[finite], ref_lse[finite]) < 1e-3


@pytest.mark.skipif(not HOPPER, reason="not a Hopper GPU")
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_kernel_is_the_one_that_runs(d, monkeypatch):
    """On sm_90 the bf16/fp16 forward and backward of head dim 64/128 run the Hopper kernels (profiler count); with
    CS149GPT_HOPPER=0, FlashAttention-2's."""
    q, k, v = make_qkv(2, 4, 2, 300, 300, d, torch.bfloat16)
    names = kernels_run(lambda: cs149gpt.attention(q, k, v, is_causal=True))
    assert sum("flash_fwd_hopper" in n for n in names) == 1, names
    qg = q.clone().requires_grad_()
    names = kernels_run(lambda: cs149gpt.attention(qg, k, v, is_causal=True).sum().backward())
    assert sum("flash_bwd_hopper" in n for n in names) == 1, names
    monkeypatch.setenv("CS149GPT_HOPPER", "0")
    assert not any("hopper" in n for n in kernels_run(lambda: cs149gpt.attention(q, k, v))), "CS149GPT_HOPPER=0"


@pytest.mark.parametrize("dtype", FAST_DTYPES + (torch.float32,), ids=str)
def test_nonfinite_rows(dtype, forward_path):
    """README's rule on CUDA too: a NaN or +inf among a row's visible logits makes its output row and lse NaN; the
    other rows are untouched; a row that sees no key gets 0 and lse -inf (float32: the teaching kernel)."""
    q, k, v = make_qkv(1, 2, 2, 70, 90, 64, dtype, seed=5)
    q[0, 0, 3, 0], q[0, 1, 10, 5] = float("nan"), float("inf")
    out, lse = cs149gpt.attention(q, k, v, is_causal=True, return_lse=True)
    bad = torch.zeros(2, 70, dtype=torch.bool, device=CUDA)
    bad[0, 3] = bad[1, 10] = True
    assert out[0][bad].isnan().all() and lse[0][bad].isnan().all()
    good = ~bad
    assert out[0][good].isfinite().all() and lse[0][good].isfinite().all()
    ref, ref_lse = reference(q, k, v, causal=True)
    assert max_err(out[0][good], ref[0][good]) < (3e-2 if dtype != torch.float32 else 1e-5)
    assert max_err(lse[0][good], ref_lse[0][good]) < 1e-3


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_fast_forward_strided_views(dtype, causal, forward_path):
    """The GPT's views x.view(B, T, H, d).transpose(1, 2), read in place; and an unaligned view (copied)."""
    B, T, H, d = 2, 300, 4, 64
    qkv = rand((B, T, 3 * H * d), dtype, 7)
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in qkv.split(H * d, dim=-1))
    assert not q.is_contiguous()
    check_close_to_sdpa(cs149gpt.attention(q, k, v, is_causal=causal), q, k, v, causal, "transposed views")
    wide = rand((B, H, T, d + 1), dtype, 8)
    qo, ko, vo = wide[..., 1:], wide.flip(2)[..., 1:], wide[..., :d]  # misaligned base / negative-free slices
    check_close_to_sdpa(cs149gpt.attention(qo, ko, vo, is_causal=causal), qo, ko, vo, causal, "unaligned views")


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
def test_fast_forward_shapes_2d_3d_5d_and_scale(dtype, forward_path):
    for shape in [(100, 64), (3, 100, 64), (2, 2, 3, 100, 64)]:
        q, k, v = (rand(shape, dtype, i) for i in range(3))
        out = cs149gpt.attention(q, k, v, scale=0.3)
        ref = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 0.3, -1) @ v.double()
        assert out.shape == q.shape and max_err(out, ref) < (3e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("d", [16, 64, 100, 128])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES[:5], ids=lambda s: "x".join(map(str, s)))
def test_teaching_forward_float32(d, causal, shape):
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, d, torch.float32, seed=d)
    poison_allocator()
    out, lse = cs149gpt.attention(q, k, v, is_causal=causal, return_lse=True)
    ref, ref_lse = reference(q, k, v, causal=causal)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert max_err(out, ref) < 1e-4
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert max_err(lse[finite], ref_lse[finite]) < 1e-4


@pytest.mark.parametrize("block_q,block_k", [(1, 1), (7, 13), (128, 64), (1024, 5)])
def test_teaching_tiles(block_q, block_k):
    q, k, v = make_qkv(1, 2, 2, 150, 170, 32, torch.float32, seed=3)
    out = cs149gpt.attention(q, k, v, is_causal=True, block_q=block_q, block_k=block_k)
    assert max_err(out, reference(q, k, v, causal=True)[0]) < 1e-4


# ---------------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------------
def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", FAST_DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fast_backward(dtype, d, causal, shape, forward_path):
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, d, dtype, seed=3 * Nq + Nk + d)
    dout = rand((B, Hq, Nq, d), dtype, 99)
    poison_allocator()
    _, dq, dk, dv = grads(lambda a, b, c: cs149gpt.attention(a, b, c, is_causal=causal), q, k, v, dout)
    _, rq, rk, rv = grads(lambda a, b, c: reference(a, b, c, causal=causal)[0], q.double(), k.double(), v.double(),
                          dout.double())
    _, sq, sk, sv = grads(lambda a, b, c: sdpa(a, b, c, causal), q, k, v, dout)
    # One yardstick for the three gradients: the largest of them (dq alone can be ~0, e.g. a row that sees one key).
    scale = max(g.abs().max().item() for g in (rq, rk, rv)) + 1e-6
    for name, ours, ref, theirs in (("dq", dq, rq, sq), ("dk", dk, rk, sk), ("dv", dv, rv, sv)):
        theirs = theirs.nan_to_num(0.0)  # SDPA's rows that see no key
        assert ours.dtype == dtype and ours.shape == ref.shape, name
        assert torch.isfinite(ours).all(), f"{name}: non-finite"
        e_ours, e_sdpa = max_err(ours, ref) / scale, max_err(theirs, ref) / scale
        cap = 4e-2 if dtype == torch.bfloat16 else 1e-2
        assert e_ours <= max(2 * e_sdpa, cap / 4) and e_ours <= cap, \
            f"{name}: relative max error {e_ours:.3g} vs SDPA's {e_sdpa:.3g}"


# The tile configurations `benchmarks/bench.py cuda --configs` sweeps (csrc/cuda/flash_launch.cuh: kFwdConfigs,
# kBwdConfigs), each chosen by CS149GPT_FWD_CONFIG / CS149GPT_BWD_CONFIG, on ragged GQA shapes (no tile multiple).
FWD_CONFIGS, BWD_CONFIGS = 7, 4


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("config", range(max(FWD_CONFIGS, BWD_CONFIGS)))
def test_every_tile_configuration(d, causal, config, monkeypatch):
    monkeypatch.setenv("CS149GPT_HOPPER", "0")  # the FlashAttention-2 kernel's configurations
    dtype = torch.bfloat16
    B, Hq, Hkv, Nq, Nk = 1, 4, 2, 333, 290
    q, k, v = make_qkv(B, Hq, Hkv, Nq, Nk, d, dtype, seed=config + d)
    dout = rand((B, Hq, Nq, d), dtype, 98)
    if config < FWD_CONFIGS:
        monkeypatch.setenv("CS149GPT_FWD_CONFIG", str(config))
        check_close_to_sdpa(cs149gpt.attention(q, k, v, is_causal=causal), q, k, v, causal, f"forward config {config}")
    monkeypatch.delenv("CS149GPT_FWD_CONFIG", raising=False)
    if config < BWD_CONFIGS:
        monkeypatch.setenv("CS149GPT_BWD_CONFIG", str(config))
        _, dq, dk, dv = grads(lambda a, b, c: cs149gpt.attention(a, b, c, is_causal=causal), q, k, v, dout)
        _, rq, rk, rv = grads(lambda a, b, c: reference(a, b, c, causal=causal)[0], q.double(), k.double(),
                              v.double(), dout.double())
        scale = max(g.abs().max().item() for g in (rq, rk, rv))
        for name, ours, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            assert max_err(ours, ref) / scale < 2e-2, f"backward config {config}: {name}"


@pytest.mark.parametrize("causal", [False, "top_left"])
def test_backward_gqa_one_block_per_kv_head(causal, monkeypatch):
    """CS149GPT_BWD_GQA_SPLIT=0: each block sums its kv head's group inside (the default: one block per query head,
    the group's shares summed afterwards). Both must give the same gradients, to rounding."""
    dtype, d = torch.bfloat16, 128
    q, k, v = make_qkv(2, 6, 2, 200, 260, d, dtype, seed=11)
    dout = rand((2, 6, 200, d), dtype, 12)
    fn = lambda a, b, c: cs149gpt.attention(a, b, c, is_causal=causal)  # noqa: E731
    split = grads(fn, q, k, v, dout)[1:]
    monkeypatch.setenv("CS149GPT_BWD_GQA_SPLIT", "0")
    whole = grads(fn, q, k, v, dout)[1:]
    _, rq, rk, rv = grads(lambda a, b, c: reference(a, b, c, causal=causal)[0], q.double(), k.double(), v.double(),
                          dout.double())
    scale = max(g.abs().max().item() for g in (rq, rk, rv))
    for name, a, b, ref in zip(("dq", "dk", "dv"), split, whole, (rq, rk, rv)):
        assert max_err(a, ref) / scale < 2e-2 and max_err(b, ref) / scale < 2e-2, name
        assert max_err(a, b) / scale < 1e-2, f"{name}: split and whole differ"


def test_a_configuration_past_the_last_is_an_error(monkeypatch):
    monkeypatch.setenv("CS149GPT_HOPPER", "0")
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, torch.bfloat16)
    monkeypatch.setenv("CS149GPT_FWD_CONFIG", str(FWD_CONFIGS))
    with pytest.raises(RuntimeError, match="flash forward"):
        cs149gpt.attention(q, k, v)
    monkeypatch.setenv("CS149GPT_FWD_CONFIG", "0")
    monkeypatch.setenv("CS149GPT_BWD_CONFIG", str(BWD_CONFIGS))
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="flash backward"):
        cs149gpt.attention(q, k, v).sum().backward()


def test_backward_float32_is_a_clear_error():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 1, 16, 16, 32, torch.float32))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        cs149gpt.attention(q, k, v).sum().backward()


# ---------------------------------------------------------------------------------------------------------
# the operators: opcheck, torch.compile, errors
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_opcheck(dtype):
    ops = torch.ops.cs149gpt
    q, k, v = make_qkv(1, 4, 2, 40, 50, 64, dtype)
    torch.library.opcheck(ops.attention.default, (q, k, v, "flash", None, "top_left", None, None))
    torch.library.opcheck(ops.flash_attention.default, (q, k, v, None, "bottom_right", None, None))
    if dtype != torch.float32:
        out, lse = ops.flash_attention(q, k, v, None, "none", None, None)
        torch.library.opcheck(ops.flash_attention_backward.default,
                              (torch.randn_like(out), q, k, v, out, lse, None, "none", None, None))


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 256, 256, 64, torch.bfloat16))
    w = rand((2, 4, 256, 64), torch.bfloat16, 5)

    def fn(q, k, v):
        return (cs149gpt.attention(q, k, v, is_causal=True) * w).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        loss = f(q, k, v)
        results.append((loss.detach(), torch.autograd.grad(loss, (q, k, v))))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_only_arguments_refused_alike_in_eager_fake_and_compile():
    """What runs on the CPU only (attn_mask, window, dropout in float32, other rungs, bf16 head dims but 64/128, the
    float32 backward) is refused by the one shared check: the same error in eager mode and in FakeTensorMode, so
    torch.compile refuses it while tracing, before any kernel is launched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, torch.bfloat16)
    mask = torch.ones(16, 16, dtype=torch.bool, device=q.device)
    d96 = make_qkv(1, 2, 2, 16, 16, 96, torch.bfloat16)
    f32 = [t.float().requires_grad_() for t in (q, k, v)]
    f32_plain = [t.float() for t in (q, k, v)]
    cases = [
        (lambda q, k, v, m: cs149gpt.attention(q, k, v, attn_mask=m), (*f32_plain, mask), NotImplementedError,
         "attn_mask on CUDA needs bfloat16 or float16"),
        (lambda q, k, v: cs149gpt.attention(q, k, v, window=(4, 0)), f32_plain, NotImplementedError,
         "window on CUDA needs bfloat16 or float16"),
        (lambda q, k, v: cs149gpt.attention(q, k, v, dropout_p=0.1), f32_plain, NotImplementedError,
         "dropout_p on CUDA needs bfloat16 or float16"),
        (lambda q, k, v: cs149gpt.attention(q, k, v, impl="flash_teaching"), [t.float() for t in (q, k, v)],
         ValueError, "runs on the CPU only"),
        (lambda q, k, v: cs149gpt.attention(q, k, v), d96, ValueError, "d = 64 or 128"),
        (lambda q, k, v: cs149gpt.attention(q, k, v).sum().backward(), f32, TypeError, "CUDA flash backward"),
    ]
    for fn, args, error, match in cases:
        with pytest.raises(error, match=match):
            fn(*args)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) for t in args]
            with pytest.raises(error, match=match):
                fn(*fake)


def test_errors():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 96, torch.bfloat16)
    with pytest.raises(ValueError, match="d = 64 or 128"):
        cs149gpt.attention(q, k, v)
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, torch.float32)
    with pytest.raises(ValueError, match="CPU only"):
        cs149gpt.attention(q, k, v, impl="naive")
    with pytest.raises(ValueError, match="device"):
        cs149gpt.attention(q, k.cpu(), v)
    with pytest.raises(TypeError, match="one dtype"):
        cs149gpt.attention(q, k.half(), v)
    q, k, v = make_qkv(1, 1, 1, 2048, 2048, 64, torch.float32)
    with pytest.raises(ValueError, match="shared memory"):
        cs149gpt.attention(q, k, v, block_q=1024, block_k=1024)
