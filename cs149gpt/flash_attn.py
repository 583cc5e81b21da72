"""FlashAttention-2's Python API over cs149gpt's kernels, on the CPU and on CUDA tensors.

Code written for the flash-attn package runs on cs149gpt by changing its import:

    from cs149gpt.flash_attn import flash_attn_func, flash_attn_with_kvcache   # was: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)                                # q, k, v: (batch, seqlen, heads, d)

Tensors keep FlashAttention's layout, (batch, seqlen, heads, head_dim). They reach the kernels as
.transpose(1, 2) views, read in place through their strides (the last dim must be contiguous, or it is copied);
outputs come back in FlashAttention's shape. The meaning of each argument is FlashAttention 2.x's:
- causal is bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q;
- window_size = (left, right): query i sees keys j with
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves a side unbounded;
- k and v may have fewer heads than q (MQA/GQA): query head h reads kv head h // (heads_q // heads_kv);
- softmax_scale None means 1 / sqrt(head_dim); dropout_p applies whenever it is nonzero (pass 0.0 to evaluate);
- softmax_lse is the float32 logsumexp of each query row's scaled logits, (batch, heads, seqlen_q); a row that
  sees no key gets output 0 and lse +inf, as FlashAttention returns.

Supported:
- flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func: forward and backward (autograd) in
  float32, bfloat16 and float16, with causal, window_size, dropout_p, GQA/MQA, any seqlen_q and seqlen_k.
  return_attn_probs=True returns (out, softmax_lse, S_dmask), S_dmask the (batch, heads, seqlen_q, seqlen_k)
  attention probabilities before dropout (float32, materialised: for testing), negative where dropout dropped the
  weight (FlashAttention's convention: S_dmask >= 0 is the keep mask, abs(S_dmask) the probabilities).
- flash_attn_with_kvcache: contiguous caches (batch_cache, seqlen_cache, heads_kv, d), rows chosen by
  cache_batch_idx, and paged ones (num_blocks, page_block_size, heads_kv, d) with block_table; cache_seqlens and
  cache_leftpad; k and v of any seqlen_new appended in place; rotary embedding of q and k (interleaved or not);
  causal, window_size, softcap, alibi_slopes, return_softmax_lse; forward only (no gradients). Its docstring gives
  each meaning.
- flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func: sequences of different
  lengths packed into (total_tokens, heads, head_dim) with cu_seqlens offsets, forward and backward, with everything
  flash_attn_func takes; one kernel call over all sequences (cs149gpt.varlen_attention). flash_attn_varlen_func
  also reads a paged KV cache (block_table), forward only: a serving step's prefills and decodes in one call.

CUDA tensors run the same functions on the GPU kernels (bfloat16/float16 with head_dim 64 or 128 on tensor cores,
forward and backward; float32 forward only), the varlen ones in one launch over all sequences, each reading its own;
an argument the CUDA kernels do not take yet is refused with an error naming it (a paged varlen call's block_table
in float32 among them).

Every argument of these functions is honoured. Differences: S_dmask (return_attn_probs) holds the normalised
probabilities (FlashAttention's are scaled per block: "possibly with different scaling"); a paged varlen call has no
backward (it runs with grad mode on; its backward raises); input errors are ValueError/TypeError/IndexError, and those
naming block_table are also RuntimeError, as FlashAttention raises them.
deterministic: on the CPU every result is bitwise the same for any thread count; on CUDA the backward is bitwise
repeatable under torch.use_deterministic_algorithms(True) (cs149gpt.attention's docstring), and deterministic=True
without the switch warns that dQ's additions then have no fixed order. num_splits is ignored.
"""
import contextlib
import math
import warnings
from typing import Optional, Tuple, Union

import torch

from cs149gpt import _ext
from cs149gpt.ops import _next_dropout_seed, attention, attention_with_kvcache, varlen_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

@contextlib.contextmanager
def _block_table_errors_as_runtime_errors():
    """FlashAttention raises RuntimeError for a bad block table (its TORCH_CHECK); ours are ValueError or IndexError.
    One naming block_table is re-raised as both: code written for either keeps catching it."""
    try:
        yield
    except (ValueError, IndexError) as e:
        if "block_table" not in str(e):
            raise
        both = type(f"BlockTable{type(e).__name__}", (type(e), RuntimeError), {})
        raise both(*e.args) from None


def _attention_probs(q, k, scale, causal, window_size, lse, softcap=0.0, alibi_slopes=None):
    """(B, H, Nq, Nk) float32 softmax probabilities from q, k (B, H*, N, d) and the kernel's lse (B, H, Nq): the logits
    as the kernel forms them (scale, softcap, ALiBi with slopes (H,) or (B, H)), masked."""
    with torch.no_grad():
        group = q.shape[1] // k.shape[1]
        s = (q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
        if softcap > 0.0:
            s = softcap * torch.tanh(s / softcap)
        n_q, n_k = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q, device=q.device).unsqueeze(1) + (n_k - n_q)  # each query's diagonal, bottom-right
        j = torch.arange(n_k, device=q.device).unsqueeze(0)
        if alibi_slopes is not None:
            slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 2 else 1, q.shape[1], 1, 1)
            s = s - slopes * (i - j).abs()
        left, right = window_size
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= i
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        p = torch.exp(s.masked_fill(~visible, float("-inf")) - lse.unsqueeze(-1))
        return p.nan_to_num_(nan=0.0)  # rows that see no key: lse -inf


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs):
    """q (B, Nq, Hq, d), k and v (B, Nk, Hkv, d), any strides with the last dim contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, N, d) views
    window = tuple(max(int(w), -1) for w in window_size)  # FlashAttention: any negative side is unbounded
    # The call's dropout (seed, offset) is the next draw of torch's default generator of q's device
    # (ops._dropout_seed): read before the call, for the keep mask.
    drawn = _next_dropout_seed(q.device) if return_attn_probs and dropout_p > 0.0 else None
    out, lse = attention(qt, kt, vt, scale=softmax_scale, is_causal="bottom_right" if causal else False,
                         window=window if window != (-1, -1) else None, dropout_p=dropout_p, softcap=softcap,
                         alibi_slopes=alibi_slopes, return_lse=True)
    out = out.transpose(1, 2)  # (B, Nq, Hq, d)
    if not return_attn_probs:
        return out
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    probs = _attention_probs(qt, kt, scale, causal, window, lse.detach(), softcap, alibi_slopes)
    if drawn is not None:
        seed, offset = drawn
        keep = _ext._module._testing.dropout_keep_mask(seed, offset, list(probs.shape), float(dropout_p))
        probs = torch.where(keep.to(probs.device), probs, -probs)  # FlashAttention's S_dmask: negative where dropped
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # FlashAttention's value for a row with no key
    return out, lse, probs


def _deterministic_asked(deterministic, q, *tensors):
    """deterministic=True on CUDA without torch's switch: say what it takes (the backward reads torch's switch)."""
    wants_grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    if (deterministic and wants_grad and isinstance(q, torch.Tensor) and q.is_cuda
            and not torch.are_deterministic_algorithms_enabled()):
        warnings.warn("deterministic=True: cs149gpt's CUDA backward adds dQ in a fixed order under "
                      "torch.use_deterministic_algorithms(True); without it, in no fixed order", stacklevel=3)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """softmax(softmax_scale · q kᵀ, masked) v, FlashAttention's flash_attn_func.

    Args:
        q: (batch, seqlen_q, heads, head_dim). k, v: (batch, seqlen_k, heads_kv, head_dim), heads divisible by
            heads_kv (MQA/GQA).
        dropout_p, softmax_scale, causal (bottom-right), window_size: as in the module docstring.
        softcap: > 0 caps the scaled logits to softcap · tanh(s / softcap). alibi_slopes: (heads,) or
            (batch, heads) float32, adds −slope · |i + seqlen_k − seqlen_q − j|. deterministic: see the module
            docstring.
        return_attn_probs: also return softmax_lse (batch, heads, seqlen_q) float32 and S_dmask, the attention
            probabilities (batch, heads, seqlen_q, seqlen_k) before dropout, negated where dropout dropped them
            (for testing: materialised).

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype, differentiable in q, k and v;
        or (out, softmax_lse, S_dmask) with return_attn_probs.
    """
    _deterministic_asked(deterministic, q, q, k, v)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head_dim), read through views (no copy)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected (batch, seqlen, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    _deterministic_asked(deterministic, qkv, qkv)
    return _dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on q (batch, seqlen_q, heads, head_dim) and kv (batch, seqlen_k, 2, heads_kv, head_dim)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected (batch, seqlen_k, 2, heads_kv, head_dim), got shape {tuple(kv.shape)}")
    _deterministic_asked(deterministic, q, q, kv)
    return _dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, return_attn_probs)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, return_attn_probs, block_table=None):
    """q (total_q, Hq, d), k and v (total_k, Hkv, d), sequences packed one after another (cu_seqlens); or, with
    block_table, k and v a paged cache (num_blocks, page_block_size, Hkv, d)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        paged = block_table is not None and name != "q"
        if not isinstance(t, torch.Tensor) or t.dim() != (4 if paged else 3):
            expected = "(num_blocks, page_block_size, heads_kv, head_dim) with block_table" if paged else \
                "(total_tokens, heads, head_dim)"
            raise ValueError(f"{name}: expected {expected}, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    window = tuple(max(int(w), -1) for w in window_size)  # FlashAttention: any negative side is unbounded
    drawn = _next_dropout_seed(q.device) if return_attn_probs and dropout_p > 0.0 else None
    with _block_table_errors_as_runtime_errors():
        out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                    scale=softmax_scale, is_causal=bool(causal),
                                    window=window if window != (-1, -1) else None, dropout_p=dropout_p,
                                    softcap=softcap, alibi_slopes=alibi_slopes, block_table=block_table,
                                    return_lse=True)
    if not return_attn_probs:
        return out
    if block_table is not None:  # (testing only) each sequence's keys gathered from its pages, packed
        k = _gather_pages(k, block_table, cu_seqlens_k)
        cu_seqlens_k = cu_seqlens_k - cu_seqlens_k[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    probs = q.new_zeros((len(cu_q) - 1, q.shape[1], int(max_seqlen_q), int(max_seqlen_k)), dtype=torch.float32)
    for b in range(len(cu_q) - 1):  # (testing only: materialised, sequence by sequence, from the kernel's lse)
        qs, ks = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1), k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        p = _attention_probs(qs.unsqueeze(0), ks.unsqueeze(0), scale, causal, window,
                             lse[:, cu_q[b]:cu_q[b + 1]].detach().unsqueeze(0), softcap, slopes)
        probs[b, :, :qs.shape[1], :ks.shape[1]] = p[0]
    if drawn is not None:  # sequence b's keep mask: the dense one at offset + cu_seqlens_q[b]·H·(longest key sequence)
        seed, offset = drawn
        longest_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
        for b in range(len(cu_q) - 1):
            shift = (offset + cu_q[b] * q.shape[1] * longest_k + 2**63) % 2**64 - 2**63  # the kernel's uint64 sum
            n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            keep = _ext._module._testing.dropout_keep_mask(seed, shift, [1, q.shape[1], n_q, n_k], float(dropout_p))
            block = probs[b, :, :n_q, :n_k]
            probs[b, :, :n_q, :n_k] = torch.where(keep[0].to(probs.device), block, -block)
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # FlashAttention's value for a row with no key
    return out, lse, probs


def _gather_pages(cache, block_table, cu_seqlens_k):
    """A paged cache's keys (num_blocks, page, H, d) as a packed (total_k, H, d) copy, sequence after sequence."""
    page, rows = cache.shape[1], []
    for b, (a, e) in enumerate(zip(cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])):
        t = torch.arange(e - a, device=block_table.device)
        rows.append(cache[block_table[b, t // page].long(), t % page])
    return torch.cat(rows) if rows else cache.new_empty((0,) + tuple(cache.shape[2:]))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Packed variable-length sequences, FlashAttention's flash_attn_varlen_func (cs149gpt.varlen_attention).

    Args:
        q: (total_q, heads, head_dim), the batch's query sequences one after another; sequence b is rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]). k, v: (total_k, heads_kv, head_dim), likewise with cu_seqlens_k.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets, batch >= 1; sequences may be empty, all of them too
            (total 0), as in FlashAttention. max_seqlen_q, max_seqlen_k: at least the longest sequence's length
            (ValueError otherwise). Errors name the argument and show its shape as passed.
        dropout_p, softmax_scale, causal (bottom-right in each sequence), window_size: as in the module docstring.
        return_attn_probs: also return softmax_lse (heads, total_q) float32 and S_dmask, the attention probabilities
            (batch, heads, max_seqlen_q, max_seqlen_k) before dropout, zero past each sequence, negated where dropout
            dropped them (for testing: materialised).
        block_table: (batch, max_blocks) int32, a paged KV cache: k and v are then (num_blocks, page_block_size,
            heads_kv, head_dim) and sequence b's keys are 0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] - 1, key t at row
            t % page_block_size of block block_table[b, t // page_block_size] (FlashAttention's meaning; any
            page_block_size). One call prefills and decodes many sequences (seqlen_q 1: a decode step). Inference
            only: the backward of such a call raises. deterministic: the module docstring's.

    Returns:
        out (total_q, heads, head_dim) in q's dtype, differentiable in q, k and v (without block_table); or
        (out, softmax_lse, S_dmask).
    One kernel call takes every sequence (no padding, no (N, N) mask); so does the backward.
    """
    _deterministic_asked(deterministic, q, q, k, v)
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs, block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on qkv (total, 3, heads, head_dim), one cu_seqlens for all three (views, no copy)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected (total_tokens, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    _deterministic_asked(deterministic, qkv, qkv)
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func on q (total_q, heads, head_dim) and kv (total_k, 2, heads_kv, head_dim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected (total_tokens, 2, heads_kv, head_dim), got shape {tuple(kv.shape)}")
    _deterministic_asked(deterministic, q, q, kv)
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def _rotary(x, cos, sin, positions, interleaved):
    """x (B, S, H, d) with its first rotary_dim = 2 · cos.shape[1] columns rotated by the angles of rows
    positions (B, S) of cos and sin, computed in float32 and rounded to x's dtype (the rest of x as it is).
    interleaved: pairs (0, 1), (2, 3), ...; else (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ... (GPT-NeoX)."""
    half = cos.shape[1]
    c = cos[positions].float().unsqueeze(2)  # (B, S, 1, rotary_dim / 2)
    s = sin[positions].float().unsqueeze(2)
    xr = x[..., :2 * half].float()
    x1, x2 = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_rotary(rotary_cos, rotary_sin, k, head_dim):
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin: pass both, or neither")
    if k is None:
        raise ValueError("rotary_cos: the rotary embedding is applied to the new keys k (and q); pass k and v")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating (seqlen_ro, rotary_dim / 2) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin: expected rotary_cos's shape {tuple(rotary_cos.shape)}, got "
                         f"{tuple(rotary_sin.shape)}")
    if not 0 < 2 * rotary_cos.shape[1] <= head_dim:
        raise ValueError(f"rotary_cos: rotary_dim = 2 · {rotary_cos.shape[1]} must be in [2, head_dim = {head_dim}]")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None, causal=False,
                            window_size: Tuple[int, int] = (-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """New queries against a KV cache, FlashAttention's flash_attn_with_kvcache (cs149gpt.attention_with_kvcache).

    Sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its cache: the cached ones, then
    k's, written in place at rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) before attending. Its
    L_b = cache_seqlens[b] − cache_leftpad[b] + seqlen_new keys are counted from cache_leftpad[b], and the causal
    mask and window align to their end: query i sees key j (so counted) if j <= i + L_b − seqlen_q (causal) and
    i + L_b − seqlen_q − window_size[0] <= j <= i + L_b − seqlen_q + window_size[1] (-1: that side unbounded).
    The cache is read in place, by address (cache_batch_idx, cache_leftpad and block_table included): never
    gathered or copied.

    Args:
        q: (batch, seqlen_q, heads, head_dim).
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, head_dim); or, with block_table (batch, max_blocks)
            int32, paged: (num_blocks, page_block_size, heads_kv, head_dim). Written in place when k, v are given.
        k, v: None, or (batch, seqlen_new, heads_kv, head_dim), any seqlen_new: appended as above.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2), rotary_dim <= head_dim (k and v must then be
            given): q and k are rotated before attending, k at positions cache_seqlens[b] + i, q at
            cache_seqlens[b] + i when causal or windowed, else every row of q at cache_seqlens[b]; the cache receives
            the rotated k. Positions are cache rows (cache_leftpad does not shift them), computed in float32. A
            position past seqlen_ro raises a ValueError on the CPU; on CUDA it is clamped into the table (the lengths
            stay on the GPU: no synchronisation per step), as the kernel clamps the lengths themselves.
            rotary_interleaved: rotate the pairs (0, 1), (2, 3), ...; False: (0, rotary_dim / 2), ... (GPT-NeoX).
        cache_seqlens: int or (batch,) int32/int64, where each sequence's cache ends before the append; None: the
            whole cache (then k, v cannot be appended).
        cache_batch_idx: None, or (batch,) int32: sequence b's cache is row cache_batch_idx[b] of k_cache and
            v_cache (contiguous caches only; rows appended to must be distinct).
        cache_leftpad: None, or (batch,) int32, 0 <= cache_leftpad[b] <= cache_seqlens[b]: where sequence b's keys
            start (left padding before it is never read). Paged caches too.
        softmax_scale, causal: as in the module docstring. window_size: (left, right) as above.
        return_softmax_lse: also return softmax_lse (batch, heads, seqlen_q) float32, the logsumexp of each row's
            scaled logits (+inf for a row that sees no key).
        softcap: > 0 caps the scaled logits to softcap · tanh(s / softcap). alibi_slopes: (heads,) or (batch, heads)
            float32, adds −slope · |i + L_b − seqlen_q − j| with L_b sequence b's length after the append, i and j
            counted from cache_leftpad (FlashAttention's meaning). num_splits: ignored (the kernel splits the keys
            itself, deterministically).

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype (a transposed view of the kernel's contiguous
        (batch, heads, seqlen_q, head_dim) output); (out, softmax_lse) with return_softmax_lse.
        Not differentiable (FlashAttention's has no backward either).
    """
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both new keys and new values, or neither")
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, seqlen_q, heads, head_dim), got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("k", k), ("v", v)):
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor, got shape {tuple(t.shape)}")
    batch, seqlen_q = q.shape[:2]
    capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: required when k and v are appended")
        cache_seqlens = capacity
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    # FlashAttention: a negative side is unbounded, and so is one at least as long as the cache.
    window = tuple(-1 if int(w) < 0 or int(w) >= capacity else int(w) for w in window_size)
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(rotary_cos, rotary_sin, k, q.shape[-1])
        if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != batch:
            raise ValueError(f"cache_seqlens: expected shape ({batch},), got {tuple(cache_seqlens.shape)}")
        start = cache_seqlens.long().unsqueeze(1)  # (B, 1)
        per_row = causal or window != (-1, -1)
        q_pos = start + torch.arange(seqlen_q, device=q.device) if per_row else start.expand(batch, seqlen_q)
        k_pos = start + torch.arange(k.shape[1], device=q.device)
        if start.device.type == "cuda":
            # No synchronisation per step (cache_seqlens stays on the GPU, as the decode kernel reads it): positions
            # are clamped into the table, so a bad length gives a wrong rotation, never a read outside it.
            q_pos, k_pos = (pos.clamp(0, rotary_cos.shape[0] - 1) for pos in (q_pos, k_pos))
        else:
            last = max(int(q_pos.max()), int(k_pos.max()), 0) if batch else 0
            if last >= rotary_cos.shape[0] or int(start.min() if batch else 0) < 0:
                raise ValueError(f"rotary_cos: has {rotary_cos.shape[0]} positions, but position {last} is needed "
                                 "(cache_seqlens + the new tokens)")
        q = _rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        k = _rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)
    lse = (torch.empty(batch, q.shape[2], seqlen_q, dtype=torch.float32, device=q.device)
           if return_softmax_lse else None)
    with _block_table_errors_as_runtime_errors():
        out = attention_with_kvcache(
            q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens,
            k_new=None if k is None else k.transpose(1, 2), v_new=None if v is None else v.transpose(1, 2),
            block_table=block_table, scale=softmax_scale, is_causal=bool(causal), cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, window=window if window != (-1, -1) else None, softcap=softcap,
            alibi_slopes=alibi_slopes, lse=lse)
    out = out.transpose(1, 2)  # (B, Nq, Hq, d)
    if not return_softmax_lse:
        return out
    return out, torch.where(lse == float("-inf"), float("inf"), lse)  # FlashAttention's value for a row with no key
