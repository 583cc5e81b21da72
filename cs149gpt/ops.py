"""The Python face of cs149gpt: typed, documented wrappers over the compiled operators."""
from typing import Optional

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
    is_causal: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
) -> torch.Tensor:
    """softmax(scale · q kᵀ [+ causal mask]) v, computed by one of the four kernels.

    Args:
        q: (..., Nq, d) float32 queries, any strides (the last dim is read in place when contiguous).
        k, v: (..., Nk, d) keys and values with q's leading dims; their head dim (-3) may divide q's (GQA).
        impl: "naive" (N×N scores), "blocked" (tiled matmuls), "fused" (a row at a time) or "flash".
        scale: multiplies q·k; None means 1/sqrt(d), as in torch's scaled_dot_product_attention.
        is_causal: query i sees keys j <= i (torch SDPA's top-left alignment).
        block_q, block_k: flash's Br × Bc tile (blocked: its one tile size); None picks measured defaults.

    Returns:
        (..., Nq, d), contiguous, in q's dtype.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(repr(i) for i in IMPLS)}; got {impl!r}")
    _ext.load()
    return torch.ops.cs149gpt.attention(q, k, v, impl, scale, is_causal, block_q, block_k)


def isa() -> str:
    """The instruction set the kernels run with: 'avx512', 'avx2' or 'scalar'."""
    return _ext.load().isa()
