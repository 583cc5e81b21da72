"""Bad input, class by class (GitHub issue #8): each case ends in a Python exception of the documented type whose
message names the argument, or, for the SDPA drop-in, in exactly what torch itself returns or raises. Never a
crash, a wrong answer, or uninitialised memory.

Classes: sizes and integer overflow (tiles, outputs, copies, workspaces, index arithmetic); the fake and meta
implementations (eager, meta, FakeTensorMode and torch.compile refuse the same inputs with the same message);
devices; layouts (sparse, quantized); forward-mode AD; the SDPA drop-in.

The cases that could take the interpreter down (before issue #8 was fixed, some did) run in one subprocess, one
after another, each announcing itself before it starts: a crash fails the case that caused it, by name, and the
cases after it as "not reached", instead of the whole run.
"""
import contextlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import cs149gpt

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------
# Sizes and integer overflow, in a subprocess. Each case: (name, code, exception type name or None, regex).
# The code runs with torch, cs149gpt, M = INT64_MAX, x = a (1, 1, 1, 8) tensor and small q, k, v in scope;
# None means "returns normally" (its asserts then check the answer).
# ---------------------------------------------------------------------------------------------------------
_PRELUDE = """
import torch, cs149gpt
M = 2**63 - 1
torch.manual_seed(0)
x = torch.randn(1, 1, 1, 8)
q, k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
def grads(**tiles):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cs149gpt.attention(*leaves, is_causal=True, **tiles)
    return torch.autograd.grad((out * out).sum(), leaves)
def big_kv(n):  # n keys of stride 0: no memory behind them
    return x.expand(1, 1, n, 8), x.expand(1, 1, n, 8)
"""

RISKY = [
    # Tiles near INT64_MAX: clamped to the sequence lengths before any kernel rounds them up.
    ("forward tiles INT64_MAX",
     "assert torch.equal(cs149gpt.attention(q, k, v, block_q=M, block_k=M), "
     "cs149gpt.attention(q, k, v, block_q=7, block_k=9))", None, ""),
    ("backward tiles INT64_MAX",
     "for a, b in zip(grads(block_q=M, block_k=M), grads(block_q=7, block_k=9)): assert torch.equal(a, b)",
     None, ""),
    ("backward block_q INT64_MAX alone",
     "for a, b in zip(grads(block_q=M, block_k=2), grads(block_q=7, block_k=2)): assert torch.equal(a, b)",
     None, ""),
    ("backward block_k INT64_MAX - 5",
     "for a, b in zip(grads(block_q=3, block_k=M - 5), grads(block_q=3, block_k=9)): assert torch.equal(a, b)",
     None, ""),
    ("blocked tile INT64_MAX",
     "assert torch.equal(cs149gpt.attention(q, k, v, impl='blocked', block_q=M), "
     "cs149gpt.attention(q, k, v, impl='blocked', block_q=9))", None, ""),
    ("myFlashAttention Br, Bc INT64_MAX",
     "Q = torch.randn(1, 2, 7, 8); e = torch.empty(0)\n"
     "out = cs149gpt.myFlashAttention(Q, Q, Q, *[e] * 11, M, M, 1, 2, 7, 8)\n"
     "assert torch.equal(out, cs149gpt.attention(Q, Q, Q, scale=1.0, block_q=7, block_k=7))", None, ""),
    # Workspaces whose int64 formulas would overflow (stride-0 keys: astronomically long, no memory).
    ("flash workspace of 2^59 keys", "cs149gpt.attention(q[:, :1], *big_kv(2**59))", "OutOfMemoryError",
     r"the workspace of impl='flash' for batch 1, heads 1 \(kv heads 1\), q_len 7, kv_len 576460752303423488, "
     r"head dim 8.* overflows int64"),
    ("flash-decoding workspace of 2^59 keys", "cs149gpt.attention(q[:, :1, :1], *big_kv(2**59))",
     "OutOfMemoryError", r"the workspace of impl='flash' .*q_len 1, kv_len 576460752303423488"),
    ("fused workspace of 2^59 keys", "cs149gpt.attention(q[:, :1], *big_kv(2**59), impl='fused')",
     "OutOfMemoryError", r"the workspace of impl='fused' .*kv_len 576460752303423488"),
    # (Two query heads on the one kv head: their tiles share the packed keys, so all of K is packed up front; a lone
    # head's one query tile would pack its own, and the call would need no such workspace.)
    ("flash workspace of 2^40 keys, one-key tiles (fits int64, not memory)",
     "cs149gpt.attention(q, *big_kv(2**40), block_k=1)", "OutOfMemoryError",
     r"the workspace of impl='flash' .*kv_len 1099511627776.* needs \d+(\.\d+)? GiB, more than this machine's memory"),
    ("naive score matrix of 2^59 keys", "cs149gpt.attention(q[:, :1], *big_kv(2**59), impl='naive')",
     "OutOfMemoryError", r"impl='naive' materialises the q_len x kv_len score matrix \(7 x 576460752303423488"),
    ("blocked score matrix of 2^59 keys", "cs149gpt.attention(q[:, :1], *big_kv(2**59), impl='blocked')",
     "OutOfMemoryError", r"impl='blocked' materialises the q_len x kv_len score matrix"),
    ("backward dk of 2^59 keys",
     "Q = torch.randn(1, 1, 2, 8); K, V = big_kv(2**59); lse = torch.zeros(1, 1, 2)\n"
     "torch.ops.cs149gpt.flash_attention_backward(Q, Q, K, V, Q, lse)", "OutOfMemoryError",
     r"dk of shape \[1, 1, 576460752303423488, 8\]"),
    # Outputs and copies of stride-0 expanded inputs: 2^55 elements, 32 bytes of memory.
    ("out of a (2^20, 2^20, 4096, 8) expand",
     "X = x.expand(2**20, 2**20, 4096, 8)\ncs149gpt.attention(X, X, X)", "OutOfMemoryError",
     r"out of shape \[1048576, 1048576, 4096, 8\] needs \d+(\.\d+)? GiB, more than this machine's memory"),
    ("backward dq of a (2^20, 2^20, 4096, 8) expand",
     "X = x.expand(2**20, 2**20, 4096, 8); L = torch.zeros(1, 1, 1).expand(2**20, 2**20, 4096)\n"
     "torch.ops.cs149gpt.flash_attention_backward(X, X, X, X, X, L)", "OutOfMemoryError",
     r"dq of shape \[1048576, 1048576, 4096, 8\]"),
    ("copy of a last dim of stride 0",
     "X = torch.randn(1, 1, 1, 1).expand(2**20, 2**20, 4096, 8)\ncs149gpt.attention(X, X, X)", "OutOfMemoryError",
     r"a copy of q of shape \[1048576, 1048576, 4096, 8\] needs"),
    ("copy when 5-D leading dims cannot be flattened in place",
     "X = torch.randn(2, 1, 1, 1, 8).expand(2, 2**30, 1, 4096, 8).transpose(0, 1)\ncs149gpt.attention(X, X, X)",
     "OutOfMemoryError", r"a copy of q of shape \[1073741824, 2, 1, 4096, 8\] needs"),
    # twoDimRead / fourDimRead: every product checked before it can wrap around.
    ("twoDimRead x * sizeX wraps to 0", "cs149gpt.twoDimRead([1.0, 2.0], 2**62, 0, 4)", "IndexError",
     r"twoDimRead index \(4611686018427387904, 0\) with rows of 4 is past the end of a list of 2"),
    ("twoDimRead x * sizeX wraps negative", "cs149gpt.twoDimRead([1.0, 2.0], 3, 1, 2**62)", "IndexError",
     r"past the end of a list of 2"),
    ("twoDimRead sizeX INT64_MAX", "cs149gpt.twoDimRead([1.0] * 4, 2, 0, M)", "IndexError", r"past the end"),
    ("twoDimRead x * sizeX + y overflows", "cs149gpt.twoDimRead([1.0] * 4, 1, M - 1, M)", "IndexError",
     r"past the end"),
    ("fourDimRead product wraps to 0", "cs149gpt.fourDimRead([1.0] * 8, 2**62, 0, 0, 0, 2, 2, 1)", "IndexError",
     r"fourDimRead index \(4611686018427387904, 0, 0, 0\) of sizes \(·, 2, 2, 1\) is past the end of a list of 8"),
    ("fourDimRead product overflows", "cs149gpt.fourDimRead([1.0] * 16, 2**40, 1, 1, 1, 2, 2, 2**30)",
     "IndexError", r"past the end of a list of 16"),
    ("fourDimRead sizes INT64_MAX", "cs149gpt.fourDimRead([1.0] * 16, 1, M - 1, M - 1, M - 1, M, M, M)",
     "IndexError", r"past the end"),
    ("twoDimRead index beyond int64", "cs149gpt.twoDimRead([1.0], 2**64, 0, 1)", "TypeError",
     r"incompatible function arguments"),
    # The FMA probe: threads handed to OpenMP as an int; its doubling loop must end.
    ("fma_peak_gflops threads 2^32 + 1", "from cs149gpt import _ext\n_ext.load()._testing.fma_peak_gflops(2**32 + 1, 0.01)",
     "ValueError", r"num_threads must be >= 1 and <= 4096, got 4294967297"),
    ("fma_peak_gflops seconds 1e300", "from cs149gpt import _ext\n_ext.load()._testing.fma_peak_gflops(1, 1e300)",
     "ValueError", r"seconds must be in \(0, 60\], got 1e\+300"),
    ("fma_peak_gflops seconds NaN", "from cs149gpt import _ext\n_ext.load()._testing.fma_peak_gflops(1, float('nan'))",
     "ValueError", r"seconds must be in \(0, 60\], got nan"),
]

_RUNNER = """
import json, sys, traceback
cases = json.loads(sys.stdin.read())
namespace = {}
exec(compile(cases.pop(0), "<prelude>", "exec"), namespace)
for name, code in cases:
    print(json.dumps({"begin": name}), flush=True)
    try:
        exec(compile(code, name, "exec"), dict(namespace))
        result = {"name": name, "type": None, "message": ""}
    except Exception as e:
        result = {"name": name, "type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    print(json.dumps(result), flush=True)
"""


# The whole list takes a few seconds (a minute or two under make sanitize).
RISKY_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def risky_results():
    """Runs every RISKY case in one fresh interpreter; returns (results by name, names begun, how it ended, stderr).

    A case that hangs (in C++, where no Python signal reaches it) is cut off by the timeout: the cases that had
    finished keep their results, the hung one is named, as a crashed one is."""
    cases = [_PRELUDE] + [[name, code] for name, code, _, _ in RISKY]
    try:
        proc = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(cases), cwd=ROOT, capture_output=True,
                              text=True, timeout=RISKY_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT)})
        stdout, stderr, ended = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # its captured output is bytes, whatever text= said
        stdout, stderr = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        ended = f"killed after {RISKY_TIMEOUT_S} s"
    results, begun = {}, []
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "begin" in record:
                begun.append(record["begin"])
            else:
                results[record["name"]] = record
    return results, begun, ended, stderr


@pytest.mark.parametrize("name, code, exc_type, pattern", RISKY, ids=[case[0] for case in RISKY])
def test_sizes_and_overflow(risky_results, name, code, exc_type, pattern):
    results, begun, ended, stderr = risky_results
    if name not in results:
        where = ("crashed or hung in this case" if name in begun else
                 f"not reached: the interpreter died or hung in case {begun[-1]!r}" if begun else
                 "the subprocess never ran")
        pytest.fail(f"{where}; exit code {ended}\n{stderr[-3000:]}")
    got = results[name]
    assert got["type"] == exc_type, f"expected {exc_type}, got {got['type']}: {got['message']}\n{got.get('trace')}"
    if exc_type is not None:
        assert re.search(pattern, got["message"]), got["message"]


def test_risky_subprocess_exits_cleanly(risky_results):
    """Exit code 0, not a signal: nothing in RISKY took the interpreter down."""
    _, _, ended, stderr = risky_results
    assert ended == 0, stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# One check for eager, meta and fake tensors and torch.compile: the same inputs refused with the same message.
# ---------------------------------------------------------------------------------------------------------
F32, F16 = torch.float32, torch.float16
# (id, q shape, k shape, v shape, dtype of k, keyword arguments, exception type, message fragment)
BAD_CALLS = [
    ("k head dim", (1, 2, 5, 8), (1, 2, 5, 7), (1, 2, 5, 7), F32, {}, ValueError,
     "k and v must have head dim d = 8 (the last dim of q), got k [1, 2, 5, 7]"),
    ("v head dim", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 9), F32, {}, ValueError, "k and v must have head dim d = 8"),
    ("k and v lengths", (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 7, 8), F32, {}, ValueError,
     "k and v must have the same length (dim -2)"),
    ("leading dims", (2, 2, 5, 8), (3, 2, 5, 8), (3, 2, 5, 8), F32, {}, ValueError,
     "q, k and v must have the same leading dims"),
    ("GQA not a multiple", (1, 6, 5, 8), (1, 4, 5, 8), (1, 4, 5, 8), F32, {}, ValueError,
     "the heads of q (dim -3) must be a multiple of those of k and v"),
    ("k and v heads", (1, 6, 5, 8), (1, 2, 5, 8), (1, 3, 5, 8), F32, {}, ValueError,
     "k and v must have the same number of heads (dim -3)"),
    ("ranks differ", (1, 2, 5, 8), (2, 5, 8), (2, 5, 8), F32, {}, ValueError,
     "q, k and v must have the same number of dims"),
    ("1-D q", (8,), (4, 8), (4, 8), F32, {}, ValueError, "q must have shape (..., N, d), at least 2 dims"),
    ("no keys", (1, 2, 5, 8), (1, 2, 0, 8), (1, 2, 0, 8), F32, {}, ValueError,
     "k must have at least one key row (dim -2)"),
    ("no queries", (1, 2, 0, 8), (1, 2, 5, 8), (1, 2, 5, 8), F32, {}, ValueError,
     "q must have at least one query row (dim -2)"),
    ("no kv heads", (1, 2, 5, 8), (1, 0, 5, 8), (1, 0, 5, 8), F32, {}, ValueError,
     "k and v must have at least one head (dim -3), got k [1, 0, 5, 8], v [1, 0, 5, 8]"),
    ("no heads at all", (1, 0, 5, 8), (1, 0, 5, 8), (1, 0, 5, 8), F32, {}, ValueError,
     "k and v must have at least one head (dim -3)"),
    ("mixed dtypes", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), F16, {}, TypeError,
     "q, k and v must share one dtype, got q Float, k Half"),
    ("scale NaN", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), F32, {"scale": math.nan}, ValueError,
     "scale must be a finite float32, got nan"),
    ("scale beyond float32", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), F32, {"scale": 3.5e38}, ValueError,
     "scale must be a finite float32, got 3.5e+38"),
    ("block_q 0", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), F32, {"block_q": 0}, ValueError,
     "block_q must be >= 1, got 0"),
    ("block_k negative", (1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8), F32, {"block_k": -(2**40)}, ValueError,
     "block_k must be >= 1, got -1099511627776"),
]


@pytest.mark.parametrize("tile", ["block_q", "block_k"])
def test_tiles_beyond_int64_name_the_argument(tile):
    """A tile past int64 cannot reach the operator (its schema takes int64): attention() says which argument."""
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=rf"{tile} must be >= 1 and at most 2\*\*63 - 1, got 9223372036854775808"):
        cs149gpt.attention(q, q, q, **{tile: 2**63})


def _bad_call_tensors(q_shape, k_shape, v_shape, k_dtype, device="cpu"):
    return (torch.randn(q_shape, device=device), torch.randn(k_shape, device=device).to(k_dtype),
            torch.randn(v_shape, device=device))


def _flash(q, k, v, scale=None, block_q=None, block_k=None):
    return torch.ops.cs149gpt.flash_attention(q, k, v, scale, "none", block_q, block_k)


def _raised(f, *args, **kwargs):
    try:
        f(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test compares whatever was raised
        return e
    return None


def _raised_in(mode, f, tensors, **kwargs):
    """What f(*tensors, **kwargs) raises; in mode "fake", called on FakeTensors made from them."""
    if mode != "fake":
        return _raised(f, *tensors, **kwargs)
    with FakeTensorMode() as fake:
        return _raised(f, *(fake.from_tensor(t) for t in tensors), **kwargs)


@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_fake_and_meta_check_what_eager_checks(case, mode):
    """The operator's CPU kernel, its meta kernel and its fake refuse the same call with the same exception."""
    _, q_shape, k_shape, v_shape, k_dtype, kwargs, exc_type, fragment = case
    q, k, v = _bad_call_tensors(q_shape, k_shape, v_shape, k_dtype, "meta" if mode == "meta" else "cpu")
    e = _raised_in(mode, _flash, (q, k, v), **kwargs)
    assert type(e) is exc_type, repr(e)
    assert fragment in str(e)
    # the same message, word for word, in every mode
    assert str(e) == str(_raised(_flash, *_bad_call_tensors(q_shape, k_shape, v_shape, k_dtype), **kwargs))


@pytest.mark.parametrize("case", [c for c in BAD_CALLS if c[0] in ("k head dim", "GQA not a multiple", "no keys")],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_refuses_what_eager_refuses(case, dynamic):
    """torch.compile traces through the fakes: a bad call fails at trace time with our message (symbolic sizes
    under dynamic=True), not traced as if valid (then no graph ever reaches the backend)."""
    _, q_shape, k_shape, v_shape, k_dtype, kwargs, exc_type, fragment = case
    q, k, v = _bad_call_tensors(q_shape, k_shape, v_shape, k_dtype)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(lambda q, k, v: cs149gpt.attention(q, k, v, **kwargs), backend=backend, fullgraph=True,
                      dynamic=dynamic)
    e = _raised(f, q, k, v)
    eager = _raised(cs149gpt.attention, q, k, v, **kwargs)
    assert e is not None and type(eager) is exc_type
    assert graphs == [], "traced as if valid"
    if dynamic:  # sizes print as symbols; the sentence is the same
        assert fragment.split(",")[0].split(" = ")[0] in str(e), str(e)
    else:
        assert str(eager) in str(e), str(e)


def test_compile_dynamic_accepts_what_eager_accepts():
    """The shared check on SymInts passes valid GQA shapes, and the compiled result is the eager one."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: cs149gpt.attention(q, k, v, is_causal=True), fullgraph=True, dynamic=True)
    for shape_q, shape_kv in (((2, 4, 7, 8), (2, 2, 9, 8)), ((1, 6, 3, 8), (1, 3, 5, 8))):
        q, k, v = torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv)
        with torch.no_grad():
            assert torch.equal(f(q, k, v), cs149gpt.attention(q, k, v, is_causal=True))


def test_compile_data_dependent_kv_len():
    """Unbacked sizes (the keys picked by nonzero): the shared check asserts on them when the graph runs instead
    of guarding, which would fail the trace."""
    torch._dynamo.reset()
    torch._dynamo.config.capture_dynamic_output_shape_ops, before = True, \
        torch._dynamo.config.capture_dynamic_output_shape_ops
    try:
        @torch.compile(fullgraph=True)
        def f(q, keep):
            kv = q[:, :, keep.nonzero().squeeze(-1)]  # (1, 2, u0, 8)
            return cs149gpt.attention(q, kv, kv)

        q, keep = torch.randn(1, 2, 5, 8), torch.tensor([1, 0, 1, 1, 0])
        with torch.no_grad():
            assert torch.equal(f(q, keep), cs149gpt.attention(q, q[:, :, [0, 2, 3]], q[:, :, [0, 2, 3]]))
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = before


# The backward op: dout, out and lse are checked by the fake as by the kernel.
BAD_BACKWARD = [
    ("out shape", {"out": (1, 2, 5, 7)}, ValueError, "out must have the shape of q, [1, 2, 5, 8]; got [1, 2, 5, 7]"),
    ("dout shape", {"dout": (1, 2, 4, 8)}, ValueError, "dout must have the shape of q"),
    ("lse shape", {"lse": (1, 2, 4)}, ValueError, "lse must have shape [1, 2, 5] (q's without the last dim)"),
    ("lse dtype", {"lse_dtype": torch.float16}, TypeError, "lse must be float32, got Half"),
    ("out dtype", {"out_dtype": torch.float16}, TypeError, "out must have the dtype of q, Float; got Half"),
    ("k head dim", {"k": (1, 2, 5, 4)}, ValueError, "k and v must have head dim d = 8"),
]


def _backward_args(spec, device="cpu"):
    shapes = {"dout": (1, 2, 5, 8), "q": (1, 2, 5, 8), "k": (1, 2, 5, 8), "v": (1, 2, 5, 8), "out": (1, 2, 5, 8),
              "lse": (1, 2, 5)}
    shapes.update({key: value for key, value in spec.items() if key in shapes})
    if "k" in spec:
        shapes["v"] = spec["k"]
    tensors = {name: torch.randn(shape, device=device) for name, shape in shapes.items()}
    tensors["lse"] = tensors["lse"].to(spec.get("lse_dtype", torch.float32))
    tensors["out"] = tensors["out"].to(spec.get("out_dtype", torch.float32))
    return [tensors[name] for name in ("dout", "q", "k", "v", "out", "lse")]


@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
@pytest.mark.parametrize("case", BAD_BACKWARD, ids=[c[0] for c in BAD_BACKWARD])
def test_backward_fake_checks_out_and_lse(case, mode):
    _, spec, exc_type, fragment = case
    args = _backward_args(spec, "meta" if mode == "meta" else "cpu")
    op = torch.ops.cs149gpt.flash_attention_backward
    e = _raised_in(mode, op, args)
    assert type(e) is exc_type, repr(e)
    assert fragment in str(e)
    assert str(e) == str(_raised(op, *_backward_args(spec)))


# ---------------------------------------------------------------------------------------------------------
# Devices: all tensors of a call on one device (CPU, or meta for shapes only).
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "fake"])
@pytest.mark.parametrize("devices, expected", [
    (("cpu", "meta", "meta"), "q, k and v must be on one device, got q on cpu, k on meta, v on meta"),
    (("meta", "cpu", "cpu"), "q, k and v must be on one device, got q on meta, k on cpu, v on cpu"),
    (("cpu", "cpu", "meta"), "q, k and v must be on one device, got q on cpu, k on cpu, v on meta"),
], ids=["cpu q, meta k v", "meta q, cpu k v", "meta v"])
def test_mixed_devices(devices, expected, mode):
    """A CPU q with meta k, v used to return an uninitialised CPU tensor (the meta kernel ran)."""
    q, k, v = (torch.randn(1, 2, 5, 8, device=dev) for dev in devices)
    e = _raised_in(mode, cs149gpt.attention, (q, k, v))
    assert type(e) is ValueError and str(e) == expected, repr(e)


@pytest.mark.parametrize("meta_arg", ["out", "lse", "dout"])
def test_backward_mixed_devices(meta_arg):
    """The backward op used to accept out / lse on meta."""
    args = _backward_args({})
    index = ("dout", "q", "k", "v", "out", "lse").index(meta_arg)
    args[index] = args[index].to("meta")
    e = _raised(torch.ops.cs149gpt.flash_attention_backward, *args)
    assert type(e) is ValueError, repr(e)
    assert "dout, q, k, v, out and lse must be on one device" in str(e) and f"{meta_arg} on meta" in str(e)


def test_meta_inputs_give_meta_shapes():
    """All-meta inputs are shape inference, not an error: the fake's output shapes."""
    q, k = torch.empty(2, 4, 7, 8, device="meta"), torch.empty(2, 2, 9, 8, device="meta")
    out, lse = torch.ops.cs149gpt.flash_attention(q, k, k)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == q.shape[:-1]
    assert lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# Layouts: sparse and quantized tensors are a TypeError naming the argument, not the dispatcher's text.
# ---------------------------------------------------------------------------------------------------------
def _sparse(t):
    return t.to_sparse()


def _quantized(t):
    return torch.quantize_per_tensor(t, 0.1, 0, torch.quint8)


def _csr(t):
    return t[0, 0].to_sparse_csr()


@pytest.mark.parametrize("entry", ["attention", "operator", "sdpa", "myNaiveAttention"])
@pytest.mark.parametrize("make, which, fragment", [
    (_sparse, "q", "q must be a dense (strided) tensor, got layout Sparse"),
    (_sparse, "k", "k must be a dense (strided) tensor, got layout Sparse"),
    (_quantized, "v", "v must be a float tensor, not quantized; got QUInt8"),
    (_quantized, "q", "q must be a float tensor, not quantized; got QUInt8"),
], ids=["sparse q", "sparse k", "quantized v", "quantized q"])
def test_sparse_and_quantized(entry, make, which, fragment):
    tensors = {name: torch.randn(1, 2, 5, 8) for name in "qkv"}
    tensors[which] = make(tensors[which])
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if entry == "attention":
        e = _raised(cs149gpt.attention, q, k, v)
    elif entry == "operator":  # the dispatcher used to answer "Could not run ... from the 'SparseCPU' backend"
        e = _raised(torch.ops.cs149gpt.flash_attention, q, k, v)
    elif entry == "sdpa":
        e = _raised(cs149gpt.scaled_dot_product_attention, q, k, v)
    else:
        e = _raised(cs149gpt.myNaiveAttention, q, k, v, torch.empty(0), 1, 2, 5, 8)
    assert type(e) is TypeError and fragment in str(e), repr(e)


def test_sparse_csr():
    q = torch.randn(1, 2, 5, 8)
    e = _raised(cs149gpt.attention, q, q, _csr(q))
    assert type(e) is TypeError and "v must be a dense (strided) tensor, got layout SparseCsr" in str(e), repr(e)


def _nested(layout):
    g = torch.Generator().manual_seed(9)
    rows = [torch.randn(3, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)]  # (j, H, d) per sequence
    return torch.nested.nested_tensor(rows, layout=layout).transpose(1, 2)  # (B, H, j, d)


# (A jagged tensor's own __torch_dispatch__ answers for every operator it meets: attention() checks it first.)
@pytest.mark.parametrize("entry, layout, fragment", [
    ("attention", torch.strided, "q must be a dense (strided) tensor, not a nested tensor"),
    ("operator", torch.strided, "q must be a dense (strided) tensor, not a nested tensor"),
    ("attention", torch.jagged, "q must be a dense (strided) tensor, got layout Jagged"),
], ids=["nested", "nested-operator", "jagged"])
def test_nested(entry, layout, fragment):
    nt = _nested(layout)
    f = cs149gpt.attention if entry == "attention" else torch.ops.cs149gpt.flash_attention
    e = _raised(f, nt, nt, nt)
    assert type(e) is TypeError and fragment in str(e), repr(e)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["nested", "jagged"])
def test_sdpa_nested_is_torchs(layout):
    """Nested tensors are torch's SDPA's to take: ours returns (or raises) exactly what it does."""
    nt = _nested(layout)
    assert not cs149gpt.uses_our_kernel(nt, nt, nt)
    theirs = _raised(F.scaled_dot_product_attention, nt, nt, nt)
    ours = _raised(cs149gpt.scaled_dot_product_attention, nt, nt, nt)
    if theirs is not None:
        assert type(ours) is type(theirs) and str(ours) == str(theirs)
    else:
        assert ours is None
        for a, b in zip(cs149gpt.scaled_dot_product_attention(nt, nt, nt).unbind(),
                        F.scaled_dot_product_attention(nt, nt, nt).unbind()):
            assert torch.equal(a, b)


class _Logged(torch.Tensor):
    """A tensor subclass that records the functions called on it through __torch_function__."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_sdpa_tensor_subclass_sees_torchs_sdpa():
    q, k, v = (t.as_subclass(_Logged) for t in _qkv((1, 2, 3, 8)))
    _Logged.seen.clear()
    assert not cs149gpt.uses_our_kernel(q, k, v)
    out = cs149gpt.scaled_dot_product_attention(q, k, v)
    assert "scaled_dot_product_attention" in _Logged.seen
    assert torch.equal(out.as_subclass(torch.Tensor), F.scaled_dot_product_attention(
        *(t.as_subclass(torch.Tensor) for t in (q, k, v))))


@pytest.mark.parametrize("which", ["dout", "out", "lse"])
def test_backward_sparse(which):
    args = _backward_args({})
    index = ("dout", "q", "k", "v", "out", "lse").index(which)
    args[index] = args[index].to_sparse()
    e = _raised(torch.ops.cs149gpt.flash_attention_backward, *args)
    assert type(e) is TypeError and f"{which} must be a dense (strided) tensor, got layout Sparse" in str(e), repr(e)


# ---------------------------------------------------------------------------------------------------------
# Forward-mode AD: our ops have no forward derivative. They say so, as torch does for such an op, instead of
# returning a result without a tangent (or, under torch.func.jvp, a zero one).
# ---------------------------------------------------------------------------------------------------------
FWAD_MESSAGE = "Trying to use forward AD with cs149gpt::{op} that does not support it ({arg} has a tangent)"


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_forward_ad_dual_tensor_raises(which):
    tensors = {name: torch.randn(1, 2, 5, 8) for name in "qkv"}
    with fwAD.dual_level():
        tensors[which] = fwAD.make_dual(tensors[which], torch.randn(1, 2, 5, 8))
        e = _raised(cs149gpt.attention, *tensors.values())
        op_e = _raised(torch.ops.cs149gpt.attention, *tensors.values(), "fused")  # the operator itself, too
    assert type(e) is NotImplementedError, repr(e)
    assert FWAD_MESSAGE.format(op="flash_attention", arg=which) in str(e)
    assert type(op_e) is NotImplementedError and FWAD_MESSAGE.format(op="attention", arg=which) in str(op_e)


@pytest.mark.parametrize("entry", ["attention", "operator"])
def test_jvp_raises(entry):
    """Under torch.func.jvp the tangents live on functorch's wrappers: refused all the same, not a zero tangent."""
    q = torch.randn(1, 2, 5, 8)
    f = ((lambda x: cs149gpt.attention(x, q, q, impl="fused")) if entry == "attention" else
         (lambda x: torch.ops.cs149gpt.flash_attention(q, x, q)[0]))
    e = _raised(torch.func.jvp, f, (q,), (torch.randn_like(q),))
    assert type(e) is NotImplementedError, repr(e)
    expected = FWAD_MESSAGE.format(op="attention", arg="q") if entry == "attention" else \
        FWAD_MESSAGE.format(op="flash_attention", arg="k")
    assert expected in str(e)


def test_forward_ad_through_the_backward_op():
    args = _backward_args({})
    with fwAD.dual_level():
        args[0] = fwAD.make_dual(args[0], torch.ones_like(args[0]))
        e = _raised(torch.ops.cs149gpt.flash_attention_backward, *args)
    assert type(e) is NotImplementedError, repr(e)
    assert FWAD_MESSAGE.format(op="flash_attention_backward", arg="dout") in str(e)


@pytest.mark.parametrize("how", ["dual", "jvp"])
def test_sdpa_forward_ad_is_torchs(how):
    """The drop-in hands dual tensors to torch's SDPA: whatever torch does (today: raises), ours does."""
    q = torch.randn(1, 2, 5, 8)
    results = []
    for sdpa in (F.scaled_dot_product_attention, cs149gpt.scaled_dot_product_attention):
        if how == "jvp":
            results.append(_raised(torch.func.jvp, lambda x: sdpa(x, q, q), (q,), (torch.ones_like(q),)))
        else:
            with fwAD.dual_level():
                results.append(_raised(sdpa, fwAD.make_dual(q, torch.ones_like(q)), q, q))
    theirs, ours = results
    assert type(ours) is type(theirs) and str(ours) == str(theirs)
    with fwAD.dual_level():
        assert not cs149gpt.uses_our_kernel(fwAD.make_dual(q, torch.ones_like(q)), q, q)


# ---------------------------------------------------------------------------------------------------------
# The SDPA drop-in: for every input torch accepts, what torch returns; for every input it refuses, its error.
# ---------------------------------------------------------------------------------------------------------
def _qkv(q_shape, kv_shape=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(8)
    kv_shape = kv_shape or q_shape
    return (torch.randn(q_shape, generator=g).to(dtype), torch.randn(kv_shape, generator=g).to(dtype),
            torch.randn(kv_shape, generator=g).to(dtype))


# (id, q shape, kv shape, keyword arguments): calls torch answers and our kernel does not take.
DELEGATED = [
    ("no keys", (1, 2, 3, 8), (1, 2, 0, 8), {}),
    ("no heads", (1, 0, 3, 8), (1, 0, 3, 8), {}),
    ("no heads, GQA", (1, 0, 3, 8), (1, 0, 3, 8), {"enable_gqa": True}),
    ("no queries", (1, 2, 0, 8), (1, 2, 4, 8), {}),
    ("no head dim", (1, 2, 3, 0), (1, 2, 4, 0), {}),
    ("scale NaN", (1, 2, 3, 8), (1, 2, 4, 8), {"scale": math.nan}),
    ("scale +inf", (1, 2, 3, 8), (1, 2, 4, 8), {"scale": math.inf}),
    ("scale beyond float32", (1, 2, 3, 8), (1, 2, 4, 8), {"scale": 1e39}),
    ("scale -3.5e38", (1, 2, 3, 8), (1, 2, 4, 8), {"scale": -3.5e38}),
    ("broadcast batch", (2, 2, 3, 8), (1, 2, 4, 8), {}),
    ("2-D", (3, 8), (4, 8), {}),
    ("float64", (1, 2, 3, 8), (1, 2, 4, 8), {"dtype": torch.float64}),
    ("mask that requires grad", (1, 2, 3, 8), (1, 2, 4, 8), {"attn_mask": torch.randn(3, 4, requires_grad=True)}),
    ("mask, 2-D", (3, 8), (4, 8), {"attn_mask": torch.ones(3, 4, dtype=torch.bool).tril()}),
    ("causal, no keys", (1, 2, 3, 8), (1, 2, 0, 8), {"is_causal": True}),
]


def _torch_sdpa_survives(q_shape, kv_shape):
    """Whether torch's own CPU SDPA returns on zero-sized inputs of these shapes (torch 2.11's dies of SIGFPE on
    some): asked in a subprocess, only for empty shapes on torch older than the 2.13 this project pins."""
    if torch.__version__ >= "2.13" or all(0 not in s for s in (q_shape, kv_shape)):
        return True
    script = (f"import torch; q = torch.randn{q_shape}; k = torch.randn{kv_shape}; "
              "torch.nn.functional.scaled_dot_product_attention(q, k, k)")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300).returncode == 0


@pytest.mark.parametrize("case", DELEGATED, ids=[c[0] for c in DELEGATED])
def test_sdpa_returns_what_torch_returns(case):
    _, q_shape, kv_shape, kwargs = case
    if not _torch_sdpa_survives(q_shape, kv_shape):
        pytest.skip(f"torch {torch.__version__}'s own SDPA crashes on q {q_shape}, k {kv_shape}: nothing to compare")
    kwargs = dict(kwargs)
    q, k, v = _qkv(q_shape, kv_shape, kwargs.pop("dtype", torch.float32))
    assert not cs149gpt.uses_our_kernel(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ours = cs149gpt.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


# (id, q shape, kv shape, keyword arguments): calls torch refuses; ours refuses them with torch's exception.
REFUSED = [
    ("GQA without enable_gqa", (1, 4, 3, 8), (1, 2, 3, 8), {}),
    ("heads not a multiple", (1, 3, 3, 8), (1, 2, 3, 8), {"enable_gqa": True}),
    ("is_causal a string", (1, 2, 3, 8), (1, 2, 3, 8), {"is_causal": "bottom_right"}),
    ("integer tensors", (1, 2, 3, 8), (1, 2, 3, 8), {"dtype": torch.int64}),
    ("head dims differ", (1, 2, 3, 8), (1, 2, 3, 4), {}),
    ("float64 mask", (1, 2, 3, 8), (1, 2, 4, 8), {"attn_mask": torch.zeros(3, 4, dtype=torch.float64)}),
    ("integer mask", (1, 2, 3, 8), (1, 2, 4, 8), {"attn_mask": torch.ones(3, 4, dtype=torch.int64)}),
    ("unbroadcastable mask", (1, 2, 3, 8), (1, 2, 4, 8), {"attn_mask": torch.zeros(5, 4)}),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_sdpa_raises_what_torch_raises(case):
    _, q_shape, kv_shape, kwargs = case
    kwargs = dict(kwargs)
    q, k, v = _qkv(q_shape, kv_shape, kwargs.pop("dtype", torch.float32))
    theirs = _raised(F.scaled_dot_product_attention, q, k, v, **kwargs)
    ours = _raised(cs149gpt.scaled_dot_product_attention, q, k, v, **kwargs)
    assert theirs is not None
    assert type(ours) is type(theirs) and str(ours) == str(theirs)


@pytest.fixture
def installed_drop_in():
    """torch.nn.functional.scaled_dot_product_attention replaced by ours, the way users install it; counts calls."""
    original = F.scaled_dot_product_attention
    calls = []

    def ours(*args, **kwargs):
        calls.append(cs149gpt.uses_our_kernel(*args, **kwargs))
        return cs149gpt.scaled_dot_product_attention(*args, **kwargs)

    F.scaled_dot_product_attention = ours
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = original


def test_installed_drop_in_falls_back_without_recursing(installed_drop_in):
    """The fallback used to look F.scaled_dot_product_attention up at call time: itself, once installed."""
    q, k, v = _qkv((1, 2, 3, 8), (1, 2, 4, 8))
    mask = torch.randn(3, 4, requires_grad=True)  # a learned mask: torch's
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert installed_drop_in == [False]
    assert torch.equal(out, torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_installed_drop_in_runs_a_transformer_layer(installed_drop_in):
    """nn.TransformerEncoderLayer (training mode: no fused fast path) reaches SDPA through torch.nn.functional."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                             batch_first=True)
    x = torch.randn(2, 10, 32)
    ours = layer(x)
    assert installed_drop_in and all(installed_drop_in)  # our kernel ran, every call
    F.scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention
    theirs = layer(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.sum().backward()  # and gradients flow through our backward
    assert all(p.grad is not None for p in layer.parameters())


# ---------------------------------------------------------------------------------------------------------
# attn_mask: refused before any kernel runs, with a message naming it, in eager, meta and fake mode alike.
# ---------------------------------------------------------------------------------------------------------
BAD_MASKS = [  # (id, mask, q dtype, exception, message fragment); q (2, 4, 5, 8), k (2, 4, 6, 8)
    ("int64", torch.ones(5, 6, dtype=torch.int64), torch.float32, TypeError, "attn_mask must be bool"),
    ("float64", torch.zeros(5, 6, dtype=torch.float64), torch.float32, TypeError, "attn_mask must be bool"),
    ("bf16 for float32 q", torch.zeros(5, 6, dtype=torch.bfloat16), torch.float32, TypeError, "q's dtype"),
    ("float16 for bf16 q", torch.zeros(5, 6, dtype=torch.float16), torch.bfloat16, TypeError, "q's dtype"),
    ("wrong Nk", torch.ones(5, 7, dtype=torch.bool), torch.float32, ValueError, "broadcastable"),
    ("wrong Nq", torch.ones(4, 6, dtype=torch.bool), torch.float32, ValueError, "broadcastable"),
    ("wrong heads", torch.ones(3, 5, 6, dtype=torch.bool), torch.float32, ValueError, "broadcastable"),
    ("too many dims", torch.ones(1, 2, 4, 5, 6, dtype=torch.bool), torch.float32, ValueError, "broadcastable"),
    ("on meta", torch.ones(5, 6, dtype=torch.bool, device="meta"), torch.float32, ValueError,
     "q and attn_mask must be on one device"),
    ("sparse", torch.ones(5, 6).to_sparse(), torch.float32, TypeError, "attn_mask must be a dense"),
]


@pytest.mark.parametrize("case", BAD_MASKS, ids=[c[0] for c in BAD_MASKS])
@pytest.mark.parametrize("mode", ["eager", "meta", "fake"])
def test_bad_masks(case, mode):
    _, mask, dtype, exc, fragment = case
    if mode != "eager" and (mask.is_sparse or mask.device.type == "meta"):
        pytest.skip("devices and layouts: eager only (a sparse or meta mask beside meta q has no dispatch key)")
    q, k, v = _qkv((2, 4, 5, 8), (2, 4, 6, 8), dtype)
    if mode == "meta":
        q, k, v, mask = (t.to("meta") for t in (q, k, v, mask))
    context = FakeTensorMode() if mode == "fake" else contextlib.nullcontext()
    with context:
        if mode == "fake":
            q, k, v, mask = (context.from_tensor(t) for t in (q, k, v, mask))
        with pytest.raises(exc, match=re.escape(fragment)):
            cs149gpt.attention(q, k, v, attn_mask=mask)


def test_mask_with_another_impl_or_not_a_tensor():
    q, k, v = _qkv((1, 2, 3, 8), (1, 2, 4, 8))
    with pytest.raises(ValueError, match="attn_mask needs impl='flash'"):
        cs149gpt.attention(q, k, v, impl="fused", attn_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        cs149gpt.attention(q, k, v, attn_mask=[[True] * 4] * 3)


def test_backward_refuses_a_bad_mask():
    q, k, v = _qkv((1, 2, 3, 8), (1, 2, 4, 8))
    out, lse = torch.ops.cs149gpt.flash_attention(q, k, v)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        torch.ops.cs149gpt.flash_attention_backward(out, q, k, v, out, lse, attn_mask=torch.ones(3, 5,
                                                                                                 dtype=torch.bool))
