"""CUDA lowering of the fused attention primitives: launches the Triton kernels through XLA FFI.

Not wired yet: until it is, the JAX frontend reports the fused backend unavailable on GPUs
(:func:`unavailable_reason`), so selection picks the unfused backend, and binding the primitive
directly on a GPU raises ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["unavailable_reason", "fused_attn_fwd_lowering", "fused_attn_bwd_lowering"]

_NOT_WIRED = (
    "the JAX launch of the Triton kernels (XLA FFI extension transformer_engine_jax_ffi) is not available"
)


def unavailable_reason() -> Optional[str]:
    """Why the fused primitives cannot run on this CUDA GPU, or None when they can."""
    return _NOT_WIRED


def fused_attn_fwd_lowering(ctx, *args, static):
    raise NotImplementedError(f"fused attention forward on CUDA: {_NOT_WIRED}")


def fused_attn_bwd_lowering(ctx, *args, static):
    raise NotImplementedError(f"fused attention backward on CUDA: {_NOT_WIRED}")
