"""FlashAttention-2's Python API over cs149gpt's kernels, on the CPU.

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
  attention probabilities (float32, materialised: for testing), only with dropout_p == 0.
- flash_attn_with_kvcache: contiguous caches (batch, seqlen_cache, heads_kv, d) and paged ones
  (num_blocks, page_block_size, heads_kv, d) with block_table; cache_seqlens an int or a (batch,) int32/int64
  tensor (None: the whole cache); k and v (batch, seqlen_new, heads_kv, d) written into the caches in place at
  rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new) before attending (cache_seqlens itself is not changed);
  causal or not; forward only (no gradients).
- flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func: sequences of different
  lengths packed into (total_tokens, heads, head_dim) with cu_seqlens offsets, forward and backward, with everything
  flash_attn_func takes; one kernel call over all sequences (cs149gpt.varlen_attention).

Raises NotImplementedError, naming the argument, rather than return a different result:
- softcap != 0 and alibi_slopes (every function);
- return_attn_probs with dropout_p > 0 (the dropout pattern is not returned);
- in flash_attn_with_kvcache: rotary_cos/rotary_sin, cache_batch_idx, cache_leftpad, window_size other than
  (-1, -1), return_softmax_lse, and k/v whose seqlen differs from q's;
- block_table in flash_attn_varlen_func (a paged KV cache there).
deterministic is accepted (every result is bitwise the same for any thread count) and num_splits is ignored.
"""
import math
from typing import Optional, Tuple, Union

import torch

from cs149gpt.ops import attention, attention_with_kvcache, varlen_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

def _refuse_unsupported(softcap, alibi_slopes):
    if softcap != 0.0:
        raise NotImplementedError(f"softcap={softcap}: the softcapped logits are not computed by cs149gpt's kernels yet")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi biases are not computed by cs149gpt's kernels yet")


def _attention_probs(q, k, scale, causal, window_size, lse):
    """(B, H, Nq, Nk) float32 softmax probabilities from q, k (B, H*, N, d) and the kernel's lse (B, H, Nq)."""
    with torch.no_grad():
        group = q.shape[1] // k.shape[1]
        s = (q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
        n_q, n_k = q.shape[-2], k.shape[-2]
        i = torch.arange(n_q).unsqueeze(1) + (n_k - n_q)  # each query's diagonal, bottom-right aligned
        j = torch.arange(n_k).unsqueeze(0)
        left, right = window_size
        visible = torch.ones(n_q, n_k, dtype=torch.bool)
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
    _refuse_unsupported(softcap, alibi_slopes)
    if return_attn_probs and dropout_p > 0.0:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: the dropout pattern is not returned")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, N, d) views
    window = tuple(max(int(w), -1) for w in window_size)  # FlashAttention: any negative side is unbounded
    out, lse = attention(qt, kt, vt, scale=softmax_scale, is_causal="bottom_right" if causal else False,
                         window=window if window != (-1, -1) else None, dropout_p=dropout_p, return_lse=True)
    out = out.transpose(1, 2)  # (B, Nq, Hq, d)
    if not return_attn_probs:
        return out
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    probs = _attention_probs(qt, kt, scale, causal, window, lse.detach())
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # FlashAttention's value for a row with no key
    return out, lse, probs


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """softmax(softmax_scale · q kᵀ, masked) v, FlashAttention's flash_attn_func.

    Args:
        q: (batch, seqlen_q, heads, head_dim). k, v: (batch, seqlen_k, heads_kv, head_dim), heads divisible by
            heads_kv (MQA/GQA).
        dropout_p, softmax_scale, causal (bottom-right), window_size: as in the module docstring.
        softcap, alibi_slopes: only their defaults (else NotImplementedError). deterministic: accepted.
        return_attn_probs: also return softmax_lse (batch, heads, seqlen_q) float32 and the attention
            probabilities (batch, heads, seqlen_q, seqlen_k); dropout_p must then be 0.

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype, differentiable in q, k and v;
        or (out, softmax_lse, S_dmask) with return_attn_probs.
    """
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on qkv (batch, seqlen, 3, heads, head_dim), read through views (no copy)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv: expected (batch, seqlen, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    return _dense(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_func on q (batch, seqlen_q, heads, head_dim) and kv (batch, seqlen_k, 2, heads_kv, head_dim)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected (batch, seqlen_k, 2, heads_kv, head_dim), got shape {tuple(kv.shape)}")
    return _dense(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, return_attn_probs)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
            window_size, softcap, alibi_slopes, return_attn_probs, block_table=None):
    """q (total_q, Hq, d), k and v (total_k, Hkv, d), sequences packed one after another (cu_seqlens)."""
    _refuse_unsupported(softcap, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError("block_table: a paged KV cache in flash_attn_varlen_func is not supported yet; "
                                  "use flash_attn_with_kvcache")
    if return_attn_probs and dropout_p > 0.0:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: the dropout pattern is not returned")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected (total_tokens, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    window = tuple(max(int(w), -1) for w in window_size)  # FlashAttention: any negative side is unbounded
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                scale=softmax_scale, is_causal=bool(causal),
                                window=window if window != (-1, -1) else None, dropout_p=dropout_p, return_lse=True)
    if not return_attn_probs:
        return out
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    probs = q.new_zeros((len(cu_q) - 1, q.shape[1], int(max_seqlen_q), int(max_seqlen_k)), dtype=torch.float32)
    for b in range(len(cu_q) - 1):  # (testing only: materialised, sequence by sequence, from the kernel's lse)
        qs, ks = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1), k[cu_k[b]:cu_k[b + 1]].transpose(0, 1)
        p = _attention_probs(qs.unsqueeze(0), ks.unsqueeze(0), scale, causal, window,
                             lse[:, cu_q[b]:cu_q[b + 1]].detach().unsqueeze(0))
        probs[b, :, :qs.shape[1], :ks.shape[1]] = p[0]
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # FlashAttention's value for a row with no key
    return out, lse, probs


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Packed variable-length sequences, FlashAttention's flash_attn_varlen_func (cs149gpt.varlen_attention).

    Args:
        q: (total_q, heads, head_dim), the batch's query sequences one after another; sequence b is rows
            [cu_seqlens_q[b], cu_seqlens_q[b + 1]). k, v: (total_k, heads_kv, head_dim), likewise with cu_seqlens_k.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets. max_seqlen_q, max_seqlen_k: at least the longest
            sequence's length (ValueError otherwise).
        dropout_p, softmax_scale, causal (bottom-right in each sequence), window_size: as in the module docstring.
        return_attn_probs: also return softmax_lse (heads, total_q) float32 and the attention probabilities
            (batch, heads, max_seqlen_q, max_seqlen_k), zero past each sequence; dropout_p must then be 0.
        block_table: a paged KV cache (NotImplementedError). deterministic: accepted.

    Returns:
        out (total_q, heads, head_dim) in q's dtype, differentiable in q, k and v; or (out, softmax_lse, S_dmask).
    One kernel call takes every sequence (no padding, no (N, N) mask); so does the backward.
    """
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, return_attn_probs, block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func on qkv (total, 3, heads, head_dim), one cu_seqlens for all three (views, no copy)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv: expected (total_tokens, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash_attn_varlen_func on q (total_q, heads, head_dim) and kv (total_k, 2, heads_kv, head_dim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv: expected (total_tokens, 2, heads_kv, head_dim), got shape {tuple(kv.shape)}")
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
                            cache_batch_idx: Optional[torch.Tensor] = None,
                            cache_leftpad: Optional[torch.Tensor] = None,
                            block_table: Optional[torch.Tensor] = None, softmax_scale=None, causal=False,
                            window_size: Tuple[int, int] = (-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """New queries against a KV cache, FlashAttention's flash_attn_with_kvcache (cs149gpt.attention_with_kvcache).

    Args:
        q: (batch, seqlen_q, heads, head_dim).
        k_cache, v_cache: (batch, seqlen_cache, heads_kv, head_dim); or, with block_table (batch, max_blocks)
            int32, paged: (num_blocks, page_block_size, heads_kv, head_dim). Written in place when k, v are given.
        k, v: None, or (batch, seqlen_q, heads_kv, head_dim): appended to the caches at cache_seqlens[b] before
            attending (another seqlen: NotImplementedError naming k).
        cache_seqlens: int or (batch,) int32/int64, the keys already cached; None: the whole cache (then k, v
            cannot be appended).
        softmax_scale, causal (bottom-right against cache_seqlens[b] + seqlen_new keys): as in the module
            docstring. num_splits: ignored. rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, window_size,
            softcap, alibi_slopes, return_softmax_lse: only their defaults (else NotImplementedError).

    Returns:
        out (batch, seqlen_q, heads, head_dim) in q's dtype (a transposed view of the kernel's contiguous
        (batch, heads, seqlen_q, head_dim) output).
    """
    _refuse_unsupported(softcap, alibi_slopes)
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_batch_idx", cache_batch_idx),
                        ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by cs149gpt's KV-cache kernel yet")
    if any(int(w) >= 0 for w in window_size):
        raise NotImplementedError(f"window_size={tuple(window_size)}: the KV-cache kernel has no sliding window yet")
    if return_softmax_lse:
        raise NotImplementedError("return_softmax_lse: the KV-cache kernel does not return the logsumexp yet")
    if (k is None) != (v is None):
        raise ValueError("k and v: pass both new keys and new values, or neither")
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, seqlen_q, heads, head_dim), got shape {tuple(q.shape)}")
    if k is not None and (k.dim() != 4 or k.shape[1] != q.shape[1] or v.dim() != 4 or v.shape[1] != q.shape[1]):
        raise NotImplementedError(f"k: appending {tuple(k.shape)} keys to queries {tuple(q.shape)}: the new "
                                  "keys' seqlen must equal q's (dim 1) for now")
    batch = q.shape[0]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens: required when k and v are appended")
        capacity = (block_table.shape[1] * k_cache.shape[1]) if block_table is not None else k_cache.shape[1]
        cache_seqlens = capacity
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    out = attention_with_kvcache(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), cache_seqlens,
        k_new=None if k is None else k.transpose(1, 2), v_new=None if v is None else v.transpose(1, 2),
        block_table=block_table, scale=softmax_scale, is_causal=bool(causal))
    return out.transpose(1, 2)  # (B, Nq, Hq, d)
