"""cs149gpt: CPU attention kernels for PyTorch — naive, blocked, fused and flash.

    import cs149gpt
    out = cs149gpt.attention(q, k, v, impl="flash", is_causal=True)

The entry points of Stanford CS149's assignment 4 (myNaiveAttention, myUnfusedAttentionBlocked,
myFusedAttention, myFlashAttention, twoDimRead, fourDimRead) are re-exported here from the compiled module,
which is loaded when the package is imported (and, from a fresh checkout, compiled then, once).
"""
__version__ = "0.1.0"  # the one version number: pyproject.toml reads it from here

from cs149gpt.ops import (IMPLS, attention, attention_with_kvcache, isa, scaled_dot_product_attention,
                          set_float32_products, uses_our_kernel, varlen_attention)
from cs149gpt.integration import install_sdpa, register_transformers, restore_sdpa, sdpa_installed

ASSIGNMENT_ENTRY_POINTS = (
    "myNaiveAttention",
    "myUnfusedAttentionBlocked",
    "myFusedAttention",
    "myFlashAttention",
    "twoDimRead",
    "fourDimRead",
)

__all__ = ["attention", "attention_with_kvcache", "varlen_attention", "scaled_dot_product_attention", "uses_our_kernel", "isa",
           "set_float32_products", "IMPLS",
           "install_sdpa", "restore_sdpa", "sdpa_installed", "register_transformers", *ASSIGNMENT_ENTRY_POINTS]


def __getattr__(name):
    if name == "distributed":  # context-parallel ring attention; imported on first use (torch.distributed)
        import importlib

        return importlib.import_module("cs149gpt.distributed")
    if name in ASSIGNMENT_ENTRY_POINTS:
        from cs149gpt import _ext, ops

        ops._load()
        return getattr(_ext._module, name)
    raise AttributeError(f"module 'cs149gpt' has no attribute {name!r}")
