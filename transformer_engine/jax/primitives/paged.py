"""The fused forward on a paged KV cache: K and V read through a page table, in place.

A forward-only primitive pair (inner: what a device runs; outer: custom_partitioning), in the order of
:mod:`transformer_engine.jax.primitives.attention`, for :mod:`transformer_engine.jax.inference`. Operands:

- ``q`` ``[b, s_q, h_q, d_qk]`` (canonical BSHD; THD rows hold ``m`` segments);
- ``k_pages`` ``[num_pages, page_size, h_kv, d_qk]``, ``v_pages`` ``[num_pages, page_size, h_kv, d_v]``: the
  cache's pools;
- ``page_table`` int32 ``[b, m, n]``: segment ``j`` of row ``r`` keeps its key ``t`` in row ``t % page_size`` of
  page ``page_table[r, j, t // page_size]`` (entries past its keys are never read);
- ``q_seqlens``, ``kv_seqlens`` ``[b, m]``, ``q_offsets`` ``[b, m + 1]`` (the queries' segments, as the fused
  primitives take them; the keys' places are the table's) and ``softmax_offset`` fp32 ``[h_q]``.

Results: the output ``[b, s_q, h_q, d_v]`` and the softmax aux ``[b, m, h_q, s_q]``, the bits of the fused
forward on the pages gathered into rows ``[b, m * n * page_size, ...]`` (segment ``j`` from key
``j * n * page_size``): on CUDA the planned forward follows the table (``PAGE_SIZE``: the Triton forward, or
Hopper's Gluon one where its loader follows pages of this size; the frontend takes this primitive only where that
plan is the gathered call's, :func:`transformer_engine.common.attention.plan.pages_keep_bits`); on CPU the lowering
gathers and computes the fused primitives' jnp math on the gathered rows (for tests).

Sharding: batch and heads stay split as they come (dp/fsdp, tp); the pools' page axes are replicated, since
the table holds global page indices (a dp-split cache runs inside ``shard_map``, each device with its own
pool and table). Gradients (:func:`fused_attn_paged`'s custom VJP) recompute the step on gathered rows and run
the fused backward there, so they are the gathered call's; the page table and lengths get none.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir

from transformer_engine.common.attention.validation import kernel_scale
from transformer_engine.jax import attention_math
from transformer_engine.jax.attention_math import SeqInfo
from transformer_engine.jax.primitives import attention as _prim
from transformer_engine.jax.primitives.attention import FusedAttnStatic

__all__ = ["gather_pages", "gathered_seq_info", "fused_attn_paged"]

_NAMES = ("q", "k", "v", "page_table", "q_seqlens", "kv_seqlens", "q_offsets", "softmax_offset")


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """``pages`` ``[num_pages, page_size, h, d]`` gathered through ``page_table`` ``[b, m, n]`` into rows
    ``[b, m * n * page_size, h, d]`` (a negative entry reads page 0: past its segment's keys)."""
    b, m, n = page_table.shape
    rows = pages[jnp.maximum(page_table, 0)]
    return rows.reshape(b, m * n * pages.shape[1], *pages.shape[2:])


def gathered_seq_info(q_seqlens, kv_seqlens, q_offsets, page_table, page_size: int) -> SeqInfo:
    """The segments of the gathered call (:func:`gather_pages`): segment ``j`` of each row from key
    ``j * n * page_size``."""
    b, m, n = page_table.shape
    kv_offsets = jnp.broadcast_to(jnp.arange(m + 1, dtype=jnp.int32) * (n * page_size), (b, m + 1))
    return SeqInfo(q_seqlens.astype(jnp.int32), kv_seqlens.astype(jnp.int32), q_offsets.astype(jnp.int32),
                   kv_offsets)


# ================================================================================================
# Checks
# ================================================================================================


def _check_operands(static: FusedAttnStatic, q, k_pages, v_pages, page_table, q_seqlens, kv_seqlens, q_offsets,
                    softmax_offset):
    """Shapes and dtypes of the canonical operands (the frontend has already named user errors)."""
    if static.kv_page_size is None or static.kv_page_size != k_pages.shape[1]:
        raise ValueError(f"`kv_page_size` must be the pools' page size {k_pages.shape[1]}, got "
                         f"{static.kv_page_size}")
    if not static.attn_mask_type.is_padding():
        raise ValueError(f"`attn_mask_type` must be a padding mask with a page table, got "
                         f"{static.attn_mask_type.value!r}")
    if static.has_bias or static.has_dropout:
        raise ValueError("a paged KV cache forward takes no bias and no dropout")
    if len(q.shape) != 4 or q.dtype not in _prim._SUPPORTED_DTYPES:
        raise ValueError(f"`q` must be float16, bfloat16 or float32 [b, s_q, h_q, d], got {q.dtype}{list(q.shape)}")
    b, s_q, h_q, d_qk = q.shape
    for name, x, d in (("k_pages", k_pages, d_qk), ("v_pages", v_pages, None)):
        if len(x.shape) != 4 or x.dtype != q.dtype or (d is not None and x.shape[3] != d):
            raise ValueError(f"`{name}` must be {q.dtype} [num_pages, page_size, h_kv, "
                             f"{d if d is not None else 'd_v'}], got {x.dtype}{list(x.shape)}")
    if v_pages.shape[:3] != k_pages.shape[:3] or h_q % k_pages.shape[2]:
        raise ValueError(f"`v_pages` must match `k_pages` in pages and heads, and q's heads ({h_q}) be a multiple "
                         f"of theirs, got {list(k_pages.shape)} and {list(v_pages.shape)}")
    if len(page_table.shape) != 3 or page_table.shape[0] != b or page_table.dtype != jnp.int32:
        raise ValueError(f"`page_table` must be int32 [{b}, segments, pages_per_sequence], got "
                         f"{page_table.dtype}{list(page_table.shape)}")
    m = page_table.shape[1]
    for name, x, width in (("q_seqlens", q_seqlens, m), ("kv_seqlens", kv_seqlens, m), ("q_offsets", q_offsets, m + 1)):
        if x.shape != (b, width) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be int [{b}, {width}] (page_table's {m} segments per row), got "
                             f"{x.dtype}{list(x.shape)}")
    if softmax_offset.shape != (h_q,) or softmax_offset.dtype != jnp.float32:
        raise ValueError(f"`softmax_offset` must be float32 [{h_q}], got {softmax_offset.dtype}"
                         f"{list(softmax_offset.shape)}")


# ================================================================================================
# Implementation (CPU: the gathered rows' jnp math), abstract evaluation, lowering
# ================================================================================================


def _impl(q, k_pages, v_pages, page_table, q_seqlens, kv_seqlens, q_offsets, softmax_offset, *, static):
    seq = gathered_seq_info(q_seqlens, kv_seqlens, q_offsets, page_table, static.kv_page_size)
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    seeds = jnp.zeros((q.shape[0], q.shape[2], 2), jnp.uint32)
    out, lse = attention_math.fused_fwd_math(q, k, v, None, seq, seeds, static=static, softmax_offset=softmax_offset)
    return out, attention_math.lse_to_segments(lse, seq)


def _abstract(q, k_pages, v_pages, page_table, q_seqlens, kv_seqlens, q_offsets, softmax_offset, *, static):
    operands = (q, k_pages, v_pages, page_table, q_seqlens, kv_seqlens, q_offsets, softmax_offset)
    _check_operands(static, *operands)
    b, s_q, h_q, _ = q.shape
    out = _prim._typed((b, s_q, h_q, v_pages.shape[3]), q.dtype, operands)
    aux = _prim._typed(attention_math.softmax_aux_shape(b, page_table.shape[1], h_q, s_q), jnp.float32, operands)
    return out, aux


_cpu_lowering = mlir.lower_fun(_impl, multiple_results=True)


def _cuda_lowering(ctx, *args, static):
    from transformer_engine.jax.primitives import gpu

    return gpu.fused_attn_paged_fwd_lowering(ctx, *args, static=static)


def _rocm_lowering(ctx, *args, **kwargs):
    from transformer_engine.jax.primitives import gpu

    return gpu.rocm_lowering(ctx, *args, **kwargs)


# ================================================================================================
# custom_partitioning: batch and heads as they come; the pools' page axes replicated
# ================================================================================================


def _shardings(static, mesh, arg_shapes):
    infos = dict(zip(_NAMES, arg_shapes))
    layout = _prim._layout(static, mesh, infos, (("q", 1),))
    L = layout
    args = (L.named(L.batch, None, L.heads, None), L.named(None, None, L.kv_heads, None),
            L.named(None, None, L.kv_heads, None), L.named(L.batch, None, None), L.named(L.batch, None),
            L.named(L.batch, None), L.named(L.batch, None), L.named(L.heads))
    results = (L.named(L.batch, None, L.heads, None), L.named(L.batch, None, L.heads, None))
    return args, results


def _result_shardings(static, mesh, arg_shapes, result_shape):
    return _shardings(static, mesh, arg_shapes)[1]


def _partition(static, mesh, arg_shapes, result_shape):
    args, results = _shardings(static, mesh, arg_shapes)

    def lower_fn(*operands):
        return tuple(_inner_p.bind(*operands, static=static))

    return mesh, lower_fn, results, args


def _sharding_rule(static, mesh, value_types, result_types):
    q, k = _prim._dims(value_types[0]), _prim._dims(value_types[1])
    hq, sizes = _prim._head_factor(q[2], k[2])
    operands = [f"b s {hq} d", "p r kh d", "p r kh e", "b m n", "b m", "b m", "b m1", hq]
    rule = ", ".join(operands) + f" -> b s {hq} e, b m {hq} s"
    return rule, dict(sizes, need_replication_factors=("d", "p", "r", "e", "n"))


def _partitioned(static, *operands):
    return tuple(_inner_p.bind(*operands, static=static))


_cp = custom_partitioning(_partitioned, static_argnums=(0,))
_cp.def_partition(partition=_partition, infer_sharding_from_operands=_result_shardings,
                  sharding_rule=_sharding_rule)


def _outer_lowering(ctx, *args, static):
    return mlir.lower_fun(functools.partial(_cp, static), multiple_results=True)(ctx, *args)


# ================================================================================================
# Registration
# ================================================================================================

_inner_p = _prim._make_primitive("te_fused_attn_paged_fwd", _abstract, eager=True)
_outer_p = _prim._make_primitive("te_fused_attn_paged_fwd_wrapper", _abstract, eager=True)
mlir.register_lowering(_inner_p, _cpu_lowering, platform="cpu")
mlir.register_lowering(_inner_p, _cuda_lowering, platform="cuda")
mlir.register_lowering(_inner_p, _rocm_lowering, platform="rocm")
dispatch.prim_requires_devices_during_lowering.add(_outer_p)
mlir.register_lowering(_outer_p, _outer_lowering)


# ================================================================================================
# custom_vjp and public function
# ================================================================================================


def _bind(static, q, k_pages, v_pages, page_table, seq, offset):
    operands = _prim._vary_like(q, k_pages, v_pages, page_table, *seq, offset)
    return tuple(_outer_p.bind(*operands, static=static))


def _gathered(static, q, k_pages, v_pages, offset, page_table, seq):
    """The same call on the pages gathered into rows (the fused primitives' own path)."""
    rows = gathered_seq_info(*seq, page_table, static.kv_page_size)
    plain = dataclasses.replace(static, kv_page_size=None)
    seeds = jnp.zeros((q.shape[0], q.shape[2], 2), jnp.uint32)
    return _prim.fused_attn_core(q, gather_pages(k_pages, page_table), gather_pages(v_pages, page_table), None,
                                 rows, seeds, plain, offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged(static, q, k_pages, v_pages, offset, page_table, seq):
    return _paged_fwd_rule(static, q, k_pages, v_pages, offset, page_table, seq)[0]


def _paged_fwd_rule(static, q, k_pages, v_pages, offset, page_table, seq):
    sink = attention_math.sink_logits(static.softmax_type, offset, q.shape[2])
    sink = jnp.zeros((q.shape[2],), jnp.float32) if sink is None else sink
    out, _ = _bind(static, q, k_pages, v_pages, page_table, seq, sink)
    return jax.ad_checkpoint.checkpoint_name(out, static.checkpoint_name), (q, k_pages, v_pages, offset, page_table,
                                                                             seq)


def _paged_bwd_rule(static, residuals, dout):
    # The fused backward reads no page table: recompute the step on gathered rows (the same forward bits) and
    # take that call's gradients; the pools' gradients scatter back through the gather.
    q, k_pages, v_pages, offset, page_table, seq = residuals
    _, vjp = jax.vjp(lambda *xs: _gathered(static, *xs, page_table, seq), q, k_pages, v_pages, offset)
    dq, dk, dv, doffset = vjp(dout)
    zeros = jax.tree_util.tree_map(lambda x: None, (page_table, seq))
    return (dq, dk, dv, doffset) + zeros


_paged.defvjp(_paged_fwd_rule, _paged_bwd_rule)


def fused_attn_paged(q, k_pages, v_pages, page_table, seq: SeqInfo, static: FusedAttnStatic,
                     softmax_offset=None) -> jax.Array:
    """The fused forward on a paged cache (module docstring): ``seq`` is ``(q_seqlens, kv_seqlens, q_offsets)``
    of the queries' segments; ``static.kv_page_size`` the pools' page size; ``softmax_offset``: the learnable
    sink logits (``[h_q]``), None for the other softmax types. Returns ``[b, s_q, h_q, d_v]``; differentiable
    in ``q``, the pools and the learnable sink (through the gathered call)."""
    if static.return_max_logit:
        raise NotImplementedError("`return_max_logit` with a page table is not supported")
    page_table = jnp.asarray(page_table)
    if page_table.dtype != jnp.int32 or page_table.ndim != 3 or page_table.shape[0] != q.shape[0]:
        raise ValueError(f"`page_table` must be int32 [{q.shape[0]}, segments, pages_per_sequence], got "
                         f"{page_table.dtype}{list(page_table.shape)}")
    seq = tuple(jnp.asarray(x, jnp.int32) for x in seq)
    # The kernels take a positive scale: a zero or negative one runs on 0 * q or -q (as fused_attn_core).
    q_factor, scale = kernel_scale(static.scaling_factor)
    if q_factor != 1.0:
        q = q * jnp.asarray(q_factor, q.dtype)
        static = dataclasses.replace(static, scaling_factor=scale)
    return _paged(static, q, k_pages, v_pages, softmax_offset, page_table, seq)
