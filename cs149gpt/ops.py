"""The Python face of cs149gpt: typed, documented wrappers over the compiled operators."""
from typing import Optional, Tuple, Union

import torch

from cs149gpt import _ext

IMPLS = ("naive", "blocked", "fused", "flash")


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
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """softmax(scale · q kᵀ [+ causal mask]) v, computed by one of the four kernels.

    Args:
        q: (..., Nq, d) float32 queries, any strides (the last dim is read in place when contiguous).
        k, v: (..., Nk, d) keys and values with q's leading dims; their head dim (-3) may divide q's (GQA).
        impl: "naive" (N×N scores), "blocked" (tiled matmuls), "fused" (a row at a time) or "flash".
        scale: multiplies q·k; None means 1/sqrt(d), as in torch's scaled_dot_product_attention.
        is_causal: False; True or "top_left": query i sees keys j <= i (torch SDPA's is_causal);
            "bottom_right": query i sees keys j <= i + Nk - Nq (torch.nn.attention.bias.causal_lower_right,
            what decoding with a KV cache needs). A query row that sees no key gets 0.
        block_q, block_k: flash's Br × Bc tile (blocked: its one tile size); None picks measured defaults.

        return_lse: also return lse, the float32 logsumexp of each query row's scaled logits, (..., Nq)
            (flash only).

    Returns:
        out: (..., Nq, d), contiguous, in q's dtype (float32, or bfloat16/float16 with impl="flash");
        or (out, lse) with return_lse=True.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(i) for i in IMPLS)}; got {impl!r}")
    causal = _causal_mode(is_causal)
    _ext.load()
    if return_lse:
        if impl != "flash":
            raise ValueError(f"return_lse=True needs impl='flash', got impl={impl!r}")
        return torch.ops.cs149gpt.flash_attention(q, k, v, scale, causal, block_q, block_k)
    return torch.ops.cs149gpt.attention(q, k, v, impl, scale, causal, block_q, block_k)


def _causal_mode(is_causal: Union[bool, str]) -> str:
    if is_causal is True:
        return "top_left"
    if is_causal is False or is_causal is None:
        return "none"
    if is_causal in ("top_left", "bottom_right"):
        return is_causal
    raise ValueError(f"is_causal must be False, True, 'top_left' or 'bottom_right'; got {is_causal!r}")


def isa() -> str:
    """The instruction set the kernels run with: 'avx512', 'avx2' or 'scalar'."""
    return _ext.load().isa()
