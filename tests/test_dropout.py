"""Dropout in the flash kernels (forward and backward), against float64 references given the same keep mask.

The kernels draw their keep mask from a counter-based generator keyed by (seed, offset) (csrc/attention.h,
dropout_keep); `_ext.load()._testing.dropout_keep_mask(seed, offset, shape, p)` returns that mask, so the tests can build
the reference out = (softmax(scale · q kᵀ + masks) ∘ keep / (1 − p)) v and its float64 gradients. Covered: the drop
rate and the counter/offset layout of the generator, the output and lse given the mask (with attn_mask, causal,
GQA, odd tiles, bf16), the gradients given the mask (the backward regenerates it), the expectation over seeds
(dropout is unbiased), torch.manual_seed reproducing a call, the thread count, opcheck, and the SDPA drop-in.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import cs149gpt
from tests._helpers import (backward_path, f32_products, gen, isa, module, randn, scaled_scores,  # noqa: F401
                            visible_mask)  # (fixtures: isa, f32_products, backward_path)

NEG_INF = float("-inf")
TOL = 1e-4       # float32 out against float64
GRAD_TOL = 5e-5  # float32 gradients against float64 (kept weights are scaled by up to 1 / (1 − p) = 2)


def keep_mask(seed, offset, shape, p):
    return module()._testing.dropout_keep_mask(int(seed), int(offset), list(shape), float(p))


def ref_dropout(q, k, v, keep, p, *, attn_mask=None, is_causal=False, scale=None):
    """(out, lse) in float64 with the given keep mask (B, Hq, Nq, Nk); differentiable in q, k, v."""
    s, v = scaled_scores(q, k, v, scale)
    hidden = torch.zeros(s.shape, dtype=torch.bool)
    if attn_mask is not None:
        hidden |= ~attn_mask
    causal = visible_mask(q.shape[-2], k.shape[-2], is_causal)
    if causal is not None:
        hidden |= ~causal
    seen = (~hidden).any(-1, keepdim=True)
    s = torch.where(seen, s.masked_fill(hidden, NEG_INF), 0.0)
    lse = torch.where(seen[..., 0], torch.logsumexp(s, dim=-1), NEG_INF)
    weights = torch.softmax(s, dim=-1) * seen * keep.double() / (1 - p)
    return weights @ v, lse


def inputs(q_shape, kv_shape, g, dtype=torch.float32):
    return tuple(randn(*s, gen=g).to(dtype) for s in (q_shape, kv_shape, kv_shape, q_shape))


def call(q, k, v, p, seed, offset, **kwargs):
    """The operator with an explicit (seed, offset): (out, lse)."""
    return torch.ops.cs149gpt.flash_attention(q, k, v, kwargs.get("scale"), kwargs.get("causal", "none"),
                                              kwargs.get("block_q"), kwargs.get("block_k"), kwargs.get("attn_mask"),
                                              -1, -1, p, torch.tensor([seed, offset], dtype=torch.int64))


def test_keep_mask_rate_and_counter_layout():
    """About 1 − p of the entries are kept (within 5 standard deviations), different seeds give different masks,
    and the offset shifts the counter: element c of (seed, offset + 1) is element c + 1 of (seed, offset)."""
    shape = (2, 3, 128, 96)
    n = math.prod(shape)
    for p in (0.1, 0.5, 0.9):
        kept = keep_mask(12345, 0, shape, p).double().mean().item()
        assert abs(kept - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n), (p, kept)
    a, b = keep_mask(1, 0, shape, 0.5), keep_mask(2, 0, shape, 0.5)
    assert 0.4 < (a != b).double().mean().item() < 0.6
    shifted = keep_mask(1, 1, shape, 0.5).flatten()
    assert torch.equal(shifted[:-1], a.flatten()[1:])
    assert keep_mask(7, -5, (1, 1, 2, 3), 0.0).all()  # p = 0 keeps everything


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_given_the_mask(isa, f32_products, dtype):
    """out = (P ∘ keep / (1 − p)) V and lse of the undropped P, with attn_mask, both causal modes, GQA, odd tiles."""
    g = gen(1200)
    failures = []
    q, k, v, _ = inputs((2, 4, 37, 16), (2, 2, 45, 16), g, dtype)
    pad = torch.rand(2, 1, 37, 45, generator=g) < 0.8
    for p in (0.1, 0.5):
        for attn_mask, is_causal in ((None, False), (None, "bottom_right"), (pad, False), (pad, "top_left")):
            for block_q, block_k in ((None, None), (7, 5)):
                seed, offset = 1000 + int(p * 10), 77
                out, lse = call(q, k, v, p, seed, offset, attn_mask=attn_mask, causal=is_causal if is_causal else
                                "none", block_q=block_q, block_k=block_k)
                keep = keep_mask(seed, offset, (2, 4, 37, 45), p)
                want, want_lse = ref_dropout(q.double(), k.double(), v.double(), keep, p, attn_mask=attn_mask,
                                             is_causal=is_causal)
                err = (out.double() - want).abs().max().item()
                bar = TOL if dtype == torch.float32 else 2.0**-7 * (want.abs().max().item() + 1)
                tag = f"{isa} {dtype} p={p} mask={attn_mask is not None} causal={is_causal} ({block_q}, {block_k})"
                if not err <= bar:
                    failures.append(f"{tag}: out error {err:.3g} > {bar:.3g}")
                live = torch.isfinite(want_lse)
                if not torch.equal(torch.isneginf(lse), ~live):
                    failures.append(f"{tag}: lse -inf rows differ")
                elif (lse.double() - want_lse)[live].abs().max().item() > 1e-4:
                    failures.append(f"{tag}: lse is not that of the undropped weights")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_given_the_mask(isa, backward_path, dtype):
    """attention(dropout_p=...) under autograd: dq, dk, dv against float64 autograd of the reference with the keep
    mask the call drew (from torch's generator, reproduced by torch.manual_seed): the backward regenerates it, on
    every backward path (bf16: the one-pass kernel's transposed tiles draw Z a key row at a time). float32 to
    GRAD_TOL; bf16 to two roundings of its 8 bits, norm-relative (test_backward's bar)."""
    g = gen(1201)
    failures = []
    padding = torch.ones(2, 1, 1, 41, dtype=torch.bool)
    padding[0, ..., 30:] = False
    padding[1, ..., :6] = False
    scattered = torch.rand(2, 1, 29, 41, generator=g) < 0.7  # rows of several runs: the kernels read it
    for q_shape, kv_shape, kwargs in [((2, 4, 29, 16), (2, 2, 41, 16), {}),
                                      ((1, 3, 40, 8), (1, 3, 40, 8), {"is_causal": True, "block_q": 7, "block_k": 9}),
                                      ((2, 2, 33, 16), (2, 2, 33, 16), {"window": (5, 3)}),
                                      ((2, 4, 29, 16), (2, 2, 41, 16), {"attn_mask": padding}),
                                      ((2, 4, 29, 16), (2, 2, 41, 16), {"attn_mask": scattered})]:
        q, k, v, dout = (t.to(dtype) for t in inputs(q_shape, kv_shape, g))
        for p in (0.2, 0.6):
            torch.manual_seed(31)
            seed, offset = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64).tolist()
            torch.manual_seed(31)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = cs149gpt.attention(*leaves, dropout_p=p, **kwargs)
            out.backward(dout)
            keep = keep_mask(seed, offset, (*q_shape[:-1], kv_shape[-2]), p)
            ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
            window_keep = None
            if "window" in kwargs:
                left, right = kwargs["window"]
                i, j = torch.arange(q_shape[-2])[:, None], torch.arange(kv_shape[-2])[None, :]
                window_keep = (j >= i - left) & (j <= i + right)
            if "attn_mask" in kwargs:
                window_keep = kwargs["attn_mask"]
            want, _ = ref_dropout(*ref_leaves, keep, p, attn_mask=window_keep, is_causal=kwargs.get("is_causal", False))
            want.backward(dout.double())
            tag = f"{isa} {dtype} {q_shape} {list(kwargs)} p={p}"
            for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.detach(), *(t.grad for t in leaves)),
                                      (want.detach(), *(t.grad for t in ref_leaves))):
                if dtype == torch.float32:
                    err = (got.double() - ref).abs().max().item()
                    if not err <= (TOL if name == "out" else GRAD_TOL):
                        failures.append(f"{tag} {name}: {err:.3g}")
                else:
                    rel = ((got.double() - ref).norm() / ref.norm()).item()
                    if not rel <= 2 * 2.0**-8:
                        failures.append(f"{tag} {name}: norm-relative error {rel:.3g}")
    assert not failures, "\n".join(failures)


def test_expectation_over_seeds_is_the_undropped_attention():
    """Dropout is unbiased: the mean of out over many seeds approaches attention without dropout (within 5
    standard errors of the mean, per element)."""
    g = gen(1202)
    q, k, v, _ = inputs((1, 2, 6, 8), (1, 2, 10, 8), g)
    p, n = 0.3, 400
    outs = torch.stack([call(q, k, v, p, seed, 0)[0] for seed in range(n)]).double()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    sem = outs.std(0) / math.sqrt(n)
    assert ((outs.mean(0) - want).abs() <= 5 * sem + 1e-6).all()
    assert (outs.std(0) > 0).all()  # and it does drop


def test_manual_seed_reproduces_a_call(restore_threads):
    g = gen(1203)
    q, k, v, _ = inputs((2, 4, 50, 16), (2, 4, 50, 16), g)
    results = []
    for seed, threads in ((5, 1), (5, 3), (6, 3)):
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        results.append(cs149gpt.attention(q, k, v, dropout_p=0.25))
    assert torch.equal(results[0], results[1])  # same seed, any thread count: the same bits
    assert not torch.equal(results[1], results[2])
    torch.manual_seed(5)
    again = cs149gpt.attention(q, k, v, dropout_p=0.25)
    assert torch.equal(again, results[0])
    assert not torch.equal(cs149gpt.attention(q, k, v, dropout_p=0.25), again)  # the generator moved on


def test_opcheck_with_dropout():
    g = gen(1204)
    q, k, v, dout = inputs((2, 4, 9, 8), (2, 2, 11, 8), g)
    seed = torch.tensor([3, 4], dtype=torch.int64)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, "none", None, None, None, -1, -1, 0.3,
            seed)
    torch.library.opcheck(torch.ops.cs149gpt.flash_attention, args)
    out, lse = torch.ops.cs149gpt.flash_attention(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    torch.library.opcheck(torch.ops.cs149gpt.flash_attention_backward,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, None, "none", None, None, None, -1, -1,
                           0.3, seed))


def test_bad_dropout_arguments():
    g = gen(1205)
    q, k, v, _ = inputs((1, 2, 5, 8), (1, 2, 5, 8), g)
    for bad in (-0.1, 1.0, float("nan"), "0.1"):
        with pytest.raises(ValueError, match="dropout_p must be"):
            cs149gpt.attention(q, k, v, dropout_p=bad)
    with pytest.raises(ValueError, match="dropout_p needs impl='flash'"):
        cs149gpt.attention(q, k, v, impl="fused", dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        torch.ops.cs149gpt.flash_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_seed must be an int64 tensor of 2 elements"):
        torch.ops.cs149gpt.flash_attention(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(3, dtype=torch.int64))


def test_sdpa_dropout_is_ours_and_unbiased():
    """cs149gpt.scaled_dot_product_attention with dropout_p runs ours (training: GPT-2, BERT, nanoGPT pass it),
    reproducibly under torch.manual_seed, with gradients; p = 1 (torch's answer) stays torch's."""
    g = gen(1206)
    q, k, v, dout = inputs((2, 4, 20, 16), (2, 2, 25, 16), g)
    kwargs = dict(dropout_p=0.1, enable_gqa=True, is_causal=True)
    assert cs149gpt.uses_our_kernel(q, k, v, **kwargs)
    torch.manual_seed(0)
    a = cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.manual_seed(0)
    b = cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(a, b)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cs149gpt.scaled_dot_product_attention(*leaves, **kwargs).backward(dout)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert not cs149gpt.uses_our_kernel(q, k, v, dropout_p=1.0)
    torch.manual_seed(1)
    theirs = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0, enable_gqa=True)
    torch.manual_seed(1)
    ours = cs149gpt.scaled_dot_product_attention(q, k, v, dropout_p=1.0, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_compile_with_dropout():
    """torch.compile(fullgraph=True) with dropout: the (seed, offset) draw is part of the graph, so each run draws
    afresh — the same bits under the same torch.manual_seed, others under another — and the backward runs."""
    torch._dynamo.reset()
    g = gen(1207)
    q, k, v, dout = inputs((2, 4, 33, 16), (2, 4, 33, 16), g)
    f = torch.compile(lambda q, k, v: cs149gpt.attention(q, k, v, dropout_p=0.2, is_causal=True), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(0)
    first = f(*leaves)
    first.backward(dout)
    torch.manual_seed(0)
    again = f(q, k, v)
    torch.manual_seed(1)
    other = f(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(first.detach(), again) and not torch.equal(again, other)
    assert all(torch.isfinite(t.grad).all() for t in leaves)


class NanoGPTAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention (karpathy/nanoGPT model.py), as written there: it calls
    torch.nn.functional.scaled_dot_product_attention with dropout_p while training."""

    def __init__(self, n_embd=32, n_head=4, dropout=0.2):
        super().__init__()
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = torch.nn.Linear(n_embd, n_embd)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_nanogpt_training_with_dropout_runs_ours():
    """nanoGPT-style training (dropout 0.2) with ours installed as torch's SDPA: every attention call, forward
    and backward, is ours (torch.profiler), reproducible under torch.manual_seed; eval mode is exactly torch's."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(NanoGPTAttention(), NanoGPTAttention())
    x = torch.randn(2, 24, 32, generator=gen(1208))

    def step(seed):
        model.zero_grad()
        torch.manual_seed(seed)
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    with cs149gpt.sdpa_installed():
        model.train()
        with profile() as prof:
            loss, grads = step(3)
        names = [e.name for e in prof.events()]
        again, grads_again = step(3)
        model.eval()
        with torch.no_grad():
            ours_eval = model(x)
    assert names.count("cs149gpt::flash_attention") == 2 and names.count("cs149gpt::flash_attention_backward") == 2
    assert not any(n.startswith("aten::_scaled_dot_product") or n == "aten::scaled_dot_product_attention"
                   for n in names)
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    with torch.no_grad():
        theirs_eval = model(x)  # torch's SDPA again, outside the scope
    assert (ours_eval - theirs_eval).abs().max().item() <= 1e-5
