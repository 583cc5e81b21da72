"""The Python face of cs149gpt: typed, documented wrappers over the compiled operators.

The operators themselves are declared in C++ (csrc/module.cpp, `TORCH_LIBRARY(cs149gpt, m)`) and reachable as
`torch.ops.cs149gpt.*`. This module adds what makes them first-class PyTorch: autograd for the flash kernel
(`torch.library.register_autograd`, backward from the saved lse) and fake implementations
(`torch.library.register_fake`) so `torch.compile(fullgraph=True)` traces through them.

Under torch.autocast every operator follows torch's SDPA (floating inputs cast to autocast's dtype, the output in
it; attention_with_kvcache casts to its caches' dtype instead): `attention` and `attention_with_kvcache` say how.
scaled_dot_product_attention's docstring gives the rest of torch's contract it keeps (CausalBias, sdpa_kernel,
TorchScript).

AOTInductor: a package (torch._inductor.aoti_compile_and_package) of a model that calls our operators names them
(cs149gpt::flash_attention, ...) without carrying them: the program that loads it (aoti_load_package) must
`import cs149gpt` first, which registers them; otherwise loading or the first call fails on an unknown operator.
"""
import contextlib
import math
from typing import Optional, Tuple, Union

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, CausalVariant

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
# Read at call time (torch.compile: when traced, as it reads them for torch's own SDPA). The SDPBackend our kernel
# stands in for is FLASH_ATTENTION: torch.nn.attention.sdpa_kernel turns it on and off with this flag.
_flash_sdp_enabled = torch._C._get_flash_sdp_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_is_scripting = torch.jit.is_scripting  # (TorchScript reads the alias as torch.jit.is_scripting: a static branch)
# A Python-side library for what this module defines itself: the autocast kernels of the C++ operators and the
# drop-in's own operator (cs149gpt::scaled_dot_product_attention, which TorchScript calls).
_lib = None


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
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(c(scale · q kᵀ) [+ ALiBi] [+ attn_mask] [+ causal mask]) v, computed by one of the ladder's kernels.

    Args:
        q: (..., Nq, d) queries, 2-D or more. Every input is read in place through its strides (a GPT's
            x.view(B, T, H, d).transpose(1, 2) included); the one copy ever made is of a tensor whose last dim is
            not contiguous.
        k, v: (..., Nk, d) keys and values with q's leading dims; Nk may differ from Nq. Their head dim (-3) may
            divide q's (GQA/MQA): query head h reads kv head h // (Hq // Hkv), without expanding k and v.
        impl: "naive" (N×N scores), "blocked" (tiled matmuls), "fused" (a row at a time), "flash_teaching"
            (FlashAttention's Algorithm 1 in the paper's names, float32) or "flash" (the fast kernel).
        scale: multiplies q·k; None means 1/sqrt(d), as in torch's scaled_dot_product_attention. It must be finite
            as a float32 (else ValueError).
        is_causal: False; True or "top_left": query i sees keys j <= i (torch SDPA's is_causal);
            "bottom_right": query i sees keys j <= i + Nk - Nq (torch.nn.attention.bias.causal_lower_right,
            what decoding with a KV cache needs). A query row that sees no key gets 0 and lse −inf (as torch >= 2.5).
        block_q, block_k: flash's Br × Bc tile (blocked: its one tile size), any >= 1, need not divide N; one
            larger than N means all of it. None picks defaults from the shape, the thread count and the ISA.
        return_lse: (flash only) also return lse, the float32 logsumexp of each query row's scaled, masked
            logits, (..., Nq): what the backward uses.
        attn_mask: (flash only) torch SDPA's: bool (True = the key takes part) or additive (float32 or q's dtype,
            added to the scaled logits; −inf hides a key), any shape broadcastable to (..., Nq, Nk) — (Nq, Nk),
            (B, 1, 1, Nk) key padding, (B, 1, Nq, Nk) transformers' padded causal masks, (1, H, Nq, Nk),
            (B, H, Nq, Nk) — read in place through its strides (stride 0 along broadcast dims: never expanded).
            Applied together with is_causal: a key must pass both, as in torch's CPU SDPA. A mask whose every row
            shows one run of consecutive keys (padding on either side, padding under a causal pattern, a band;
            bool, or additive of only 0 and −inf) is scanned once and reaches the kernels as a key range per row,
            its entries never read again; a bias over such runs (ALiBi, T5 under a causal or padding mask) shared
            by 4 or more (batch, head) pairs is read inside its runs only; a bias over every key is not scanned.
            Otherwise each (row group × key tile) block is classified as it is reached: hidden whole → skipped,
            shown whole → the unmasked code, partial → the mask added to S. Decoding calls (Nq <= 16) classify
            blocks of 64 keys per query row the same way. The mask gets no gradient: a float mask that requires
            grad is a ValueError (torch's scaled_dot_product_attention computes that one).
        window: (flash only) sliding-window (local) attention, FlashAttention's window_size (left, right):
            query i sees keys j with i + Nk - Nq - left <= j <= i + Nk - Nq + right; -1 leaves a side unbounded
            (None = (-1, -1)), and so does any bound past Nq + Nk, up to 2**63 - 1 (sys.maxsize; larger is a
            ValueError). Combines with is_causal and attn_mask; blocks outside the band are neither read nor
            computed, forward and backward.
        dropout_p: (flash only) dropout on the attention weights, in [0, 1): each weight is zeroed with that
            probability, the others scaled by 1 / (1 - dropout_p); lse stays that of the undropped weights. The
            keep mask is counter-based (csrc/attention.h, dropout_keep: splitmix64's finalizer of a seed-keyed
            Weyl counter over (batch, head, i, j), not Philox), its (seed, offset) drawn per call: on the CPU
            from torch's default generator; on CUDA from torch's default CUDA generator of q's device, as torch's
            CUDA SDPA takes its Philox pair (its seed and offset, the offset then advanced past the call's
            B·H·Nq·Nk counters). torch.manual_seed reproduces a call for any thread count; the backward
            regenerates the mask instead of storing it; a CUDA call and a CPU call given the same pair keep the
            same entries. Equal to torch's dropout in distribution, not in bits. Not inside CUDA graph capture
            (RuntimeError: torch's generator cannot be read there).
            cs149gpt._ext.load()._testing.dropout_keep_mask(seed, offset, shape, p) returns the mask (a test hook).
        softcap: (flash only) > 0: each scaled logit s becomes c(s) = softcap · tanh(s / softcap) (Gemma 2's and
            FlashAttention's softcap), before ALiBi and attn_mask are added; 0 (the default) leaves the logits as
            they are. A finite float >= 0, else ValueError. Its gradient flows through (1 − tanh²). Non-finite
            logits: a +inf or −inf product becomes ±softcap (finite, so it no longer turns its row NaN or weighs 0);
            NaN stays NaN; attn_mask's −inf is added after the cap and still hides its key.
        alibi_slopes: (flash only) ALiBi (BLOOM, MPT): float32 slopes of shape (Hq,) or (B, Hq) (q's leading dims
            then its heads), on q's device; query head h's logit of key j in row i gets
            −slope · |i + Nk − Nq − j| added (FlashAttention's definition: the distance to the bottom-right
            diagonal, whatever is_causal says). Computed inside the kernel, never materialised as an (Nq, Nk)
            bias. The slopes get no gradient (ValueError if they require grad) and stay float32 under autocast.

    Returns:
        out: (..., Nq, d) in q's dtype, laid out as torch's CPU SDPA lays it: dense in q's order of strides
            (empty_like(q)), so a (B, N, H·d) projection viewed as (B, H, N, d) gets (B, N, H, d) memory back and
            its out.transpose(1, 2).contiguous() is free; contiguous beyond 4 dims, when q's last dim is not its
            innermost, and on CUDA. (After upgrading cs149gpt, clear torch.compile's on-disk cache,
            /tmp/torchinductor_$USER, once: graphs cached with an older layout fail inductor's stride asserts.)
        or (out, lse) with return_lse=True.

    dtypes: float32 with every impl; bfloat16 and float16 with impl="flash" (arithmetic in float32, the output in
    the input dtype; cs149gpt.isa() says which kernel takes them). Other dtypes, or mixed ones: TypeError (under autocast, see below).

    CUDA tensors: impl="flash" only. bfloat16/float16 with head dim 64 or 128 run the tensor-core kernels (Hopper's
    where they take the call, else FlashAttention-2's), with every argument above — attn_mask, window, dropout_p,
    softcap, alibi_slopes, forward and backward — as on the CPU. float32 runs the teaching kernel: plain and
    causal attention, forward only; other arguments there are a NotImplementedError/ValueError from the op's check.

    Autograd: impl="flash" is differentiable in q, k and v (FlashAttention-2's backward from the saved lse; nothing
    N×N is saved). The other impls raise on backward rather than return missing gradients. The operators behind it,
    torch.ops.cs149gpt.attention, .flash_attention (→ out, lse) and .flash_attention_backward (→ dq, dk, dv), have
    autograd and fake implementations: torch.compile(fullgraph=True) traces through them, forward and backward, and
    torch.library.opcheck passes on each.

    Determinism: on the CPU every result's bits are the same for any thread count. On CUDA the backward sums each dQ
    row over key tiles with atomic additions in no fixed order, unless torch.use_deterministic_algorithms(True) is
    set: then every CUDA backward kernel adds them in key order (a counter per query tile that each key tile waits
    its turn on), bitwise repeatable and slower.

    Errors: bad input raises before any kernel runs, naming the argument and what was expected: ValueError
    (shapes, GQA, tiles, scale, tensors on different devices), TypeError (dtypes; sparse, nested or quantized
    tensors), IndexError, NotImplementedError (forward-mode AD), torch.OutOfMemoryError naming the sizes when an
    output, a copy or a workspace cannot fit in memory or its size would overflow int64 (e.g. expanded inputs).
    One C++ check, on symbolic sizes, serves the kernels and the fake implementations: eager, meta,
    FakeTensorMode and torch.compile refuse the same inputs with the same message.

    Threads: torch.set_num_threads(n) sets ours too (one OpenMP runtime); results are bitwise identical for any
    thread count.

    Memory: a call's workspace (packed K and V, per-thread tiles) comes from torch's allocator, except one of
    64 KB to 64 MB, kept from call to call in a mapping per calling thread (Linux), released when the thread ends
    and reported to the profiler as allocated and freed within each call (from the heap, such a buffer made a
    model's other tensors fault their pages in again every forward). A whole model still grows and trims
    glibc's heap by its activations every forward, with either attention; MALLOC_MMAP_THRESHOLD_=134217728
    MALLOC_TRIM_THRESHOLD_=1073741824 in the environment (or jemalloc, tcmalloc) keeps those pages.

    Non-finite values follow one rule in every impl, path, ISA and dtype (the README's table).

    Under torch.autocast (the device type of q): torch's SDPA rule, for every impl and argument. q, k, v and a
    floating attn_mask (float64 excepted, as autocast does) are cast to autocast's dtype and out is in it; lse
    stays float32. impl="flash" computes on the cast inputs; the float32-only impls ("naive", "blocked",
    "fused", "flash_teaching") compute in float32 from the cast values and return out in autocast's dtype. Mixed input dtypes are
    fine there (autocast makes them one).
    """
    if (attn_mask is None and window is None and dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
            and not torch.compiler.is_compiling()
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
    _check_number("scale", scale, float)
    for name, tile in (("block_q", block_q), ("block_k", block_k)):
        _check_number(name, tile, int)
        if isinstance(tile, int) and not isinstance(tile, bool) and not -_INT64_MAX - 1 <= tile <= _INT64_MAX:
            raise ValueError(f"{name} must be >= 1 and at most 2**63 - 1, got {tile}")  # (in int64: the op's check)
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0.0 and impl != "flash":
        raise ValueError(f"dropout_p needs impl='flash', got impl={impl!r}")
    if (window_left, window_right) != (-1, -1) and impl != "flash":
        raise ValueError(f"window needs impl='flash', got impl={impl!r}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise ValueError(f"softcap must be a finite float >= 0, got {softcap!r}")
    if softcap != 0.0 and impl != "flash":
        raise ValueError(f"softcap needs impl='flash', got impl={impl!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes must be a float32 torch.Tensor of shape (Hq,) or (B, Hq), or None; got "
                            f"{type(alibi_slopes).__name__}")
        if impl != "flash":
            raise ValueError(f"alibi_slopes needs impl='flash', got impl={impl!r}")
    _load()
    if any(t.layout != torch.strided or t.is_nested for t in (q, k, v)):
        # A jagged nested tensor is a Python subclass whose dispatch never reaches our kernels, which refuse
        # the other layouts themselves: the check names the argument (TypeError) for every one of them.
        _ext._module.check_attention(q, k, v, impl, scale, causal, block_q, block_k, attn_mask, window_left,
                                     window_right)
    # Dropout's counters: (batch, head, query row, key) of the scores, whose keep mask they number.
    seed = (_dropout_seed(q.device, (q.numel() // max(q.shape[-1], 1)) * k.shape[-2]) if dropout_p > 0.0
            else None)
    with _below_autograd_unless_needed(q, k, v):
        if impl == "flash":
            out, lse = torch.ops.cs149gpt.flash_attention(q, k, v, scale, causal, block_q, block_k, attn_mask,
                                                          window_left, window_right, float(dropout_p), seed,
                                                          float(softcap), alibi_slopes)
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
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """New queries against a KV cache (decoding, chunked prefill), the cache read in place, once per kv head.

    Args:
        q: (B, Hq, Nq, d) the new tokens' queries (Nq = 1 when decoding, more for a chunked prefill); Hq a
            multiple of Hkv.
        k_cache, v_cache: contiguous, (B, Hkv, max_len, d); or paged, (num_blocks, Hkv, block_size, d) with
            block_table. Rows must be contiguous (stride 1 in the last dim: the cache is written in place, no copy
            can stand in for it); any other strides.
        cache_seqlens: (B,) int32 or int64: sequence b's cache ends at row cache_seqlens[b] (not changed by the
            call).
        k_new, v_new: (B, Hkv, N_new, d), optional, any N_new: written into the caches, in place, at rows
            [cache_seqlens[b], cache_seqlens[b] + N_new) before attending, and seen too.
        block_table: (B, max_blocks) int32, a paged cache: logical block i of sequence b is physical block
            block_table[b, i] of k_cache and v_cache. Tables may share blocks (a common prefix), but a row a call
            appends must be seen by the appending sequence alone.
        scale: multiplies q·k; None means 1/sqrt(d).
        is_causal: query i of Nq sees keys j <= L_b − Nq + i (bottom-right aligned, j counted from
            cache_leftpad[b]); False: all L_b keys.
        cache_batch_idx: (B,) int32, contiguous caches only: sequence b reads (and appends to) row
            cache_batch_idx[b] of k_cache and v_cache (of any batch size), by address, never gathered; None: row b.
            Appending sequences need distinct rows.
        cache_leftpad: (B,) int32: sequence b's keys start at cache row cache_leftpad[b] (<= cache_seqlens[b]); the
            rows before it are never read. Keys are counted from there: sequence b sees
            L_b = cache_seqlens[b] − cache_leftpad[b] (+ N_new) keys. None: 0. Paged caches too.
        window: (left, right), a sliding window aligned as the causal mask: query i sees keys j with
            L_b − Nq + i − left <= j <= L_b − Nq + i + right; −1 leaves a side unbounded. None: no window.
        softcap, alibi_slopes: as attention()'s (FlashAttention's meaning, csrc/attention.h): ALiBi adds
            −slope · |L_b − Nq + i − j|, i and j counted as the window counts them; slopes (Hq,) or (B, Hq) float32.
        lse: optional (B, Hq, Nq) float32 contiguous tensor the logsumexp of each row's scaled logits is written to
            (−inf for a row that sees no key).

    Returns:
        out: (B, Hq, Nq, d), contiguous, in q's dtype (float32, bfloat16 or float16; the caches of the same dtype).
        A query that sees no key (an empty cache, or one its causal mask or window hides whole) gets 0.

    torch.ops.cs149gpt.attention_with_kvcache declares the caches it writes (Tensor(a!) k_cache, Tensor(b!) v_cache)
    and bumps their version counters; it has a fake implementation (opcheck passes, torch.compile traces a decode
    step). Bad input raises before anything is read or written: a block id or cache_batch_idx outside the cache
    (IndexError naming the entry), a length past the capacity (ValueError naming block_table for a paged cache,
    cache_seqlens else), a cache_leftpad past its sequence's length, dtype, shape or device mismatches, and, when
    appending, a cache whose elements share memory (an expanded view), one memory passed as both caches, two
    sequences appending into one cache row, or an appended row that another entry of the block tables also sees
    (ValueError naming both entries).

    The kernel (csrc/kernels/flash_decode.cpp, which attention() also uses for Nq <= 16 when no tiles are given)
    reads each cached key and value once per call, for all query heads of a GQA group and all Nq rows together,
    in their own dtype. The keys are split into tasks (batch, kv head, split) from the shape alone and the
    splits' partial softmaxes merged exactly in a fixed order, so results are bitwise the same for any thread
    count; calls that read less than 256 KB and do fewer than 2^19 multiply-adds run on the calling thread, larger
    ones on all of torch's threads.

    On CUDA tensors (csrc/cuda/flash_decode.cu; any of the three dtypes, head dim 64 or 128, the caches' rows 16-byte
    aligned) the same call, split over the GPU's SMs along the keys and merged through lse. There cache_seqlens,
    cache_leftpad, cache_batch_idx and block_table stay on the GPU (no synchronisation per step): their values are not
    checked as on the CPU but clamped into the cache, so a bad one gives a wrong answer, never an access outside it.

    Not differentiable: it has no backward, so a q, k_new or v_new (or cache) that requires grad, with grad mode
    on, is refused with a ValueError naming it (call it under torch.no_grad(), or pass .detach()).
    Under torch.autocast the caches keep their dtype, since they are written in place: q, k_new and v_new are
    cast to it (torch's SDPA would cast all of them to autocast's dtype; a cache cannot be), and out is in it.
    """
    if (not torch.compiler.is_compiling() and type(q) is _Tensor and type(k_cache) is _Tensor
            and type(v_cache) is _Tensor and type(cache_seqlens) is _Tensor and _registered
            and not _has_torch_function((q, k_cache, v_cache, cache_seqlens))):
        # Plain tensors in eager mode: the argument types, the autograd decision and the call in C++ (module.cpp,
        # kvcache_fast); None where the path below must decide (an argument to word, a gradient to refuse).
        result = _ext._module.kvcache_fast(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
                                           is_causal, cache_batch_idx, cache_leftpad, window, softcap, alibi_slopes,
                                           lse)
        if result is not None:
            return result
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"{name} requires grad, but attention_with_kvcache has no backward (its gradient "
                                 f"would silently be None); call it under torch.no_grad() or pass {name}.detach()")
    _load()
    window_left, window_right = _window(window)
    try:
        return torch.ops.cs149gpt.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                          block_table, scale, is_causal, cache_batch_idx,
                                                          cache_leftpad, window_left, window_right, float(softcap),
                                                          alibi_slopes, lse)
    except RuntimeError:
        # The dispatcher's schema error for an argument of the wrong type: checked here only once it failed (nothing
        # on the decoding path), to raise a TypeError naming the argument instead.
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}") from None
        for name, t in (("k_new", k_new), ("v_new", v_new), ("block_table", block_table),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("alibi_slopes", alibi_slopes), ("lse", lse)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}") from None
        _check_number("scale", scale, float)
        raise


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window: Optional[Tuple[int, int]] = None,
    dropout_p: float = 0.0,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Attention over sequences of different lengths packed one after another (FlashAttention's varlen layout).

    Sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and rows [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    of k and v; each attends to its own keys only. One kernel call takes every sequence: its tasks are (sequence,
    head, query tile), each reading its sequence in place, so nothing is padded and no (N, N) mask exists.

    Args:
        q: (total_q, Hq, d); k, v: (total_k, Hkv, d), Hq a multiple of Hkv (GQA/MQA). float32, bfloat16 or float16;
            any strides with the head_dim contiguous (else one copy is made).
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32 offsets, B >= 1, never decreasing, within total_q / total_k (rows
            outside every sequence get 0 out and 0 gradient). Sequences may be empty, all of them too (total_q or
            total_k 0: an empty out, or zeros with lse −inf; zero gradients), as in FlashAttention.
        max_seqlen_q, max_seqlen_k: bounds on the sequences' lengths (ValueError if a sequence is longer); the kernel
            sizes its work from the actual longest.
        scale: multiplies q·k; None means 1/sqrt(d).
        is_causal: query i of a sequence of Nq queries and Nk keys sees keys j <= i + Nk − Nq (bottom-right, per
            sequence, as FlashAttention); a row that sees no key gets 0 and lse −inf.
        window: (left, right) sliding window per sequence, FlashAttention's window_size (−1: unbounded side).
        dropout_p: dropout on the attention weights (training only; the mask is regenerated in the backward).
        softcap: > 0 caps each scaled logit s to softcap · tanh(s / softcap), as attention() does.
        alibi_slopes: (Hq,) or (B, Hq) float32: adds −slope · |i + Nk − Nq − j| in each sequence (FlashAttention's
            ALiBi), computed in the kernel.
        block_table: (B, max_blocks) int32, a paged KV cache (FlashAttention's): k and v are then
            (num_blocks, page_block_size, Hkv, d), and sequence b's keys are 0 .. cu_seqlens_k[b + 1] −
            cu_seqlens_k[b] − 1, key t at row t % page_block_size of block block_table[b, t // page_block_size]
            (cu_seqlens_k gives the lengths only). Sequences may share blocks (a common prefix). Each block a
            sequence uses must be in [0, num_blocks) (IndexError) and within the table's columns (ValueError).
            The kernel reads the keys through the table: one call prefills and decodes many sequences (a query
            length of 1 is a decode step). Inference only: it runs with grad mode on, but its backward raises. On
            CUDA: bfloat16 or float16 (NotImplementedError for float32); on sm_90, where the call is one Hopper's
            forward takes (d 64 or 128, no window, softcap, ALiBi or dropout), pages of a multiple of 128 rows whose
            rows follow one page after another in memory (k.stride(0) == page_block_size * k.stride(1)) are read a
            key tile per TMA copy; other pages by FlashAttention-2's forward, which gathers the rows.
        return_lse: also return lse, (Hq, total_q) float32.

    Differentiable in q, k and v (the backward is one kernel call too: a task per (sequence, kv head)); not with
    block_table.
    """
    if dropout_p < 0.0 or dropout_p >= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    left, right = _window(window)
    _load()
    # Dropout's counters: sequence b's rows start at cu_seqlens_q[b] · Hq · max_seqlen_k (csrc/attention.h).
    seed = (_dropout_seed(q.device, q.shape[0] * q.shape[1] * max(int(max_seqlen_k), 1)) if dropout_p > 0.0
            else None)
    out, lse = torch.ops.cs149gpt.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   scale, bool(is_causal), left, right, float(dropout_p), seed,
                                                   float(softcap), alibi_slopes, block_table)
    return (out, lse) if return_lse else out


def _dropout_seed(device: Optional[torch.device] = None, counters: int = 0) -> torch.Tensor:
    """(seed, offset) for one call's dropout, an int64 tensor of 2 on the CPU (the operators' dropout_seed), for a
    call on `device` whose keep mask numbers `counters` entries (csrc/attention.h, dropout_keep).

    CPU tensors: drawn from torch's default CPU generator (torch.manual_seed reproduces them; a traced graph draws
    them afresh on every run). CUDA tensors: torch's default CUDA generator of that device, as torch's own CUDA
    dropout and SDPA take their Philox (seed, offset): seed its seed, offset its offset, which is then advanced
    past the call's counters (rounded up to a multiple of 4, torch's rule for that offset), so torch.manual_seed
    (or torch.cuda.manual_seed) reproduces the call, the next call of ours draws past it, and a CUDA call keeps
    the same bits as a CPU call given the same pair. Under torch.compile the CPU draw, which is traced (the CUDA
    generator's offset cannot be). Not during CUDA graph capture: torch lets no one read the offset then
    (RuntimeError)."""
    if device is None or torch.device(device).type != "cuda" or torch.compiler.is_compiling():
        return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)
    seed, offset = _cuda_dropout_state(device)
    generator = torch.cuda.default_generators[_cuda_index(device)]
    generator.set_offset(offset + (max(int(counters), 1) + 3) // 4 * 4)
    return torch.tensor([seed, offset], dtype=torch.int64)


def _cuda_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_dropout_state(device) -> Tuple[int, int]:
    """(seed, offset) the next CUDA dropout call on `device` draws (_dropout_seed), as int64 values, without
    drawing them: what a test or return_attn_probs replays the keep mask from."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("dropout_p > 0 on CUDA tensors draws its (seed, offset) from torch's CUDA generator, "
                           "which cannot be read during CUDA graph capture; capture with dropout_p=0, or use "
                           "torch's scaled_dot_product_attention inside the graph")
    generator = torch.cuda.default_generators[_cuda_index(device)]
    seed = generator.initial_seed()  # uint64: as int64, the bits the kernels read back as uint64
    return (seed - 2**64 if seed >= 2**63 else seed), generator.get_offset()


def _next_dropout_seed(device) -> Tuple[int, int]:
    """(seed, offset) the next _dropout_seed(device, ...) returns, without drawing it (the keep mask's replay)."""
    if torch.device(device).type == "cuda":
        return _cuda_dropout_state(device)
    rng = torch.Generator().set_state(torch.get_rng_state())
    seed, offset = torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64, generator=rng).tolist()
    return seed, offset


def _check_number(name: str, value, kind: type) -> None:
    """A TypeError naming the argument for a value the operator's schema (int? or float?) would refuse with its
    schema dump: what it takes converts by __index__ (int) or __float__ (float)."""
    if value is not None and not hasattr(type(value), "__index__" if kind is int else "__float__"):
        raise TypeError(f"{name} must be {'an int' if kind is int else 'a float'} or None, got "
                        f"{type(value).__name__} {value!r}")


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

    Our kernel runs when it computes what torch would: an attn_mask torch takes (bool, float32 or q's dtype,
    broadcastable to (..., Nq, Nk), on q's device, not requiring grad), 0 <= dropout_p < 1 (our dropout, the same
    distribution as torch's, not the same bits: attention()'s dropout_p; on CUDA its (seed, offset) comes from
    torch's CUDA generator, and inside CUDA graph capture the call is torch's), tensors of one dtype among
    float32/bfloat16/float16 and at least 3 dims, no empty dim, k and v with q's head dim, equal head counts unless
    enable_gqa=True, a scale that is a finite float32, no forward-AD tangent. CUDA tensors: bfloat16/float16 with
    head dim 64 or 128 (the tensor-core kernels, which take masks and dropout as the CPU's do); float32 there is
    the teaching kernel (plain and causal only, slower than torch's), so torch keeps those calls.
    Every other call goes to torch's own function, captured at import (so installing this one as
    torch.nn.functional.scaled_dot_product_attention never recurses): for any input torch accepts it returns what
    torch returns (zeros for no keys, an empty tensor for no heads, nested tensors, a learned mask's gradient,
    dropout_p = 1, ...), for any other torch's error. Sparse and quantized tensors raise a TypeError naming the
    argument (torch raises a RuntimeError for them). `uses_our_kernel(...)` tells which path a call takes.

    Three calls that torch 2.13 refuses or gets wrong though they have one meaning are computed as the float64
    reference does: an attn_mask with is_causal=True on 3-D or 5-D inputs (torch: "Explicit attn_mask should not
    be set when is_causal=True"; on 4-D it applies both, as ours does everywhere), a 0-d or 1-d mask with
    enable_gqa=True (torch: IndexError), and is_causal=True with a scale <= 0 (torch: NaN).

    An eager call on plain tensors without dropout, masked or not, is decided and run in C++ (csrc's sdpa_fast,
    under the same conditions), which keeps a masked decoding step to a few microseconds of overhead.

    The rest of torch's contract:

    - CausalBias (torch.nn.attention.bias.causal_upper_left / causal_lower_right) as attn_mask: it is read as what
      it means, never as a tensor. Upper-left (or square) is is_causal=True; lower-right with sizes (Nq, Nk) runs
      our kernel's bottom-right alignment; both take the rule above (gradients and torch.compile included).
      is_causal=True beside one raises CausalBias's own ValueError; any other CausalBias (lower-right of other
      sizes, or a call ours does not take) goes to torch's own CausalBias handling.
    - torch.nn.attention.sdpa_kernel: ours stands in for SDPBackend.FLASH_ATTENTION. A selection without it (MATH
      only, EFFICIENT_ATTENTION, ...) hands every call to torch's function, with that selection's results and
      errors; one with it runs ours where the rule above says so, torch's (within the selection) otherwise.
      Under torch.compile the selection is read when the graph is traced, as torch reads it for its own SDPA: a
      `with sdpa_kernel(...)` inside the compiled function counts; one around a call of an already compiled
      graph does not.
    - torch.autocast (the device type of query): as torch's SDPA, query, key, value and a floating attn_mask
      (float64 excepted) are cast to autocast's dtype first, so the output is in it; then the rule above (mixed
      input dtypes under autocast run ours too).
    - TorchScript (torch.jit.script of nn.MultiheadAttention, nn.TransformerEncoderLayer, ... with ours
      installed): scripted code calls the operator torch.ops.cs149gpt.scaled_dot_product_attention, whose
      implementation is this function: ours or torch's by the same rule, gradients included. A scripted module
      saved with torch.jit.save names that operator: the process that loads it must import cs149gpt first.
    """
    if _is_scripting():
        return torch.ops.cs149gpt.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                               scale, enable_gqa)
    if (dropout_p == 0.0 and not torch.compiler.is_compiling() and type(query) is _Tensor and type(key) is _Tensor
            and type(value) is _Tensor and (attn_mask is None or (type(attn_mask) is _Tensor and not
                                                                  _has_torch_function((attn_mask,))))
            and not _has_torch_function((query, key, value)) and _flash_sdp_enabled()):
        # The common call, decided and run in C++ (module.cpp, sdpa_fast: the conditions of uses_our_kernel); None
        # when it is not ours to take there, or autograd must record it: then the path below decides. Under
        # autocast a call it takes is cast by the operator's autocast rule, as the path below would cast it.
        result = _ext._module.sdpa_fast(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        if result is not None:
            return result
    if _any_autocast():
        query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
    if isinstance(attn_mask, CausalBias):
        return _sdpa_causal_bias(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        _refuse_sparse_and_quantized(query, key, value)
    if not _ours(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    return attention(query, key, value, impl="flash", scale=scale, is_causal=is_causal, attn_mask=attn_mask,
                     dropout_p=float(dropout_p))


# Read once: torch.compile in torch 2.11 cannot trace torch._C._is_autocast_available (a graph break).
_AUTOCAST_DEVICE_TYPES = tuple(d for d in ("cpu", "cuda") if torch._C._is_autocast_available(d))


def _autocast_inputs(query, key, value, attn_mask):
    """(query, key, value, attn_mask) as torch's autocast hands them to its SDPA (a lower-precision op): under
    torch.autocast for query's device type, each floating tensor (float64 excepted) cast to autocast's dtype; a
    CausalBias and bool or integer tensors unchanged. Unchanged outside autocast."""
    if not isinstance(query, torch.Tensor):
        return query, key, value, attn_mask
    device_type = query.device.type
    if device_type not in _AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if (isinstance(t, torch.Tensor) and not isinstance(t, CausalBias) and t.is_floating_point()
                and t.dtype != torch.float64 and t.device.type == device_type):
            return t.to(dtype)
        return t

    return cast(query), cast(key), cast(value), cast(attn_mask)


def _causal_bias_mode(bias: CausalBias, query, key) -> Optional[str]:
    """The causal alignment a CausalBias means for these inputs, as torch's CausalBias handling reads it: "top_left"
    (upper-left, or any square one: torch's is_causal=True), "bottom_right" (lower-right of sizes (Nq, Nk)); None
    for anything else (lower-right of other sizes, which torch materialises and broadcasts; a bad variant)."""
    if bias.variant == CausalVariant.UPPER_LEFT or bias.seq_len_q == bias.seq_len_kv:
        return "top_left"
    if (bias.variant == CausalVariant.LOWER_RIGHT and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and query.dim() >= 2 and key.dim() >= 2
            and (bias.seq_len_q, bias.seq_len_kv) == (query.shape[-2], key.shape[-2])):
        return "bottom_right"
    return None


def _sdpa_causal_bias(query, key, value, bias, dropout_p, is_causal, scale, enable_gqa):
    """scaled_dot_product_attention with a CausalBias attn_mask: the causal alignment it means on our kernel, or
    torch's own CausalBias handling. torch dispatches a CausalBias only when it is called as
    torch.nn.functional.scaled_dot_product_attention, which ours is once installed; calling torch's function with
    one then would read the bias object's (uninitialised) storage as an additive mask."""
    if is_causal:
        raise ValueError("CausalBias should not be used with causal=True")  # torch's words (CausalBias._dispatch)
    mode = _causal_bias_mode(bias, query, key)
    if mode == "top_left":
        return scaled_dot_product_attention(query, key, value, None, dropout_p, True, scale, enable_gqa)
    if mode == "bottom_right" and _ours(query, key, value, None, dropout_p, False, scale, enable_gqa):
        return attention(query, key, value, impl="flash", scale=scale, is_causal="bottom_right",
                         dropout_p=float(dropout_p))
    if query.device.type == "cpu" and bias.variant == CausalVariant.LOWER_RIGHT:
        # torch's handling on the CPU (no fused kernel takes it there): the materialised mask, to torch's function
        # itself (CausalBias._dispatch would call torch.nn.functional's, ours once installed).
        return _torch_sdpa(query, key, value, attn_mask=bias._materialize(query.device), dropout_p=dropout_p,
                           is_causal=False, scale=scale, enable_gqa=enable_gqa)
    return type(bias)._dispatch(query, key, value, bias, dropout_p, False, scale, enable_gqa)


def _mask_is_ours(attn_mask, query, key) -> bool:
    """Whether our kernel computes what torch computes with this attn_mask: one torch accepts (bool, float32 or
    query's dtype, broadcastable to the scores (..., Nq, Nk)), a plain tensor on query's device (CPU or CUDA), and
    no gradient wanted for it."""
    if not (isinstance(attn_mask, torch.Tensor) and attn_mask.layout == torch.strided and not attn_mask.is_nested
            and attn_mask.device == query.device and attn_mask.device.type in ("cpu", "cuda")):
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
    """Whether scaled_dot_product_attention(...) with these arguments runs our kernel (else torch's), here and now:
    under the current torch.autocast (inputs as it casts them) and torch.nn.attention.sdpa_kernel selection (ours
    is FLASH_ATTENTION), with a CausalBias read as the causal alignment it means."""
    if _any_autocast():
        query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            return False  # a ValueError, as torch's
        mode = _causal_bias_mode(attn_mask, query, key)
        return mode is not None and _ours(query, key, value, None, dropout_p, mode == "top_left", scale, enable_gqa)
    return _ours(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _ours(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    """uses_our_kernel's rule for inputs as our kernel sees them: after autocast, attn_mask a tensor or None."""
    if not _flash_sdp_enabled():
        return False  # sdpa_kernel(...) without FLASH_ATTENTION, the backend ours stands in for: torch's
    tensors = (query, key, value)
    if not isinstance(is_causal, bool):
        return False
    if dropout_p != 0.0 and not (isinstance(dropout_p, (int, float)) and 0.0 < dropout_p < 1.0):
        return False  # torch's answer for p = 1, NaN, ...
    if (dropout_p != 0.0 and isinstance(query, torch.Tensor) and query.device.type == "cuda"
            and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing()):
        return False  # CUDA graph capture: torch's dropout reads its generator graph-safely, ours cannot
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
    'amx_emulated' when forced).

    One build carries every kernel five times — amx (AVX-512 + AMX-BF16 tiles), avx512_bf16 (AVX-512 +
    vdpbf16ps), avx512, avx2 (AVX2 + FMA), scalar (portable C++) — and takes the widest this CPU runs when the
    module loads (amx after asking Linux for the tile permission; if refused, avx512, and
    `cs149gpt._ext.load().amx_unavailable_reason()` says why). The environment variable CS149GPT_ISA=<name> forces
    one. The three AVX-512 tables differ only for bfloat16 (and, on amx, float16):

    - bfloat16 on amx / avx512_bf16: both products on bf16 operands with float32 accumulation (AMX tiles or
      vdpbf16ps), the online softmax in float32, P rounded to bf16 as torch does; the tests hold its error to at
      most 1.5× torch's own bf16 SDPA error. On a Xeon with AMX vdpbf16ps is slow, so such a CPU never picks
      avx512_bf16.
    - float16 on amx: the same tile kernel with each operand split exactly into two bf16 parts (hi = bf16(x),
      lo = bf16(x − hi)), since these CPUs have AMX-BF16 but no AMX-FP16; error at most 1.5× torch's float16 SDPA
      error and one float16 ulp. avx512_bf16 keeps float16 on the float32 kernel.
    - amx_emulated: the amx kernels with the tile instructions done in software (csrc/isa/amx_emulation.h), tens
      of times slower; never chosen by itself, it runs wherever avx512_bf16 does, so that the tests check the AMX
      code paths on CPUs without AMX.
    """
    _load()
    return _ext._module.isa()


def set_float32_products(how: str) -> None:
    """How the flash forward multiplies float32 where the CPU has AMX tiles (isa() == 'amx'), process-wide.

    'fma' or 'auto' (the default): float32 FMAs. 'bf16_tiles': the bf16 tile kernel, each operand split exactly
    into three bf16 parts (24 significant bits = 8 + 8 + 8; values below 2^-100 in magnitude keep bf16's 8) and
    the six largest of the nine part products kept (the three dropped lie below 2^-23 of Σ|q·k| together); its
    error is at most 1.5× torch's float32 SDPA error, lse within float32's tolerance, and its workspace 3× the FMA
    kernel's (K and V in three parts, 6 bytes a value). On a 16-core Xeon with AMX it is 1.1–1.25× faster than
    the FMA kernel on one thread at head_dim >= 96, about even at 64, and 0.7–0.97× on 8 and 16 threads, hence
    not the default (choosing by the call's thread count would make the results' bits depend on it).
    Elsewhere it changes nothing.
    """
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
    (q, k, v, scale, causal, block_q, block_k, attn_mask, window_left, window_right, dropout_p, dropout_seed, softcap,
     alibi_slopes) = inputs
    out, lse = output
    # lse (O(N)), never P (O(N²)); the mask as given; dropout's (seed, offset), from which its mask is regenerated
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, dropout_seed, alibi_slopes)
    ctx.scale, ctx.causal, ctx.block_q, ctx.block_k = scale, causal, block_q, block_k
    ctx.window, ctx.dropout_p, ctx.softcap = (window_left, window_right), dropout_p, softcap
    ctx.mark_non_differentiable(lse)


def _flash_backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, dropout_seed, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.cs149gpt.flash_attention_backward(
        dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.block_q, ctx.block_k, attn_mask, *ctx.window,
        ctx.dropout_p, dropout_seed, ctx.softcap, alibi_slopes)
    # attn_mask, alibi_slopes: no gradient (attention() refuses a mask that wants one, the op's check such slopes)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, dropout_p, dropout_seed, softcap,
     alibi_slopes, block_table) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, dropout_seed, alibi_slopes)
    ctx.args = (max_q, max_k, scale, causal, window_left, window_right, dropout_p)
    ctx.softcap, ctx.paged = softcap, block_table is not None
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, _dlse):
    if ctx.paged:  # the forward runs with grad mode on (FlashAttention's tests call it so); its backward does not exist
        raise RuntimeError("varlen_attention with block_table (a paged KV cache) has no backward: its inputs get no "
                           "gradient; call it under torch.no_grad() or detach them")
    q, k, v, out, lse, cu_q, cu_k, dropout_seed, alibi_slopes = ctx.saved_tensors
    max_q, max_k, scale, causal, window_left, window_right, dropout_p = ctx.args
    dq, dk, dv = torch.ops.cs149gpt.varlen_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right, dropout_p,
        dropout_seed, ctx.softcap, alibi_slopes)
    return (dq, dk, dv) + (None,) * 13


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


def _autocast_cast(t, device_type: str, dtype: torch.dtype):
    """t cast to dtype if autocast casts it: a floating tensor of that device type, not float64."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type):
        return t.to(dtype)
    return t


def _autocast_flash_attention(op, device_type, dtype, *args):
    """flash_attention under autocast: q, k, v and a floating attn_mask in autocast's dtype; alibi_slopes stay
    float32."""
    names = [a.name for a in op._schema.arguments]
    return op(*(a if name == "alibi_slopes" else _autocast_cast(a, device_type, dtype) for name, a in zip(names, args)))


def _autocast_attention(op, device_type, dtype, q, k, v, impl, *rest):
    """attention under autocast: q, k, v in autocast's dtype; the float32-only impls compute in float32 from
    those values and return out in autocast's dtype, as the flash one does."""
    q, k, v = (_autocast_cast(t, device_type, dtype) for t in (q, k, v))
    if impl == "flash" or q.dtype != dtype:  # (float64 inputs: not autocast's to cast; the kernels refuse them)
        return op(q, k, v, impl, *rest)
    return op(q.float(), k.float(), v.float(), impl, *rest).to(dtype)


def _autocast_attention_with_kvcache(op, device_type, dtype, q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                     *rest):
    """attention_with_kvcache under autocast: the caches are written in place, so they keep their dtype, and q,
    k_new, v_new are cast to it instead of autocast's."""
    if isinstance(k_cache, torch.Tensor) and k_cache.is_floating_point():
        q, k_new, v_new = (_autocast_cast(t, device_type, k_cache.dtype) for t in (q, k_new, v_new))
    return op(q, k_cache, v_cache, cache_seqlens, k_new, v_new, *rest)


def _register_autocast(name: str, rule) -> None:
    """rule(op, device_type, dtype, *args) as the operator's kernel under torch.autocast, for each device type
    with autocast (what torch.library.register_autocast does, with autocast's dtype read at the call rather than
    fixed). The operator runs below autocast inside."""
    op = getattr(torch.ops.cs149gpt, name).default
    for device_type in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device_type):
            continue
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)

        def kernel(*args, _device_type=device_type, _key=key, **kwargs):
            # The dispatcher leaves out trailing arguments at their defaults: the rule gets every one.
            args = (*args, *(kwargs.get(a.name, a.default_value) for a in op._schema.arguments[len(args):]))
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_key)):
                return rule(op, _device_type, torch.get_autocast_dtype(_device_type), *args)

        if op.has_kernel_for_dispatch_key(key):  # (the Python dispatcher's copy, used while tracing)
            op.py_kernels.pop(key)
        op.py_impl(key)(kernel)
        _lib.impl(name, kernel, key_name)


def _register_python_parts() -> None:
    lib = "cs149gpt::"

    # One source for the checks: the fakes (which torch.library also installs as the meta kernels) call the very
    # C++ function the CPU kernels call, written on symbolic sizes, so eager, meta, FakeTensorMode and torch.compile
    # (dynamic shapes included) refuse the same inputs with the same message. A Python copy of the checks would
    # drift from the C++ one; C++ Meta kernels would have to compute the output shapes a second time, in C++.
    checks = _ext._module

    global _lib
    _lib = torch.library.Library("cs149gpt", "FRAGMENT")
    # Under torch.autocast the operators follow torch's SDPA (a lower-precision op there): inputs in autocast's
    # dtype, whatever it is, and mixed input dtypes made one (a GPT's q and k out of float32 rotary tables, v
    # straight from a bf16 Linear).
    _register_autocast("flash_attention", _autocast_flash_attention)
    _register_autocast("attention", _autocast_attention)
    _register_autocast("attention_with_kvcache", _autocast_attention_with_kvcache)
    _register_autocast("varlen_attention", _autocast_flash_attention)
    # The drop-in as an operator, for TorchScript (scaled_dot_product_attention's scripted branch): a Python
    # decomposition, so autograd records what it runs (ours or torch's), as in eager mode.
    _lib.define("scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
                "float dropout_p=0.0, bool is_causal=False, float? scale=None, bool enable_gqa=False) -> Tensor")
    _lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "CompositeImplicitAutograd")

    @torch.library.register_fake(lib + "attention")
    def _(q, k, v, impl="flash", scale=None, causal="none", block_q=None, block_k=None):
        checks.check_attention(q, k, v, impl, scale, causal, block_q, block_k)
        return _out_like(q)

    @torch.library.register_fake(lib + "flash_attention")
    def _(q, k, v, scale=None, causal="none", block_q=None, block_k=None, attn_mask=None, window_left=-1,
          window_right=-1, dropout_p=0.0, dropout_seed=None, softcap=0.0, alibi_slopes=None):
        checks.check_attention(q, k, v, "flash", scale, causal, block_q, block_k, attn_mask, window_left, window_right,
                               dropout_p, dropout_seed, softcap, alibi_slopes)
        return _out_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.register_fake(lib + "flash_attention_backward")
    def _(dout, q, k, v, out, lse, scale=None, causal="none", block_q=None, block_k=None, attn_mask=None,
          window_left=-1, window_right=-1, dropout_p=0.0, dropout_seed=None, softcap=0.0, alibi_slopes=None):
        checks.check_attention_backward(dout, q, k, v, out, lse, scale, causal, block_q, block_k, attn_mask,
                                        window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes)
        return _grad_like(q), _grad_like(k), _grad_like(v)

    @torch.library.register_fake(lib + "attention_with_kvcache")
    def _(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, block_table=None, scale=None, is_causal=True,
          cache_batch_idx=None, cache_leftpad=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
          lse=None):
        checks.check_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
                                            cache_batch_idx, cache_leftpad, window_left, window_right, softcap,
                                            alibi_slopes, lse)
        return q.new_empty(q.shape)

    @torch.library.register_fake(lib + "varlen_attention")
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None, causal=False, window_left=-1,
          window_right=-1, dropout_p=0.0, dropout_seed=None, softcap=0.0, alibi_slopes=None, block_table=None):
        checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                            window_left, window_right, dropout_p, dropout_seed, softcap, alibi_slopes, block_table)
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @torch.library.register_fake(lib + "varlen_attention_backward")
    def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None, causal=False,
          window_left=-1, window_right=-1, dropout_p=0.0, dropout_seed=None, softcap=0.0, alibi_slopes=None):
        checks.check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     scale, causal, window_left, window_right, dropout_p, dropout_seed, softcap,
                                     alibi_slopes)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @torch.library.register_fake(lib + "merge_partial_")
    def _(out, lse, out_block, lse_block):
        checks.check_merge(out, lse, out_block, lse_block)

    torch.library.register_autograd(lib + "flash_attention", _flash_backward, setup_context=_flash_setup_context)
    torch.library.register_autograd(lib + "varlen_attention", _varlen_backward, setup_context=_varlen_setup_context)
    # Gradients that would otherwise be silently missing (None) or zero raise instead.
    torch.library.register_autograd(lib + "attention", _not_differentiable("torch.ops.cs149gpt.attention"))
    torch.library.register_autograd(lib + "varlen_attention_backward", _not_differentiable(
        "the varlen backward itself (a double backward)"))
    torch.library.register_autograd(lib + "flash_attention_backward", _not_differentiable(
        "the flash backward itself (a double backward)"))


# Loaded when the package is imported (compiled then, the first time): code that torch.compile traces must not be
# the first to call into the extension, since loading it cannot happen inside a traced graph.
_load()
