"""``grouped_dense``: TransformerEngine-JAX's grouped GEMM for MoE experts, ``y_r = x_r K_g (+ b_g)`` for each row
``r`` of group ``g``.

``x`` [M, K] holds the groups' rows one group after the other (``group_sizes[g]`` rows for group ``g``, in
order; a group may be empty), ``kernel`` [G, K, N] one matrix per group, ``bias`` [G, N]. Rows past
``sum(group_sizes)`` belong to no group: their outputs and gradients are zeros.

How it is computed, and why it is deterministic: each row's group index comes from the cumulative group sizes
(a comparison, no scatter). For each group in index order one dense GEMM runs over all M rows and its result is
kept only on that group's rows (``where``, a select: a row's output is exactly one GEMM's row, nothing is
accumulated across groups). The backward does the same: the input gradient is selected row by row from
``dy K_g^T``; each group's kernel gradient is ``x_g^T dy`` as one GEMM over all rows with the other groups' rows
zeroed (exact zeros add nothing), and each bias gradient a fixed-order pairwise sum over the rows. There is no
scatter-add and no atomic, so the result is the same bits run to run. The price is G full-size GEMMs where a
grouped GEMM kernel would do one: this is the correct, reproducible path, not a fast one.

FP8 (a non-empty ``quantizer_set``, TransformerEngine's grouped quantizer sets from
``QuantizerFactory.create_set(n_groups=...)``), ``group_offset`` and FSDP-sharded kernels
(``kernel_fsdp_info``) are refused by name.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.jax.attention_math import fixed_order_sum
from transformer_engine.jax.quantize import QuantizerSet, noop_quantizer_set

__all__ = ["grouped_dense"]


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check(x, kernel, group_sizes, contracting_dims, bias, group_offset, quantizer_set, kernel_fsdp_info):
    if tuple(map(tuple, contracting_dims)) != ((1,), (1,)):
        raise NotImplementedError(f"grouped_dense: `contracting_dims={contracting_dims!r}` is not implemented: "
                                  "only ((1,), (1,)) (x [M, K] times kernel [G, K, N]), as TransformerEngine-JAX")
    if group_offset is not None:
        raise NotImplementedError("grouped_dense: `group_offset=...` is not implemented (nor in "
                                  "TransformerEngine-JAX): the groups start at row 0")
    if kernel_fsdp_info is not None and kernel_fsdp_info[0] is not None:
        raise NotImplementedError(f"grouped_dense: `kernel_fsdp_info={kernel_fsdp_info!r}` is not implemented: "
                                  "the kernel is not FSDP-sharded here")
    if quantizer_set is not None and not (isinstance(quantizer_set, QuantizerSet) and quantizer_set.is_noop):
        raise NotImplementedError("grouped_dense: `quantizer_set` with quantizers (FP8) is not implemented: the "
                                  "grouped GEMMs run in the inputs' dtype (pass noop_quantizer_set)")
    if jnp.ndim(x) != 2:
        raise ValueError(f"`x` must be 2-D [M, K], got shape {jnp.shape(x)}")
    if jnp.ndim(kernel) != 3 or kernel.shape[1] != x.shape[1]:
        raise ValueError(f"`kernel` must be [G, K, N] with K = x.shape[1] = {x.shape[1]}, got shape "
                         f"{jnp.shape(kernel)}")
    g, n = kernel.shape[0], kernel.shape[2]
    if jnp.ndim(group_sizes) != 1 or group_sizes.shape[0] != g or not jnp.issubdtype(group_sizes.dtype,
                                                                                       jnp.integer):
        raise ValueError(f"`group_sizes` must be a 1-D integer array of G = {g} sizes, got "
                         f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)} {jnp.shape(group_sizes)}")
    if _is_concrete(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any() or sizes.sum() > x.shape[0]:
            raise ValueError(f"`group_sizes` must be non-negative and sum to at most x.shape[0] = {x.shape[0]}, "
                             f"got {sizes.tolist()}")
    if bias is not None and tuple(jnp.shape(bias)) != (g, n):
        raise ValueError(f"`bias` must have shape (G, N) = {(g, n)}, got {jnp.shape(bias)}")


def _group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each row's group index (G for rows past the last group): the number of group ends at or before it."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.sum(jnp.arange(rows, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1)


def _select_per_group(gid, num_groups, per_group, out_shape, dtype):
    """``out[r] = per_group(g)[r]`` for each row's group ``g`` (zeros for rows in no group); groups in order."""
    out = jnp.zeros(out_shape, dtype)
    for g in range(num_groups):
        out = jnp.where((gid == g)[:, None], per_group(g).astype(dtype), out)
    return out


def _out_dtype(x, kernel, preferred_element_type):
    return jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(x, kernel)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_dense(x, kernel, group_sizes, bias, precision, preferred_element_type):
    return _grouped_dense_fwd(x, kernel, group_sizes, bias, precision, preferred_element_type)[0]


def _grouped_dense_fwd(x, kernel, group_sizes, bias, precision, preferred_element_type):
    dtype = _out_dtype(x, kernel, preferred_element_type)
    gid = _group_ids(group_sizes, x.shape[0])
    out = _select_per_group(gid, kernel.shape[0], lambda g: jnp.dot(
        x, kernel[g], precision=precision, preferred_element_type=preferred_element_type),
        (x.shape[0], kernel.shape[2]), dtype)
    if bias is not None:
        in_group = (gid < kernel.shape[0])[:, None]
        b_rows = jnp.take(bias, jnp.minimum(gid, kernel.shape[0] - 1), axis=0)  # a gather: row r reads b_g
        out = jnp.where(in_group, (out + b_rows.astype(dtype)).astype(dtype), out)
    return out, (x, kernel, gid, bias)


def _grouped_dense_bwd(precision, preferred_element_type, res, dy):
    x, kernel, gid, bias = res
    num_groups = kernel.shape[0]
    dx = _select_per_group(gid, num_groups, lambda g: jnp.dot(
        dy, kernel[g].T, precision=precision, preferred_element_type=preferred_element_type), x.shape, x.dtype)
    dk, db = [], []
    for g in range(num_groups):
        mine = (gid == g)[:, None]
        x_g = jnp.where(mine, x, jnp.zeros_like(x))
        dk.append(jnp.dot(x_g.T, dy, precision=precision, preferred_element_type=preferred_element_type
                          ).astype(kernel.dtype))
        if bias is not None:
            dy_g = jnp.where(mine, dy, jnp.zeros_like(dy)).astype(jnp.promote_types(dy.dtype, jnp.float32))
            db.append(fixed_order_sum(dy_g, axis=0).astype(bias.dtype))
    dbias = jnp.stack(db) if bias is not None else None
    return dx, jnp.stack(dk), None, dbias


_grouped_dense.defvjp(_grouped_dense_fwd, _grouped_dense_bwd)


def grouped_dense(
    x: jnp.ndarray,
    kernel: jnp.ndarray,
    group_sizes: jnp.ndarray,
    contracting_dims: Tuple[Sequence[int], Sequence[int]] = ((1,), (1,)),
    bias: Optional[jnp.ndarray] = None,
    precision: jax.lax.Precision = jax.lax.Precision.DEFAULT,
    preferred_element_type: Optional[jnp.dtype] = None,
    group_offset: Optional[jnp.ndarray] = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
    kernel_fsdp_info: Tuple[Optional[str], int] = (None, -1),
) -> jnp.ndarray:
    """``x`` [M, K] (the groups' rows in order), ``kernel`` [G, K, N], ``group_sizes`` [G] (integers),
    ``bias`` [G, N] or None: returns [M, N] with row ``r`` of group ``g`` equal to ``x[r] @ kernel[g] + bias[g]``
    (zeros past ``sum(group_sizes)``), in ``preferred_element_type`` or the inputs' result type. Differentiable
    in ``x``, ``kernel`` and ``bias`` (module docstring: how, and why the bits repeat)."""
    _check(x, kernel, group_sizes, contracting_dims, bias, group_offset, quantizer_set, kernel_fsdp_info)
    return _grouped_dense(x, kernel, group_sizes, bias, precision, preferred_element_type)
