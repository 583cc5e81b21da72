"""torch's SDPA contract, kept by the installed drop-in (cs149gpt.install_sdpa()): a slice of what torch documents
for torch.nn.functional.scaled_dot_product_attention, run with ours in its place.

Covered: CausalBias masks (causal_upper_left / causal_lower_right, Nq below, above and equal to Nk) forward, gradients
and under torch.compile, on our kernel, and is_causal=True beside one (CausalBias's ValueError); every
torch.nn.attention.sdpa_kernel backend list (ours is FLASH_ATTENTION: a list without it gets torch's results and
errors), in eager mode and inside a compiled function; torch.jit.script of nn.MultiheadAttention,
nn.TransformerEncoderLayer and nn.TransformerEncoder in a fresh interpreter (on our kernel, gradients, a save/load
round trip); torch.compile of the same three modules; torch.autocast (bfloat16 and float16) through every entry
point: the output in autocast's dtype as torch's, mixed input dtypes, gradients, compiled.

Values are checked against a float64 reference written from the definition; which kernel ran, by torch.profiler.
"""
import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.profiler import profile

import cs149gpt

ROOT = Path(__file__).resolve().parent.parent
OURS = ("cs149gpt::flash_attention", "cs149gpt::attention")
TORCH_SDPA = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")
TOL = 1e-5  # float32 against float64
GRAD_TOL = 2e-5
# bf16/fp16 outputs against float64 on the same (rounded) inputs: a few roundings of the output's dtype.
LOW_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def installed():
    with cs149gpt.sdpa_installed():
        yield


@contextlib.contextmanager
def torchs_own():
    """torch's own SDPA in torch.nn.functional inside (the reference of a module's call), ours again after."""
    previous = F.scaled_dot_product_attention
    cs149gpt.restore_sdpa()
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous


def kernel_calls(fn):
    """(fn(), calls of our kernel, calls of torch's SDPA kernels): operator events not nested in one of the same
    family (an autocast rule calls the operator again below itself)."""
    with profile() as prof:
        result = fn()
    ours = theirs = 0
    for e in prof.events():
        parent = e.cpu_parent.name if e.cpu_parent is not None else None
        ours += e.name in OURS and parent not in OURS
        theirs += e.name in TORCH_SDPA and parent not in TORCH_SDPA
    return result, ours, theirs


def reference(q, k, v, visible=None, scale=None):
    """softmax(scale · q kᵀ, keys outside `visible` (Nq, Nk) hidden) v in float64; a row that sees no key gives 0
    (torch's answer on the CPU). GQA on dim -3."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[-3] != q.shape[-3]:
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def causal_visible(n_q, n_k, lower_right):
    return torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q if lower_right else 0)


def qkv(n_q, n_k, *, b=2, h=3, d=16, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g).to(dtype)
    k, v = (torch.randn(b, h, n_k, d, generator=g).to(dtype) for _ in range(2))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


# ---------------------------------------------------------------------------------------------------------
# CausalBias
# ---------------------------------------------------------------------------------------------------------
BIASES = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}
SIZES = [(5, 9), (9, 5), (7, 7)]


def make_bias(kind, n_q, n_k):
    with warnings.catch_warnings():  # lower-right with Nq > Nk: torch warns that rows see no key (0 here)
        warnings.simplefilter("ignore")
        return BIASES[kind](n_q, n_k)


@pytest.mark.parametrize("n_q,n_k", SIZES)
@pytest.mark.parametrize("kind", list(BIASES))
def test_causal_bias_forward_and_gradients_on_our_kernel(kind, n_q, n_k):
    q, k, v = qkv(n_q, n_k, requires_grad=True)
    bias = make_bias(kind, n_q, n_k)
    assert cs149gpt.uses_our_kernel(q, k, v, bias)
    out, ours, theirs = kernel_calls(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    assert (ours, theirs) == (1, 0)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, visible=causal_visible(n_q, n_k, kind == "lower_right"))
    assert (out.double() - want).abs().max().item() <= TOL
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(want, leaves, dout.double())
    for name, a, b in zip("qkv", got, expected):
        assert (a.double() - b).abs().max().item() <= GRAD_TOL, name


@pytest.mark.parametrize("kind", list(BIASES))
def test_causal_bias_with_is_causal_raises_causal_bias_error(kind):
    q, k, v = qkv(5, 9)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=make_bias(kind, 5, 9), is_causal=True)
    assert not cs149gpt.uses_our_kernel(q, k, v, make_bias(kind, 5, 9), is_causal=True)


@pytest.mark.parametrize("kind", list(BIASES))
def test_causal_bias_compiled(kind):
    q, k, v = qkv(5, 9, requires_grad=True)
    bias = make_bias(kind, 5, 9)
    compiled = torch.compile(lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                             fullgraph=True, backend="aot_eager")
    compiled(q, k, v, bias)  # traced here
    out, ours, theirs = kernel_calls(lambda: compiled(q, k, v, bias))
    assert (ours, theirs) == (1, 0)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, visible=causal_visible(5, 9, kind == "lower_right"))
    assert (out.double() - want).abs().max().item() <= TOL
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(got, torch.autograd.grad(want.sum(), leaves)):
        assert (a.double() - b).abs().max().item() <= GRAD_TOL


@pytest.mark.parametrize("kind", list(BIASES))
def test_causal_bias_calls_ours_does_not_take_are_torchs(kind):
    """float64 (not ours), and a bias of other sizes than the inputs' (torch reads an upper-left one as is_causal
    whatever its sizes, and broadcasts the mask a lower-right one stands for): torch's values, never the bias
    object's storage read as a mask."""
    q, k, v = qkv(5, 9, dtype=torch.float64)
    bias = make_bias(kind, 5, 9)
    assert not cs149gpt.uses_our_kernel(q, k, v, bias)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert (out - reference(q, k, v, visible=causal_visible(5, 9, kind == "lower_right"))).abs().max() <= 1e-12
    q, k, v = qkv(5, 9)
    one_row = make_bias(kind, 1, 9)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=one_row)
    # lower-right: its one row (every key) broadcast over the 5 query rows; upper-left: is_causal on (5, 9)
    visible = causal_visible(1, 9, True).expand(5, 9) if kind == "lower_right" else causal_visible(5, 9, False)
    assert (out.double() - reference(q, k, v, visible=visible)).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------------------
# sdpa_kernel: ours is the FLASH_ATTENTION backend
# ---------------------------------------------------------------------------------------------------------
B = SDPBackend
BACKEND_LISTS = [[B.MATH], [B.FLASH_ATTENTION], [B.EFFICIENT_ATTENTION], [B.CUDNN_ATTENTION], [B.OVERRIDEABLE],
                 [B.MATH, B.FLASH_ATTENTION], [B.MATH, B.EFFICIENT_ATTENTION], [B.EFFICIENT_ATTENTION, B.FLASH_ATTENTION],
                 list(B.__members__.values())]
CALLS = {"plain": {}, "causal": {"is_causal": True}, "mask": {"mask": True},
         "mask and causal": {"mask": True, "is_causal": True}}  # the last one: MATH raises, flash computes


def outcome(fn):
    """("ok", result) or (exception type, message)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001  (the test compares torch's exception with ours)
        return type(e).__name__, str(e)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("backends", BACKEND_LISTS, ids=lambda bs: "+".join(b.name for b in bs))
def test_sdpa_kernel_selection(backends, call):
    q, k, v = qkv(6, 6)
    kwargs = dict(CALLS[call])
    if kwargs.pop("mask", False):
        kwargs["attn_mask"] = torch.rand(6, 6, generator=torch.Generator().manual_seed(2)) < 0.7
    with sdpa_kernel(backends):
        theirs = outcome(lambda: cs149gpt.ops._torch_sdpa(q, k, v, **kwargs))
        (kind, result), ours, torch_calls = kernel_calls(
            lambda: outcome(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)))
        predicted = cs149gpt.uses_our_kernel(q, k, v, **kwargs)
    expect_ours = B.FLASH_ATTENTION in backends
    assert predicted == expect_ours and ours == int(expect_ours)
    if theirs[0] != "ok":  # torch's error with this selection: ours raises it too, unless ours is selected
        assert expect_ours or (kind, result) == theirs
    if kind == "ok":
        causal = kwargs.get("is_causal", False)
        visible = torch.ones(6, 6, dtype=torch.bool) if "attn_mask" not in kwargs else kwargs["attn_mask"].clone()
        if causal:
            visible &= causal_visible(6, 6, False)
        assert (result.double() - reference(q, k, v, visible=visible)).abs().max().item() <= TOL
    else:
        assert not expect_ours


@pytest.mark.parametrize("backends", [[B.MATH], [B.FLASH_ATTENTION]], ids=["MATH", "FLASH"])
def test_sdpa_kernel_inside_a_compiled_function(backends):
    """The selection is read when the graph is traced, as torch reads it for its own SDPA: inside the function."""
    q, k, v = qkv(6, 6)

    def fn(q, k, v):
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    compiled(q, k, v)  # traced here
    out, ours, theirs = kernel_calls(lambda: compiled(q, k, v))
    assert ours == (B.FLASH_ATTENTION in backends)  # (torch's SDPA is decomposed into the graph: no event of its own)
    assert (out.double() - reference(q, k, v, visible=causal_visible(6, 6, False))).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------------------------------
# torch.nn modules: TorchScript (fresh interpreter) and torch.compile
# ---------------------------------------------------------------------------------------------------------
def modules(d=16, heads=2):
    """The three modules, dropout off, and how each is called (MHA without weights: the call that reaches SDPA)."""
    torch.manual_seed(0)
    layer = lambda: nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)  # noqa: E731
    return {
        "MultiheadAttention": (nn.MultiheadAttention(d, heads, batch_first=True),
                               lambda m, x: m(x, x, x, need_weights=False)[0]),
        "TransformerEncoderLayer": (layer(), lambda m, x: m(x)),
        "TransformerEncoder": (nn.TransformerEncoder(layer(), 2, enable_nested_tensor=False), lambda m, x: m(x)),
    }


_SCRIPT_RUNNER = r"""
import io, json, torch, torch.nn.functional as F
import cs149gpt
from tests.test_sdpa_contract import OURS, kernel_calls, modules
torch_sdpa = F.scaled_dot_product_attention
cs149gpt.install_sdpa()
x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3))
results = {}
for name, (module, call) in modules().items():
    scripted = torch.jit.script(module)
    again = torch.jit.script(module)  # a second scripting in the same process works too
    xs = x.clone().requires_grad_()
    out, ours, theirs = kernel_calls(lambda: call(scripted, xs))
    grad, = torch.autograd.grad(out.sum(), xs)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    cs149gpt.restore_sdpa()  # torch's own, for the reference
    xt = x.clone().requires_grad_()
    want = call(module, xt)
    want_grad, = torch.autograd.grad(want.sum(), xt)
    cs149gpt.install_sdpa()
    results[name] = {"ours": ours, "theirs": theirs, "err": (out - want).abs().max().item(),
                     "grad_err": (grad - want_grad).abs().max().item(),
                     "again_err": (call(again, x) - want).abs().max().item(),
                     "loaded_err": (call(loaded, x) - want).abs().max().item()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def scripted_results():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_RUNNER], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder"])
def test_torchscript_of_nn_modules_runs_ours(scripted_results, name):
    """torch.jit.script after install_sdpa() in a fresh interpreter: scripted code calls our operator
    (torch.ops.cs149gpt.scaled_dot_product_attention), with torch's values and gradients; scripting again, and a
    torch.jit.save/load round trip, work."""
    r = scripted_results[name]
    layers = 2 if name == "TransformerEncoder" else 1
    assert (r["ours"], r["theirs"]) == (layers, 0), r
    assert max(r["err"], r["again_err"], r["loaded_err"]) <= 1e-5 and r["grad_err"] <= 1e-4, r


@pytest.mark.parametrize("name", ["MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder"])
def test_torch_compile_of_nn_modules_runs_ours(name):
    module, call = modules()[name]
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    call(compiled, x)  # traced here: the profiler below sees only the compiled graph run
    out, ours, theirs = kernel_calls(lambda: call(compiled, x))
    assert ours == (2 if name == "TransformerEncoder" else 1) and theirs == 0
    grad, = torch.autograd.grad(out.sum(), x)
    with torchs_own():
        xt = x.detach().clone().requires_grad_()
        want = call(module, xt)
        want_grad, = torch.autograd.grad(want.sum(), xt)
    assert (out - want).abs().max().item() <= 1e-5 and (grad - want_grad).abs().max().item() <= 1e-4


# ---------------------------------------------------------------------------------------------------------
# torch.autocast: every entry point follows torch's SDPA (inputs in autocast's dtype, output in it)
# ---------------------------------------------------------------------------------------------------------
def _entries():
    mask = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))  # float32 additive: cast too, as torch's
    return {
        "attention": (lambda q, k, v: cs149gpt.attention(q, k, v), None),
        "attention causal": (lambda q, k, v: cs149gpt.attention(q, k, v, is_causal=True), "causal"),
        "attention mask": (lambda q, k, v: cs149gpt.attention(q, k, v, attn_mask=mask), mask),
        "attention window": (lambda q, k, v: cs149gpt.attention(q, k, v, window=(-1, -1)), None),
        "attention lse": (lambda q, k, v: cs149gpt.attention(q, k, v, return_lse=True)[0], None),
        "attention naive": (lambda q, k, v: cs149gpt.attention(q, k, v, impl="naive"), None),
        "attention fused": (lambda q, k, v: cs149gpt.attention(q, k, v, impl="fused"), None),
        "scaled_dot_product_attention": (lambda q, k, v: cs149gpt.scaled_dot_product_attention(q, k, v), None),
        "sdpa mask": (lambda q, k, v: cs149gpt.scaled_dot_product_attention(q, k, v, attn_mask=mask), mask),
        "installed drop-in": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), "causal"),
        "CausalBias": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(8, 8)),
                       "causal"),
    }


ENTRIES = list(_entries())


@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "mixed"])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_every_entry_point(dtype, entry, mixed):
    fn, masking = _entries()[entry]
    q, k, v = qkv(8, 8)
    if mixed:  # e.g. q, k out of float32 rotary tables, v from a Linear run in the autocast dtype
        v = v.to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        torch_dtype = torch.nn.functional.scaled_dot_product_attention(q, k, v).dtype
        out, ours, theirs = kernel_calls(lambda: fn(q, k, v))
    assert torch_dtype == dtype and out.dtype == dtype and (ours, theirs) == (1, 0)
    rounded = [t.to(dtype) for t in (q, k, v)]  # what autocast hands over
    if masking == "causal":
        want = reference(*rounded, visible=causal_visible(8, 8, False))
    elif masking is not None:
        s = (rounded[0].double() @ rounded[1].double().transpose(-1, -2)) * 0.25 + masking.to(dtype).double()
        want = torch.softmax(s, dim=-1) @ rounded[2].double()
    else:
        want = reference(*rounded)
    assert (out.double() - want).abs().max().item() <= LOW_TOL[dtype]


def test_autocast_lse_stays_float32():
    q, k, v = qkv(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = cs149gpt.attention(q, k, v, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gradients_and_compile(dtype):
    """Under autocast, float32 leaves get float32 gradients through the casts (as torch's), compiled or not."""
    q, k, v = qkv(8, 8, requires_grad=True)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        with torch.autocast("cpu", dtype=dtype):
            run(q, k, v)  # (traced here, when compiled)
            out, ours, theirs = kernel_calls(lambda: run(q, k, v))
        assert out.dtype == dtype and (ours, theirs) == (1, 0)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        leaves = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(reference(*leaves, visible=causal_visible(8, 8, False)).sum(), leaves)
        for a, b in zip(grads, want):
            assert a.dtype == torch.float32
            assert (a.double() - b).norm().item() <= 4 * LOW_TOL[dtype] * b.norm().item()


def test_autocast_kvcache_casts_to_the_cache_dtype():
    """The caches are written in place and keep their dtype: q, k_new, v_new are cast to it."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k_cache, v_cache = (torch.randn(2, 2, 12, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 2, 1, 16, generator=g) for _ in range(2))
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cs149gpt.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new=k_new, v_new=v_new)
    assert out.dtype == torch.bfloat16
    for b, n in enumerate((4, 8)):  # the cached keys and the new one
        want = reference(q[b:b + 1].to(torch.bfloat16), k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n])
        assert (out[b:b + 1].double() - want).abs().max().item() <= LOW_TOL[torch.bfloat16]
        assert torch.equal(k_cache[b, :, n - 1], k_new[b, :, 0].to(torch.bfloat16))
