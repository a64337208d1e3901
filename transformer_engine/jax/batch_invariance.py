"""Batch-invariant mode for JAX: ``dense`` and the norms on the kernels PyTorch's batch-invariant mode runs.

With ``NVTE_BATCH_INVARIANT=1``, or inside ``with batch_invariant():`` (both read when a function is traced),
:func:`transformer_engine.jax.dense.dense` (forward, dgrad and wgrad) and the LayerNorm / RMSNorm of the Flax
modules (:func:`transformer_engine.jax.flax.module.layernorm`, forward and backward) run on the Triton kernels of
``transformer_engine.common.batch_invariant``: a row of an output or of an input gradient gets the same bits
whether it is computed alone or in a batch of any size, and the same bits as PyTorch's modules in the mode (one
kernel source, launched with the same arguments: ``primitives.batch_invariant``). XLA picks its dot's algorithm
and its reductions' order by shape, so by default neither holds.

Parameter gradients (a GEMM's wgrad, a norm's scale and bias) sum over the rows and so depend on the batch by
definition; they come from the same kernels as PyTorch's (the GEMM, a fixed-order column sum), so the two
frameworks agree on them bitwise too. A bias added by ``dense`` or by a Flax module (:func:`bias_add`) gets its
gradient from the column sum as well, and ``LayerNormMLP``'s activation runs on the shared elementwise kernel
(:func:`bi_activation`): torch's and XLA's own ``tanh`` / ``exp`` differ in the last bit.

The kernels run on a CUDA GPU (the FFI launch path of the fused attention) and on CPU under Triton's interpreter
(``NVTE_JAX_TRITON_INTERPRET=1`` and ``TRITON_INTERPRET=1``); elsewhere lowering raises. FP8 ``dense`` is refused
in the mode (a per-tensor scale is the whole batch's amax). The mode is read at trace time: a function jitted
outside the context keeps the path it was traced with.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from transformer_engine.common.batch_invariant.mode import batch_invariant, is_batch_invariant

__all__ = ["batch_invariant", "is_batch_invariant", "bi_matmul", "bi_norm", "bi_activation", "bias_add",
           "check_no_fp8"]

def check_no_fp8(owner: str) -> None:
    """Batch-invariant mode refuses FP8 GEMMs: a per-tensor scale is the whole batch's amax."""
    raise NotImplementedError(
        f"{owner}: FP8 GEMMs in batch-invariant mode are not implemented (current and delayed scaling take their "
        "scales from the whole batch's amax, so a row's FP8 value depends on the batch); use noop_quantizer_set "
        "(leave the FP8 autocast) or leave the batch-invariant mode")


# ------------------------------------------------------------------------------------------------
# GEMM: x2d [M, K] @ kernel [K, N] (+ bias [N]), the launches of PyTorch's bi_linear with W = kernel^T
# ------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x2d, kernel, bias, has_bias):
    return _matmul_fwd(x2d, kernel, bias, has_bias)[0]


def _matmul_fwd(x2d, kernel, bias, has_bias):
    from transformer_engine.jax.primitives import batch_invariant as prim

    # PyTorch holds W [N, K] and reads W^T (strides (1, K)); kernel.T materialized row-major is that W.
    w = kernel.T.astype(x2d.dtype)
    out = prim.gemm(x2d, w, x2d.dtype, b_t=True)
    if has_bias:
        out = out + bias.astype(out.dtype)
    return out, (x2d, kernel, jnp.zeros((0,), bias.dtype))


def _matmul_bwd(has_bias, res, grad):
    from transformer_engine.jax.primitives import batch_invariant as prim

    x2d, kernel, bias_type = res
    w = kernel.T.astype(grad.dtype)
    dx = prim.gemm(grad, w, grad.dtype).astype(x2d.dtype)  # grad [M, N] @ W [N, K]
    # PyTorch: grad^T [N, M] (grad read transposed) @ x [M, K] = dW [N, K]; the kernel's gradient is its transpose.
    dw = prim.gemm(grad, x2d.astype(grad.dtype), kernel.dtype, a_t=True).T
    db = prim.col_sums(grad, bias_type.dtype)[1] if has_bias else bias_type
    return dx, dw, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def bi_matmul(x2d: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None) -> jax.Array:
    """``x2d @ kernel (+ bias)`` (``[M, K] @ [K, N]``) in ``x2d.dtype``, batch-invariant, forward and gradients on
    the batch-invariant kernels (the bias gradient a fixed-order column sum)."""
    has_bias = bias is not None
    return _matmul(x2d, kernel, bias if has_bias else jnp.zeros((0,), x2d.dtype), has_bias)


# ------------------------------------------------------------------------------------------------
# Norms: the launches of PyTorch's bi_norm
# ------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _norm(x2d, w, b, eps, is_rms, zero_centered, has_bias):
    return _norm_fwd(x2d, w, b, eps, is_rms, zero_centered, has_bias)[0]


def _norm_fwd(x2d, w, b, eps, is_rms, zero_centered, has_bias):
    from transformer_engine.jax.primitives import batch_invariant as prim

    y, mean, rstd = prim.norm_fwd(x2d, w, b if has_bias else None, eps, is_rms, zero_centered)
    return y, (x2d, w, mean, rstd, jnp.zeros((0,), b.dtype))


def _norm_bwd(eps, is_rms, zero_centered, has_bias, res, dy):
    from transformer_engine.jax.primitives import batch_invariant as prim

    x2d, w, mean, rstd, b_type = res
    dx = prim.norm_bwd(x2d, w, dy, mean, rstd, is_rms, zero_centered)
    dw, db = prim.col_sums(dy, w.dtype, x2d, mean, rstd)
    # The bias's gradient is the same column sum as the weight's, in the bias's dtype (PyTorch: the weight's).
    db = db.astype(b_type.dtype) if has_bias else b_type
    return dx, dw, db


_norm.defvjp(_norm_fwd, _norm_bwd)


def bi_norm(x: jax.Array, weight: jax.Array, bias: Optional[jax.Array], eps: float, is_rms: bool,
            zero_centered_gamma: bool) -> jax.Array:
    """LayerNorm (``bias`` may be None) or RMSNorm (``is_rms``) over the last axis, batch-invariant (float32
    inside, ``x``'s dtype out); ``zero_centered_gamma`` applies ``1 + weight``."""
    shape = x.shape
    has_bias = bias is not None
    y = _norm(x.reshape(-1, shape[-1]), weight, bias if has_bias else jnp.zeros((0,), weight.dtype), float(eps),
              bool(is_rms), bool(zero_centered_gamma), has_bias)
    return y.reshape(shape)


# ------------------------------------------------------------------------------------------------
# LayerNormMLP's activation: the elementwise kernel PyTorch's mode runs (XLA's tanh / exp round differently)
# ------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(x2d, args):
    from transformer_engine.jax.primitives import batch_invariant as prim

    return prim.act_fwd(x2d, args)


def _activation_fwd(x2d, args):
    from transformer_engine.jax.primitives import batch_invariant as prim

    return prim.act_fwd(x2d, args), x2d


def _activation_bwd(args, x2d, dy):
    from transformer_engine.jax.primitives import batch_invariant as prim

    return (prim.act_bwd(x2d, dy.astype(x2d.dtype), args),)


_activation.defvjp(_activation_fwd, _activation_bwd)


def bi_activation(fc1_out: jax.Array, name: str, params=None) -> jax.Array:
    """Activation ``name`` of common/modules.py's table on FC1's output (last dim; gated: the activated half
    first), float32 inside, ``fc1_out``'s dtype out, on the kernel PyTorch's mode runs."""
    from transformer_engine.common.batch_invariant.plan import activation_args

    args = activation_args(name, params)
    shape = fc1_out.shape
    y = _activation(fc1_out.reshape(-1, shape[-1]), args)
    return y.reshape(*shape[:-1], y.shape[-1])


# ------------------------------------------------------------------------------------------------
# A module's bias addition: in the mode its gradient is the column sum PyTorch's mode computes
# ------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_add(x, bias, bias_dtype):
    return x + bias


def _bias_add_fwd(x, bias, bias_dtype):
    return x + bias, None


def _bias_add_bwd(bias_dtype, _, grad):
    from transformer_engine.jax.primitives import batch_invariant as prim

    n = grad.shape[-1]
    return grad, prim.col_sums(grad.reshape(-1, n), bias_dtype)[1]


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


def bias_add(x: jax.Array, bias: jax.Array) -> jax.Array:
    """``x + bias`` for a module's bias over the trailing dims of ``x`` (in ``x``'s dtype). In batch-invariant mode
    the bias's gradient is the fixed-order column sum PyTorch's mode computes (XLA's own reduction over the rows
    would differ from torch's in the last bit)."""
    if not is_batch_invariant() or bias.dtype != x.dtype or bias.ndim > x.ndim:
        return x + bias
    shape = bias.shape
    if tuple(x.shape[x.ndim - bias.ndim:]) != tuple(shape):
        return x + bias
    flat = bias.reshape(-1)
    out = _bias_add(x.reshape(*x.shape[:x.ndim - bias.ndim], flat.shape[0]), flat, jnp.dtype(bias.dtype).name)
    return out.reshape(x.shape)
