"""``dense``: TransformerEngine-JAX's dense layer transformation, with its FP8 GEMMs.

With a quantizer set from an FP8 recipe (:mod:`transformer_engine.jax.quantize`) the forward
(``x @ kernel``), dgrad (``grad @ kernel^T``) and wgrad (``x^T @ grad``) GEMMs take FP8 operands:
``jax.lax.dot_general`` on float8_e4m3fn / float8_e5m2 arrays with float32 results, multiplied by
the operands' inverse scales (on Hopper GPUs XLA emits cuBLASLt's FP8 GEMM for these dots; on CPU
XLA multiplies the same FP8 values exactly and accumulates in float32). Block scaling multiplies the
exactly dequantized operands (FP8 value times a power-of-two scale, exact in float32) in one float32
dot, as PyTorch's Linear does where torch has no block-scaled GEMM: one decomposition in both
frameworks (XLA has no 1x128 / 128x128 block-scaled FP8 GEMM to lower to).
Without quantization (``noop_quantizer_set``) it is one ``dot_general`` in the input's dtype.

Everything here is deterministic: amaxes are max-reductions, quantization is elementwise, and the
dots and sums run in an order fixed by the shapes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from transformer_engine.common import quantization as _q
from transformer_engine.jax.grouped_dense import grouped_dense  # noqa: F401 - TE-JAX's dense.grouped_dense
from transformer_engine.jax.quantize import QuantizerSet, ScaledTensor, noop_quantizer_set

__all__ = ["CollectiveOp", "CollectiveOpSet", "dense", "noop_collective_op_set"]


class CollectiveOp(enum.Enum):
    """TransformerEngine-JAX's collective GEMM kinds (communication overlapped with the GEMM). Only
    ``NONE`` runs here: XLA inserts the collectives of a sharded ``dense`` itself."""

    NONE = "none"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"

    @property
    def is_all_gather(self) -> bool:
        return self is CollectiveOp.ALL_GATHER

    @property
    def is_reduce_scatter(self) -> bool:
        return self is CollectiveOp.REDUCE_SCATTER

    @property
    def is_none(self) -> bool:
        return self is CollectiveOp.NONE


@dataclass(frozen=True)
class CollectiveOpSet:
    """The forward and backward collective of a dense layer (the backward is the forward's dual)."""

    forward: CollectiveOp
    backward: CollectiveOp

    @staticmethod
    def create(forward_collective_op: CollectiveOp) -> "CollectiveOpSet":
        dual = {CollectiveOp.ALL_GATHER: CollectiveOp.REDUCE_SCATTER,
                CollectiveOp.REDUCE_SCATTER: CollectiveOp.ALL_GATHER}
        return CollectiveOpSet(forward_collective_op, dual.get(forward_collective_op, CollectiveOp.NONE))


noop_collective_op_set = CollectiveOpSet.create(CollectiveOp.NONE)


# ------------------------------------------------------------------------------------------------
# FP8 GEMMs
# ------------------------------------------------------------------------------------------------


def fp8_gemm(a: ScaledTensor, a_contract: int, b: ScaledTensor, b_contract: int,
             split_accumulator: bool = True) -> jax.Array:
    """float32 ``[a_free, b_free]``: the product of two FP8 operands contracting ``a``'s axis
    ``a_contract`` with ``b``'s ``b_contract``, dequantized by their inverse scales.
    ``split_accumulator=False`` lets cuBLASLt use its fast FP8 accumulation (XLA does for FP8 dots
    of DEFAULT precision); True asks for full float32 accumulation (HIGHEST). CPU ignores it."""
    a_free, b_free = a.shape[1 - a_contract], b.shape[1 - b_contract]
    precision = jax.lax.Precision.HIGHEST if split_accumulator else jax.lax.Precision.DEFAULT
    precision = (precision, precision)
    if a.block is None and b.block is None:
        out = jax.lax.dot_general(a.data, b.data, (((a_contract,), (b_contract,)), ((), ())),
                                  precision=precision, preferred_element_type=jnp.float32)
        return out * (a.scale_inv[0] * b.scale_inv[0])
    if a.block is None or b.block is None:
        raise AssertionError("a tensor-scaled operand cannot meet a block-scaled one")
    # The dequantized operands are exact in float32 (power-of-two scales by default); one float32 dot.
    return jax.lax.dot_general(a.dequantize(), b.dequantize(), (((a_contract,), (b_contract,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def _needs_second_layout(t: ScaledTensor) -> bool:
    """A 1x128-tiled operand must be quantized again with 128x1 tiles for the GEMM that contracts
    its other axis; tensor scales and 128x128 tiles serve both."""
    return t.block is not None and 1 in t.block


@dataclass(frozen=True)
class _DenseStatic:
    """What the backward needs besides arrays: the bias flag and the gradients' dtypes."""

    has_bias: bool
    x_dtype: jnp.dtype
    kernel_dtype: jnp.dtype
    bias_dtype: jnp.dtype


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _dense_fp8(x2d, k2d, bias, quantizer_set, static):
    out, _ = _dense_fp8_fwd(x2d, k2d, bias, quantizer_set, static)
    return out


def _dense_fp8_fwd(x2d, k2d, bias, quantizer_set, static):
    qx, next_x = quantizer_set.x.quantize_2d(x2d, 1)
    qk, next_k = quantizer_set.kernel.quantize_2d(k2d, 0)
    split_fprop = quantizer_set.split_accumulator[0]
    out = fp8_gemm(qx, 1, qk, 0, split_fprop)
    if static.has_bias:
        out = out + bias.astype(jnp.float32)
    # wgrad contracts x's rows: 1x128 tiles become 128x1 tiles (stateless quantizers only).
    qx_rows = quantizer_set.x.quantize_2d(x2d, 0)[0] if _needs_second_layout(qx) else qx
    ctx = (qx_rows, qk, dataclasses.replace(quantizer_set, x=next_x, kernel=next_k))
    return out.astype(static.x_dtype), ctx


def _dense_fp8_bwd(static, ctx, grad):
    qx_rows, qk, quantizers = ctx
    qg, next_g = quantizers.dgrad.quantize_2d(grad, 1)
    _, split_dgrad, split_wgrad = quantizers.split_accumulator
    dgrad = fp8_gemm(qg, 1, qk, 1, split_dgrad)
    qg_rows = quantizers.dgrad.quantize_2d(grad, 0)[0] if _needs_second_layout(qg) else qg
    wgrad = fp8_gemm(qx_rows, 0, qg_rows, 0, split_wgrad)
    dbias = jnp.sum(grad.astype(jnp.float32), axis=0).astype(static.bias_dtype) if static.has_bias else None
    # The quantizers' successors are the "gradient" of the quantizer set: a train step that
    # overwrites the delayed-scaling variables with their gradients carries the state forward.
    return (dgrad.astype(static.x_dtype), wgrad.astype(static.kernel_dtype), dbias,
            dataclasses.replace(quantizers, dgrad=next_g))


_dense_fp8.defvjp(_dense_fp8_fwd, _dense_fp8_bwd)


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------


def _normalize_dims(ndim: int, dims, name: str) -> Tuple[int, ...]:
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    out = []
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise ValueError(f"`contracting_dims` must index the {name}'s {ndim} dims, got {dims}")
        out.append(d % ndim)
    return tuple(out)


def _constrain(x: jax.Array, axes: Optional[Tuple[str, ...]]) -> jax.Array:
    """TransformerEngine-JAX's logical-axes sharding constraint (Flax's rules); no-op without axes."""
    if not axes:
        return x
    import flax.linen as nn  # only when axes are given: dense itself does not need Flax

    return nn.with_logical_constraint(x, axes)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: Optional[jax.Array] = None,
    contracting_dims: Optional[Tuple[Sequence[int], Sequence[int]]] = None,
    transpose_batch_sequence: bool = False,
    input_axes: Optional[Tuple[str, ...]] = None,
    kernel_axes: Optional[Tuple[str, ...]] = None,
    output_axes: Optional[Tuple[str, ...]] = None,
    collective_op_set: CollectiveOpSet = noop_collective_op_set,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """``x`` contracted with ``kernel`` (plus ``bias``), in FP8 when ``quantizer_set`` quantizes.

    - ``x``: ``[*batch, *contracted]``; ``kernel``: ``[*contracted, *features]`` (TransformerEngine's
      "NN" layout: ``x``'s contracted dims last, ``kernel``'s first, in the same order).
    - ``contracting_dims``: ``(x_dims, kernel_dims)``; default ``((x.ndim - 1,), (0,))``.
    - ``bias``: ``[*features]`` or None, added in float32 before the cast to ``x.dtype``.
    - ``quantizer_set``: from :meth:`~transformer_engine.jax.flax.module.TransformerEngineBase.generate_quantizer_set`
      or :meth:`~transformer_engine.jax.quantize.QuantizerFactory.create_set`; ``noop_quantizer_set``
      computes in ``x.dtype`` (the kernel cast to it). With a delayed-scaling set, the gradient with
      respect to the set is its updated state (see :mod:`transformer_engine.jax.quantize`).
    - ``input_axes``, ``kernel_axes``, ``output_axes``: logical axes for sharding constraints.
    - ``transpose_batch_sequence``: accepted; the amaxes are of the whole tensor either way.
    - ``collective_op_set``: only ``noop_collective_op_set`` (collective GEMM overlap is not built).

    Returns ``[*batch, *features]`` in ``x.dtype``.
    """
    del transpose_batch_sequence
    if collective_op_set != noop_collective_op_set:
        raise NotImplementedError(f"`collective_op_set` must be noop_collective_op_set (collective GEMM overlap is "
                                  f"not implemented; XLA inserts the collectives), got {collective_op_set}")
    if not isinstance(quantizer_set, QuantizerSet):
        raise ValueError(f"`quantizer_set` must be a QuantizerSet, got {type(quantizer_set).__name__}")
    if contracting_dims is None:
        contracting_dims = ((x.ndim - 1,), (0,))
    x_dims = _normalize_dims(x.ndim, contracting_dims[0], "x")
    k_dims = _normalize_dims(kernel.ndim, contracting_dims[1], "kernel")
    n = len(x_dims)
    if len(k_dims) != n or x_dims != tuple(range(x.ndim - n, x.ndim)) or k_dims != tuple(range(n)):
        raise NotImplementedError(
            f"`contracting_dims` must contract x's last dims with kernel's first dims in order (the NN layout "
            f"TransformerEngine's dense takes), got {contracting_dims} for x {x.shape} and kernel {kernel.shape}")
    if x.shape[x.ndim - n:] != kernel.shape[:n]:
        raise ValueError(f"contracted sizes must match, got x {x.shape} and kernel {kernel.shape} with "
                         f"contracting_dims={contracting_dims}")
    features = kernel.shape[n:]
    if bias is not None and tuple(bias.shape) != tuple(features):
        raise ValueError(f"`bias` must have shape {tuple(features)}, got {tuple(bias.shape)}")
    x = _constrain(x, input_axes)
    kernel = _constrain(kernel, kernel_axes)
    batch = x.shape[:x.ndim - n]

    from transformer_engine.jax.batch_invariance import is_batch_invariant

    if is_batch_invariant():  # the kernels of PyTorch's batch-invariant mode (jax.batch_invariance)
        from transformer_engine.jax.batch_invariance import bi_matmul, check_no_fp8

        if not quantizer_set.is_noop:
            check_no_fp8("dense")
        size = math.prod(kernel.shape[:n])
        out = bi_matmul(x.reshape(math.prod(batch), size), kernel.reshape(size, -1),
                        None if bias is None else bias.reshape(-1))
        return _constrain(out.reshape(*batch, *features), output_axes)
    if quantizer_set.is_noop:
        out = jax.lax.dot_general(x, kernel.astype(x.dtype), ((x_dims, k_dims), ((), ())))
        if bias is not None:
            out = out + bias.astype(out.dtype)
        return _constrain(out, output_axes)
    if None in (quantizer_set.x, quantizer_set.kernel, quantizer_set.dgrad):
        raise NotImplementedError("`quantizer_set` must quantize x, kernel and dgrad, or none of them")

    contracted, feature_size = math.prod(kernel.shape[:n]), math.prod(features)
    x2d = x.reshape(math.prod(batch), contracted)
    k2d = kernel.reshape(contracted, feature_size)
    bias1d = bias.reshape(feature_size) if bias is not None else jnp.zeros((0,), x.dtype)
    static = _DenseStatic(bias is not None, jnp.dtype(x.dtype), jnp.dtype(kernel.dtype), jnp.dtype(bias1d.dtype))
    out = _dense_fp8(x2d, k2d, bias1d, quantizer_set, static)
    return _constrain(out.reshape(*batch, *features), output_axes)
