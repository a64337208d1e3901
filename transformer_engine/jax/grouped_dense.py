"""``grouped_dense``: TransformerEngine-JAX's grouped GEMM for MoE experts, ``y_r = x_r K_g (+ b_g)`` for each row
``r`` of group ``g``.

``x`` [M, K] holds the groups' rows one group after the other (``group_sizes[g]`` rows for group ``g``, in
order; a group may be empty), ``kernel`` [G, K, N] one matrix per group, ``bias`` [G, N]. Rows past
``sum(group_sizes)`` belong to no group: their outputs and gradients are zeros.

How it is computed, and why it is deterministic: each row's group index comes from the cumulative group sizes
(a comparison, no search or scatter). The rows are cut into tiles of ``TILE_ROWS``; the (tile, group) pairs
that hold rows are at most ``tiles + G - 1`` (a static count: the groups of a tile form a range, and
consecutive tiles share at most one group), and each pair is one GEMM of its tile with its group's matrix, run one
after the other (``lax.scan``). A row's output is gathered from its own pair's GEMM (rows of other groups in that
tile are computed and dropped, a select), so nothing is accumulated across groups; the input gradient likewise.
Each group's kernel gradient adds its tiles' ``x_t^T dy_t`` (other groups' rows zeroed) in tile order into its
own slot, and each bias gradient adds fixed-order pairwise row sums the same way, in float32. No scatter-add, no
atomics: the same bits run to run. The GEMM work is about ``(M + G * TILE_ROWS) K N`` (one GEMM over the rows,
plus at most one partial tile per group), not ``G M K N``.

FP8 (a non-empty ``quantizer_set``, TransformerEngine's grouped quantizer sets from
``QuantizerFactory.create_set(n_groups=...)``), ``group_offset`` and FSDP-sharded kernels
(``kernel_fsdp_info``) are refused by name.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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


# Rows per tile: the GEMMs run on tiles of this many rows, one tile and one group at a time.
TILE_ROWS = 128


class _Plan(NamedTuple):
    """Which (tile, group) pairs hold rows, and where each row's result lies (all shapes static)."""

    gid: jax.Array        # [Mp] each row's group, G for rows in no group
    tile_of: jax.Array    # [W] the tile of work item w
    group_of: jax.Array   # [W] the group of work item w (0 for the unused items past the last)
    valid: jax.Array      # [W] whether item w is one of the pairs
    item_of_row: jax.Array  # [Mp] the work item that computed row r


def _plan(group_sizes: jax.Array, padded_rows: int, tile: int, num_groups: int) -> _Plan:
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(padded_rows, dtype=jnp.int32)
    gid = jnp.sum(rows[:, None] >= ends[None, :], axis=1).astype(jnp.int32)  # non-decreasing in r
    gid_c = jnp.minimum(gid, num_groups - 1)
    tiles = padded_rows // tile
    first, last = gid_c[::tile], gid_c[tile - 1::tile]
    count = last - first + 1  # the groups a tile touches form a range: its first row's group to its last's
    start = jnp.cumsum(count) - count
    # Ranges of consecutive tiles overlap in at most one group, so there are at most tiles + G - 1 pairs.
    items = jnp.arange(tiles + num_groups - 1, dtype=jnp.int32)
    tile_of = jnp.sum(items[:, None] >= start[None, 1:], axis=1).astype(jnp.int32)
    valid = items < start[-1] + count[-1]
    group_of = jnp.where(valid, first[tile_of] + items - start[tile_of], 0)
    row_tile = rows // tile
    item_of_row = start[row_tile] + gid_c - first[row_tile]
    return _Plan(gid, tile_of, group_of, valid, item_of_row)


def _tiled_gemms(a_tiles, kernel, plan, transpose_kernel, precision, preferred_element_type):
    """``a_tiles[t] @ kernel[g]`` (or ``kernel[g]^T``) for each work item, one after the other: [W, T, N]."""
    def body(_, item):
        t, g = item
        k = lax.dynamic_index_in_dim(kernel, g, keepdims=False)
        return None, jnp.dot(lax.dynamic_index_in_dim(a_tiles, t, keepdims=False), k.T if transpose_kernel else k,
                             precision=precision, preferred_element_type=preferred_element_type)
    return lax.scan(body, None, (plan.tile_of, plan.group_of))[1]


def _rows_from_items(per_item, plan, tile, rows, num_groups, dtype):
    """Row r's result from the item that computed it (a gather, no scatter; zeros for rows in no group), for
    the first ``rows`` rows."""
    r = jnp.arange(plan.gid.shape[0], dtype=jnp.int32)
    out = per_item[plan.item_of_row, r % tile].astype(dtype)
    return jnp.where((plan.gid < num_groups)[:, None], out, jnp.zeros_like(out))[:rows]


def _tiles(a, padded_rows, tile):
    a = jnp.pad(a, ((0, padded_rows - a.shape[0]), (0, 0)))
    return a.reshape(padded_rows // tile, tile, a.shape[1])


def _layout(rows):
    tile = min(TILE_ROWS, max(rows, 1))
    return tile, -(-max(rows, 1) // tile) * tile


def _out_dtype(x, kernel, preferred_element_type):
    return jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(x, kernel)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_dense(x, kernel, group_sizes, bias, precision, preferred_element_type):
    return _grouped_dense_fwd(x, kernel, group_sizes, bias, precision, preferred_element_type)[0]


def _grouped_dense_fwd(x, kernel, group_sizes, bias, precision, preferred_element_type):
    dtype = _out_dtype(x, kernel, preferred_element_type)
    rows, num_groups = x.shape[0], kernel.shape[0]
    tile, padded = _layout(rows)
    plan = _plan(group_sizes, padded, tile, num_groups)
    per_item = _tiled_gemms(_tiles(x, padded, tile), kernel, plan, False, precision, preferred_element_type)
    out = _rows_from_items(per_item, plan, tile, rows, num_groups, dtype)
    if bias is not None:
        gid = plan.gid[:rows]
        b_rows = jnp.take(bias, jnp.minimum(gid, num_groups - 1), axis=0)  # a gather: row r reads b_g
        out = jnp.where((gid < num_groups)[:, None], (out + b_rows.astype(dtype)).astype(dtype), out)
    return out, (x, kernel, group_sizes, bias)


def _grouped_dense_bwd(precision, preferred_element_type, res, dy):
    x, kernel, group_sizes, bias = res
    rows, num_groups = x.shape[0], kernel.shape[0]
    tile, padded = _layout(rows)
    plan = _plan(group_sizes, padded, tile, num_groups)
    dy_tiles, x_tiles = _tiles(dy, padded, tile), _tiles(x, padded, tile)
    dx = _rows_from_items(_tiled_gemms(dy_tiles, kernel, plan, True, precision, preferred_element_type), plan,
                          tile, rows, num_groups, x.dtype)
    gid_tiles = plan.gid.reshape(-1, tile)
    acc = jnp.promote_types(jnp.result_type(x, dy), jnp.float32)

    def body(carry, item):
        # Work items in order: each group's kernel (and bias) gradient adds its tiles' partial products in tile
        # order, into its own slot of the carry (no scatter-add: one group per step).
        dk, db = carry
        t, g, ok = item
        mine = ((lax.dynamic_index_in_dim(gid_tiles, t, keepdims=False) == g) & ok)[:, None]
        x_t = jnp.where(mine, lax.dynamic_index_in_dim(x_tiles, t, keepdims=False), 0)
        dy_t = jnp.where(mine, lax.dynamic_index_in_dim(dy_tiles, t, keepdims=False), 0)
        part = jnp.dot(x_t.T, dy_t, precision=precision, preferred_element_type=acc)
        dk = lax.dynamic_update_index_in_dim(dk, lax.dynamic_index_in_dim(dk, g, keepdims=False) + part, g, 0)
        if db is not None:
            col = fixed_order_sum(dy_t.astype(acc), axis=0)
            db = lax.dynamic_update_index_in_dim(db, lax.dynamic_index_in_dim(db, g, keepdims=False) + col, g, 0)
        return (dk, db), None

    init = (jnp.zeros(kernel.shape, acc), None if bias is None else jnp.zeros(bias.shape, acc))
    (dk, db), _ = lax.scan(body, init, (plan.tile_of, plan.group_of, plan.valid))
    return dx, dk.astype(kernel.dtype), None, None if bias is None else db.astype(bias.dtype)


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
    from transformer_engine.jax.batch_invariance import is_batch_invariant

    if is_batch_invariant():
        raise NotImplementedError(
            "grouped_dense in batch-invariant mode is not implemented: its GEMMs are XLA's dots, whose algorithm "
            "depends on the row count; leave transformer_engine.jax.batch_invariant() (or unset NVTE_BATCH_INVARIANT)")
    return _grouped_dense(x, kernel, group_sizes, bias, precision, preferred_element_type)
