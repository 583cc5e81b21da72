"""The Python face of cs149gpt: typed, documented wrappers over the compiled operators.

The operators themselves are declared in C++ (csrc/module.cpp, `TORCH_LIBRARY(cs149gpt, m)`) and reachable as
`torch.ops.cs149gpt.*`. This module adds what makes them first-class PyTorch: autograd for the flash kernel
(`torch.library.register_autograd`, backward from the saved lse) and fake implementations
(`torch.library.register_fake`) so `torch.compile(fullgraph=True)` traces through them.
"""
import contextlib
import math
from typing import Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from cs149gpt import _ext

IMPLS = ("naive", "blocked", "fused", "flash", "flash_teaching")
_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A scale from here up (FLT_MAX + half an ulp) rounds to inf as a float32, which is what the kernels take it as.
_FLOAT32_OVERFLOW = float.fromhex("0x1.ffffffp+127")
_INT64_MAX = 2**63 - 1  # the operators take ints as int64

# torch's own SDPA, captured when this module is imported: our drop-in falls back to it. Looking it up on
# torch.nn.functional at call time would find ourselves once a user installs the drop-in there
# (F.scaled_dot_product_attention = cs149gpt.scaled_dot_product_attention), and recurse forever.
_torch_sdpa = F.scaled_dot_product_attention


_registered = False
_Tensor = torch.Tensor
_has_torch_function = torch._C._has_torch_function


def _load() -> None:
    """Loads the compiled operators (building them on first use) and registers their Python parts, once."""
    global _registered
    # A plain global test, which torch.compile treats as a constant: no graph break after the first call.
    if not _registered:
        _ext.load()
        _register_python_parts()
        _registered = True


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: str = "flash",
    scale: Optional[float] = None,
    is_causal: Union[bool, str] = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    return_lse: bool = False,
    attn_mask: Optional[torch.Tensor] = None,
    window: Optional[Tuple[int, int]] = None,
    dropout_p: float = 0.0,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(scale · q kᵀ [+ attn_mask] [+ causal mask]) v, computed by one of the four kernels.

    Args:
        q: (..., Nq, d) queries, any strides (the last dim is read in place when contiguous).
        k, v: (..., Nk, d) keys and values with q's leading dims; their head dim (-3) may divide q's (GQA:
            query head h reads kv head h // (Hq // Hkv)), read without expanding.
        impl: "naive" (N×N scores), "blocked" (tiled matmuls), "fused" (a row at a time), "flash", or
            "flash_teaching" (the readable flash forward, float32, no mask, window, dropout, lse or gradient).
        scale: multiplies q·k; None means 1/sqrt(d), as in torch's scaled_dot_product_attention.
        is_causal: False; True or "top_left": query i sees keys j <= i (torch SDPA's is_causal);
            "bottom_right": query i sees keys j <= i + Nk - Nq (torch.nn.attention.bias.causal_lower_right,
            what decoding with a KV cache needs). A query row that sees no key gets 0.
        block_q, block_k: flash's Br × Bc tile (blocked: its one tile size); None picks measured defaults.
        return_lse: also return lse, the float32 logsumexp of each query row's scaled logits, (..., Nq)
            (flash only).
        attn_mask: (flash only) torch SDPA's: bool (True = the key takes part) or additive (float32 or q's
            dtype, added to the scaled logits; −inf hides a key), any shape broadcastable to (..., Nq, Nk), read
            in place through its strides. Applied together with is_causal. It gets no gradient: a float mask
            that requires grad is refused (torch's SDPA computes that one).
        window: (flash only) sliding-window (local) attention, FlashAttention's window_size (left, right):
            query i sees keys j with i + Nk - Nq - left <= j <= i + Nk - Nq + right; -1 leaves a side unbounded
            (None = (-1, -1)), and so does a bound past Nq + Nk (sys.maxsize too). Applied together with
            is_causal and attn_mask; key tiles outside the band are skipped, forward and backward.
        dropout_p: (flash only) dropout on the attention weights, in [0, 1): each weight is zeroed with that
            probability, the others scaled by 1 / (1 - dropout_p); lse stays that of the undropped weights. The
            mask comes from a counter-based generator keyed by a (seed, offset) drawn from torch's default
            generator (torch.manual_seed reproduces it), which the backward regenerates. Equal to torch's dropout
            in distribution, not in bits.

    Returns:
        out: (..., Nq, d), laid out as torch's SDPA output (empty_like(q); README, "Shapes"), in q's dtype
            (float32; also bfloat16/float16 with impl="flash");
        or (out, lse) with return_lse=True. With impl="flash" out is differentiable in q, k and v.
    """
    if (attn_mask is None and window is None and dropout_p == 0.0 and not torch.compiler.is_compiling()
            and type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and _registered
            and not _has_torch_function((q, k, v))):
        # Plain tensors in eager mode: the checks, the autograd decision and the call in C++ (module.cpp); None
        # when this path does not apply (an argument to refuse, autograd to record): then the one below.
        result = _ext._module.attention_fast(q, k, v, impl, scale, is_causal, block_q, block_k, return_lse)
        if result is not None:
            return result
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(i) for i in IMPLS)}; got {impl!r}")
    causal = _causal_mode(is_causal)
    if return_lse and impl != "flash":
        raise ValueError(f"return_lse=True needs impl='flash', got impl={impl!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if impl != "flash":
            raise ValueError(f"attn_mask needs impl='flash', got impl={impl!r}")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise ValueError("attn_mask requires grad, but the flash kernel computes no gradient for it; pass "
                             "attn_mask.detach() (or use torch's scaled_dot_product_attention for a learned mask)")
    window_left, window_right = _window(window)
    for name, tile in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(tile, int) and not isinstance(tile, bool) and not -_INT64_MAX - 1 <= tile <= _INT64_MAX:
            raise ValueError(f"{name} must be >= 1 and at most 2**63 - 1, got {tile}")  # (in int64: the op's check)
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0 and impl != "flash":
        raise ValueError(f"dropout_p needs impl='flash', got impl={impl!r}")
    if (window_left, window_right) != (-1, -1) and impl != "flash":
        raise ValueError(f"window needs impl='flash', got impl={impl!r}")
    _load()
    if any(t.layout != torch.strided or t.is_nested for t in (q, k, v)):
        # A jagged nested tensor is a Python subclass whose dispatch never reaches our kernels, which refuse
        # the other layouts themselves: the check names the argument (TypeError) for every one of them.
        _ext._module.check_attention(q, k, v, impl, scale, causal, block_q, block_k, attn_mask, window_left,
                                     window_right)
    seed = _dropout_seed() if dropout_p > 0.0 else None
    with _below_autograd_unless_needed(q, k, v):
        if impl == "flash":
            out, lse = torch.ops.cs149gpt.flash_attention(q, k, v, scale, causal, block_q, block_k, attn_mask,
                                                          window_left, window_right, float(dropout_p), seed)
            return (out, lse) if return_lse else out
        return torch.ops.cs149gpt.attention(q, k, v, impl, scale, causal, block_q, block_k)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = True,
) -> torch.Tensor:
    """New queries against a KV cache (decoding, chunked prefill), the cache read in place, once per kv head.

    Args:
        q: (B, Hq, Nq, d) the new tokens' queries (Nq = 1 when decoding); Hq a multiple of Hkv.
        k_cache, v_cache: contiguous, (B, Hkv, max_len, d); or paged, (num_blocks, Hkv, block_size, d) with
            block_table. Rows must be contiguous (stride 1 in the last dim); any other strides.
        cache_seqlens: (B,) int32 or int64, the keys already cached for each sequence.
        k_new, v_new: (B, Hkv, Nq, d), optional: written into the caches, in place, at rows
            [cache_seqlens[b], cache_seqlens[b] + Nq) before attending; the queries then see
            L_b = cache_seqlens[b] + Nq keys (else cache_seqlens[b]). cache_seqlens itself is not changed.
        block_table: (B, max_blocks) int32, a paged cache: logical block i of sequence b is physical block
            block_table[b, i] of k_cache and v_cache.
        scale: multiplies q·k; None means 1/sqrt(d).
        is_causal: query i of Nq sees keys j <= L_b − Nq + i (bottom-right aligned); False: all L_b keys.

    Returns:
        out: (B, Hq, Nq, d), contiguous, in q's dtype (float32, bfloat16 or float16; k, v of the same dtype).
        A query that sees no key (an empty cache) gets 0. Not differentiable.
    """
    _load()
    return torch.ops.cs149gpt.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                      block_table, scale, is_causal)


def _dropout_seed() -> torch.Tensor:
    """(seed, offset) for one call's dropout, drawn from torch's default CPU generator (torch.manual_seed
    reproduces them; a traced graph draws them afresh on every run)."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)


def _window(window) -> Tuple[int, int]:
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right), got {window!r}")
    if min(window) < -1 or max(window) > _INT64_MAX:
        raise ValueError(f"window must be (left, right) with each >= 0, or -1 for no bound on that side, and at "
                         f"most 2**63 - 1; got {tuple(window)}")
    return int(window[0]), int(window[1])


def _refuse_sparse_and_quantized(q, k, v) -> None:
    """Sparse and quantized tensors: a TypeError naming the argument, from the C++ check (the one source of our
    messages; the operators raise the same), where torch's SDPA would raise a RuntimeError of its own. Nested
    tensors are torch's SDPA's to take."""
    if any(t.layout not in (torch.strided, torch.jagged) or t.is_quantized for t in (q, k, v)):
        _ext._module.check_attention(q, k, v, "flash", None, "none", None, None)


def _has_tangent(*tensors) -> bool:
    """Whether a tensor carries a forward-mode AD tangent (torch.autograd.forward_ad, torch.func.jvp): our ops
    refuse it (no forward derivative: module.cpp, refuse_forward_ad); the SDPA drop-in hands it to torch."""
    if fwAD._current_level < 0:  # no dual level open: the common case, one global read
        return False
    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def _below_autograd_unless_needed(q, k, v):
    """When no gradient can flow, dispatch straight to the kernel, past the autograd layer.

    The autograd registered in Python costs about 10 µs a call even when nothing requires grad: as much as the
    kernel itself for one decoding step against a short KV cache. torch.compile traces the plain path.
    """
    needs_autograd = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_autograd or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, with its signature and meaning, on our flash kernel.

    Our kernel runs when it computes what torch would: an attn_mask torch takes (bool, float32 or q's
    dtype, broadcastable to (..., Nq, Nk); CPU only, not requiring grad), 0 <= dropout_p < 1 (CPU: our dropout,
    the same distribution as torch's, not the same bits; CUDA: 0 only), CPU tensors of
    one dtype among float32/bfloat16/float16 and at least 3 dims, no empty dim, k and v with q's head dim,
    equal head counts unless enable_gqa=True, a scale that is a finite float32, no forward-AD tangent; CUDA
    tensors only in bfloat16/float16 with head dim 64 or 128 (float32 there is the teaching kernel, slower than
    torch's). Any other
    call goes to torch's own function (captured at import, so installing this one as
    torch.nn.functional.scaled_dot_product_attention is safe): same results, same errors. Sparse and quantized
    tensors raise a TypeError naming the argument (torch raises a RuntimeError for them).
    `uses_our_kernel(...)` tells which path a call takes.
    """
    if (dropout_p == 0.0 and not torch.compiler.is_compiling() and type(query) is _Tensor and type(key) is _Tensor
            and type(value) is _Tensor and (attn_mask is None or (type(attn_mask) is _Tensor and not
                                                                  _has_torch_function((attn_mask,))))
            and not _has_torch_function((query, key, value))):
        # The common call, decided and run in C++ (module.cpp, sdpa_fast: the conditions of uses_our_kernel); None
        # when it is not ours to take there, or autograd must record it: then the path below decides.
        result = _ext._module.sdpa_fast(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        if result is not None:
            return result
    if all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        _refuse_sparse_and_quantized(query, key, value)
    if not uses_our_kernel(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return attention(query, key, value, impl="flash", scale=scale, is_causal=is_causal, attn_mask=attn_mask,
                     dropout_p=float(dropout_p))


def _mask_is_ours(attn_mask, query, key) -> bool:
    """Whether our kernel computes what torch computes with this attn_mask: one torch accepts (bool, float32 or
    query's dtype, broadcastable to the scores (..., Nq, Nk)), a plain CPU tensor, and no gradient wanted for it."""
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.layout == torch.strided and not attn_mask.is_nested
            and attn_mask.device == query.device and attn_mask.device.type == "cpu"):
        return False
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        return False
    if attn_mask.requires_grad and torch.is_grad_enabled():
        return False  # a learned mask: torch's SDPA computes its gradient, ours would not
    scores = (*query.shape[:-1], key.shape[-2])
    if attn_mask.dim() > len(scores):
        return False
    return all(m == 1 or m == s for m, s in zip(reversed(attn_mask.shape), reversed(scores)))


def uses_our_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False) -> bool:
    """Whether scaled_dot_product_attention(...) with these arguments runs our kernel (else torch's)."""
    tensors = (query, key, value)
    if not isinstance(is_causal, bool):
        return False
    if dropout_p != 0.0 and not (isinstance(dropout_p, (int, float)) and 0.0 < dropout_p < 1.0
                                 and query.device.type == "cpu"):
        return False  # torch's answer for p = 1, NaN, ...; our CUDA kernels have no dropout
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                  and abs(scale) < _FLOAT32_OVERFLOW):
        return False  # torch computes something (NaN, inf, ...) where our check refuses: torch's answer
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested
               and t.device.type in ("cpu", "cuda") and t.device == query.device and t.dim() >= 3 for t in tensors):
        return False
    # On the GPU: the tensor-core kernels (bfloat16/float16, d 64 or 128); float32 there is the teaching kernel,
    # slower than torch's, so torch keeps it.
    if query.device.type == "cuda" and (query.dtype == torch.float32 or query.shape[-1] not in (64, 128)):
        return False
    if torch.overrides.has_torch_function(tensors if attn_mask is None else (*tensors, attn_mask)):
        return False  # a tensor subclass sees torch's SDPA in its __torch_function__, as it would without us
    if query.dtype not in _FLASH_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if not (query.dim() == key.dim() == value.dim()) or key.shape != value.shape:
        return False
    if key.shape[-1] != query.shape[-1] or key.shape[:-3] != query.shape[:-3]:
        return False  # torch broadcasts the leading dims; we do not
    if min(query.shape[-2:]) == 0 or key.shape[-2] == 0:
        return False  # torch returns an empty result, or zeros for no keys
    h_q, h_kv = query.shape[-3], key.shape[-3]
    if h_kv == 0 or not (h_q == h_kv or (enable_gqa and h_q % h_kv == 0)):
        return False
    if attn_mask is not None and not _mask_is_ours(attn_mask, query, key):
        return False
    return not _has_tangent(*tensors if attn_mask is None else (*tensors, attn_mask))  # torch says what forward-mode AD does with its own SDPA


def isa() -> str:
    """The instruction set the kernels run with: 'amx', 'avx512_bf16', 'avx512', 'avx2' or 'scalar' (or
    'amx_emulated', the amx kernels with the tiles done in software, when a test forces it).

    amx and avx512_bf16 are avx512 plus bf16 dot-product instructions (AMX tiles, vdpbf16ps), which the flash
    kernel uses for bfloat16 inputs. On a CPU with AMX whose kernel refuses the tile permission, the reason is
    in `cs149gpt._ext.load().amx_unavailable_reason()`.
    """
    _load()
    return _ext._module.isa()


def set_float32_products(how: str) -> None:
    """How the flash forward multiplies float32 where the CPU has AMX tiles: 'fma' or 'auto' (the default) in
    float32 FMAs; 'bf16_tiles' on the bf16 tiles with every operand split into three bf16 parts, exactly, and the
    six largest of the nine part products kept: float32-class results (in the tests at most 1.5× torch's float32
    SDPA error), except that values below 2^-100 in magnitude keep bf16's 8 significant bits.
    Measured on a 16-CPU Xeon with AMX (README, "float32 on the AMX tiles"): 'bf16_tiles' 1.1–1.25× faster on one
    thread at head_dim ≥ 96, about even at 64, 0.7–0.97× on 8 and 16 threads.
    Elsewhere it changes nothing. Process-wide."""
    _load()
    _ext._module.set_float32_products(how)


def _causal_mode(is_causal: Union[bool, str]) -> str:
    if is_causal is True:
        return "top_left"
    if is_causal is False or is_causal is None:
        return "none"
    if is_causal in ("top_left", "bottom_right"):
        return is_causal
    raise ValueError(f"is_causal must be False, True, 'top_left' or 'bottom_right'; got {is_causal!r}")


# ---------------------------------------------------------------------------------------------------------
# Autograd and fake (meta) implementations of the C++ operators. Registered once, when the module loads.
# ---------------------------------------------------------------------------------------------------------
def _flash_setup_context(ctx, inputs, output):
    q, k, v, scale, causal, block_q, block_k, attn_mask, window_left, window_right, dropout_p, dropout_seed = inputs
    out, lse = output
    # lse (O(N)), never P (O(N²)); the mask as given; dropout's (seed, offset), from which its mask is regenerated
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, dropout_seed)
    ctx.scale, ctx.causal, ctx.block_q, ctx.block_k = scale, causal, block_q, block_k
    ctx.window, ctx.dropout_p = (window_left, window_right), dropout_p
    ctx.mark_non_differentiable(lse)


def _flash_backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, dropout_seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.cs149gpt.flash_attention_backward(
        dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.block_q, ctx.block_k, attn_mask, *ctx.window,
        ctx.dropout_p, dropout_seed)
    # attn_mask: no gradient (attention() refuses one that wants it)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _out_like(q: torch.Tensor) -> torch.Tensor:
    """The output of query q as module.cpp (empty_out_like) lays it out on the CPU, like torch's CPU attention: dense
    in q's order of strides (empty_like) up to 4 dims where that keeps head_dim innermost; contiguous otherwise, and
    on CUDA."""
    if q.device.type == "cpu" and q.dim() <= 4:
        out = torch.empty_like(q)
        if out.stride(-1) == 1:
            return out
    return q.new_empty(q.shape)


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """The flash backward's gradient of t, as module.cpp (empty_grad_like) lays it out: on the CPU, (..., N, H, d) in
    memory when t keeps its heads inside its tokens (head stride below row stride), like torch's CPU attention;
    contiguous otherwise, and always on CUDA."""
    n = t.dim()
    if (t.device.type == "cpu" and n >= 3 and t.size(-3) > 1 and t.size(-2) > 1
            and t.stride(-3) < t.stride(-2)):
        return t.new_empty((*t.shape[:-3], t.size(-2), t.size(-3), t.size(-1))).transpose(-3, -2)
    return t.new_empty(t.shape)


def _not_differentiable(what: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"{what} is not differentiable: only cs149gpt.attention(impl='flash') "
                           "(torch.ops.cs149gpt.flash_attention) has a backward pass")

    return backward


def _register_python_parts() -> None:
    lib = "cs149gpt::"

    # One source for the checks: the fakes (which torch.library also installs as the meta kernels) call the very
    # C++ function the CPU kernels call, written on symbolic sizes, so eager, meta, FakeTensorMode and torch.compile
    # (dynamic shapes included) refuse the same inputs with the same message. A Python copy of the checks would
    # drift from the C++ one; C++ Meta kernels would have to compute the output shapes a second time, in C++.
    checks = _ext._module

    # Under torch.autocast("cpu") the flash op runs in bfloat16, as torch's SDPA does there: its inputs may arrive
    # in mixed dtypes (a GPT's q and k out of float32 rotary tables, v straight from a bf16 Linear).
    torch.library.register_autocast(lib + "flash_attention", "cpu", torch.bfloat16)

    @torch.library.register_fake(lib + "attention")
    def _(q, k, v, impl="flash", scale=None, causal="none", block_q=None, block_k=None):
        checks.check_attention(q, k, v, impl, scale, causal, block_q, block_k)
        return _out_like(q)

    @torch.library.register_fake(lib + "flash_attention")
    def _(q, k, v, scale=None, causal="none", block_q=None, block_k=None, attn_mask=None, window_left=-1,
          window_right=-1, dropout_p=0.0, dropout_seed=None):
        checks.check_attention(q, k, v, "flash", scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                               dropout_p, dropout_seed)
        return _out_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.register_fake(lib + "flash_attention_backward")
    def _(dout, q, k, v, out, lse, scale=None, causal="none", block_q=None, block_k=None, attn_mask=None,
          window_left=-1, window_right=-1, dropout_p=0.0, dropout_seed=None):
        checks.check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask,
                                        window_left, window_right, dropout_p, dropout_seed)
        return _grad_like(q), _grad_like(k), _grad_like(v)

    @torch.library.register_fake(lib + "attention_with_kvcache")
    def _(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None, scale=None, is_causal=True):
        checks.check_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale)
        return q.new_empty(q.shape)

    torch.library.register_autograd(lib + "flash_attention", _flash_backward, setup_context=_flash_setup_context)
    # Gradients that would otherwise be silently missing (None) or zero raise instead.
    torch.library.register_autograd(lib + "attention", _not_differentiable("torch.ops.cs149gpt.attention"))
    torch.library.register_autograd(lib + "flash_attention_backward", _not_differentiable(
        "the flash backward itself (a double backward)"))


# Loaded when the package is imported (compiled then, the first time): code that torch.compile traces must not be
# the first to call into the extension, since loading it cannot happen inside a traced graph.
_load()
