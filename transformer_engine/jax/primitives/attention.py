"""Fused attention primitives: forward and backward, in the fixed order.

checks -> implementation -> abstract eval -> lowering -> batching rule -> custom_partitioning
with its sharding rule -> registration -> custom_vjp -> public function.

Each of forward and backward is a pair of primitives:

- the *inner* primitive is what a device runs: abstract eval plus one lowering per platform
  (CPU: the jnp math of :mod:`transformer_engine.jax.attention_math` in fp32, through
  ``mlir.lower_fun``; CUDA: the Triton kernels, :mod:`transformer_engine.jax.primitives.gpu`);
- the *outer* primitive is what user code binds: it has the batching rule (``vmap`` folds the
  extra axis into the batch) and lowers through ``custom_partitioning``, whose rule keeps batch
  and heads sharded as they come (dp/fsdp, tp) and runs the inner primitive on each shard.

Operands are canonical BSHD tensors (see ``attention_math``); static arguments travel in one
frozen :class:`FusedAttnStatic`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from transformer_engine.common.attention.enums import AttnBiasType, BackwardGrads
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.validation import kernel_scale
from transformer_engine.jax import attention_math, jax_compat
from transformer_engine.jax.attention_math import SeqInfo

__all__ = ["FusedAttnStatic", "fused_attn_core", "fused_attn_fwd", "fused_attn_bwd", "max_logit"]

_SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@dataclass(frozen=True)
class FusedAttnStatic(AttnParams):
    """Static (trace-time) arguments of the fused attention primitives: the call's
    :class:`~transformer_engine.common.attention.params.AttnParams` (``qkv_format`` is the user's format;
    tensors reaching the primitive are BSHD; a None ``bottom_right_diagonal`` takes TransformerEngine-JAX's
    default, bottom-right for the bottom-right causal masks only) and what only the primitives read."""

    framework: ClassVar[str] = "jax"

    checkpoint_name: str = "context"  # names the output and the saved statistics for remat policies
    # The backward primitive's gradient passes (the forward ignores it): DQ leaves dk, dv zeros and DKDV
    # leaves dq zeros (the shapes stay); a gradient it computes is bitwise the whole backward's.
    backward_grads: BackwardGrads = BackwardGrads.DQ_DKDV


# ================================================================================================
# Checks
# ================================================================================================


def _check_operands(static: FusedAttnStatic, q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
                    softmax_offset):
    """Validate canonical operands (shapes and dtypes); the frontend has already named user errors."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"`{name}` must be [batch, seqlen, heads, head_dim], got shape {x.shape}")
        if x.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"`{name}` must be float16, bfloat16 or float32, got {x.dtype}")
    b, s_q, h_q, d_qk = q.shape
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"`q`, `k`, `v` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"`q`, `k`, `v` must share the batch size, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[3] != d_qk:
        raise ValueError(f"`k` must have head_dim {d_qk} like `q`, got shape {k.shape}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"`v` must match `k` in seqlen and heads, got {v.shape} and {k.shape}")
    if h_q % k.shape[2]:
        raise ValueError(f"`q` heads ({h_q}) must be a multiple of `k` heads ({k.shape[2]})")
    if static.has_bias:
        if len(bias.shape) != 4 or bias.shape[2:] != (s_q, k.shape[1]) or bias.shape[0] not in (1, b) or (
            bias.shape[1] not in (1, h_q)
        ):
            raise ValueError(
                f"`bias` must be [1|{b}, 1|{h_q}, {s_q}, {k.shape[1]}], got shape {bias.shape}"
            )
    for name, x, width in (
        ("q_seqlens", q_seqlens, None),
        ("kv_seqlens", kv_seqlens, None),
        ("q_offsets", q_offsets, 1),
        ("kv_offsets", kv_offsets, 1),
    ):
        m = q_seqlens.shape[-1]
        if x.shape != (b, m + (width or 0)) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be int [{b}, {m + (width or 0)}], got {x.dtype}{list(x.shape)}")
    if seeds.shape != (b, h_q, 2) or seeds.dtype != jnp.uint32:
        raise ValueError(f"`seeds` must be uint32 [{b}, {h_q}, 2], got {seeds.dtype}{list(seeds.shape)}")
    if softmax_offset.shape != (h_q,) or softmax_offset.dtype != jnp.float32:
        raise ValueError(f"`softmax_offset` must be float32 [{h_q}], got {softmax_offset.dtype}{list(softmax_offset.shape)}")


# ================================================================================================
# Implementation (the jnp math the CPU lowering computes)
# ================================================================================================


def _fwd_impl(q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset, *, static):
    seq = SeqInfo(q_seqlens, kv_seqlens, q_offsets, kv_offsets)
    bias = bias if static.has_bias else None
    out, lse = attention_math.fused_fwd_math(q, k, v, bias, seq, seeds, static=static, softmax_offset=softmax_offset)
    results = (out, attention_math.lse_to_segments(lse, seq))
    if static.return_max_logit:
        row_max = attention_math.fused_row_max(q, k, bias, seq, static=static)
        results += (attention_math.lse_to_segments(row_max, seq, fill=-jnp.inf),)
    return results


def _bwd_impl(q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
              softmax_offset, *, static):
    seq = SeqInfo(q_seqlens, kv_seqlens, q_offsets, kv_offsets)
    lse = attention_math.lse_to_tokens(softmax_aux, seq)
    dq, dk, dv, dbias = attention_math.fused_bwd_math(
        q, k, v, bias if static.has_bias else None, out, dout, lse, seq, seeds, static=static
    )
    dq, dk, dv = unrequested_to_zeros(static.backward_grads, dq, dk, dv)
    if dbias is None:
        dbias = jnp.zeros_like(bias)
    if static.softmax_type.is_learnable:
        dsink = attention_math.sink_grad_parts(lse, attention_math.row_delta(out, dout), seq, softmax_offset)
    else:
        dsink = jnp.zeros(_dsink_shape(q, q_seqlens), jnp.float32)
    return dq, dk, dv, dbias, dsink


def unrequested_to_zeros(grads: BackwardGrads, dq, dk, dv):
    """(dq, dk, dv) with the gradients ``grads`` leaves out as zeros (XLA then drops their math)."""
    if not grads.has_dq:
        dq = jnp.zeros_like(dq)
    if not grads.has_dkdv:
        dk, dv = jnp.zeros_like(dk), jnp.zeros_like(dv)
    return dq, dk, dv


def _dsink_shape(q, q_seqlens) -> Tuple[int, int, int]:
    """Each sequence's part of d softmax_offset: ``[b, m, h_q]`` (zeros unless the sink is learnable)."""
    return (q.shape[0], q_seqlens.shape[1], q.shape[2])


# ================================================================================================
# Abstract evaluation
# ================================================================================================
#
# Inside ``shard_map`` every value's type also says over which manual mesh axes it varies (JAX's
# "vma"; ``ShapedArray.manual_axis_type`` in jax 0.10, ``vma`` later). The results vary over what
# the operands vary over: the public binders below first make every operand vary over the union
# (``_vary_like``), and the abstract rules give the results that type (``_typed``). Without it the
# results would claim to be replicated, and the custom_vjp's backward rule would return cotangents
# of another type than its primal inputs (JAX rejects that).


_varying = jax_compat.varying_axes


def _typed(shape, dtype, operands):
    """``ShapedArray(shape, dtype)`` varying over the manual axes of the most-varying operand."""
    template = max(operands, key=lambda a: len(_varying(a)))
    if not _varying(template):
        return jax.core.ShapedArray(shape, dtype)
    # The type names the (abstract) mesh of the manual axes: take it from the operand's sharding.
    sharding = NamedSharding(template.sharding.mesh, PartitionSpec(*([None] * len(shape))))
    field = jax_compat.manual_axes_field(template)
    return jax.core.ShapedArray(shape, dtype, sharding=sharding, **{field: getattr(template, field)})


def _vary_like(*xs):
    """``xs`` (arrays or None), each made to vary over the union of the manual axes they vary over
    (``jax.lax.pcast(..., to='varying')``, ``pvary`` in older jax; its transpose is a psum, so the
    cotangent of a replicated operand is summed over the axis, as the chain rule wants). Identity
    outside shard_map."""
    arrays = [x for x in jax.tree_util.tree_leaves(xs) if x is not None]
    union = frozenset().union(*(_varying(jax.typeof(x)) for x in arrays)) if arrays else frozenset()
    if not union:
        return xs

    def vary(x):
        missing = tuple(sorted(union - _varying(jax.typeof(x))))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return jax.tree_util.tree_map(vary, xs)


def _fwd_abstract(q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset, *, static):
    _check_operands(static, q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset)
    b, s_q, h_q, _ = q.shape
    operands = (q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset)
    out = _typed((b, s_q, h_q, v.shape[3]), q.dtype, operands)
    aux = _typed(attention_math.softmax_aux_shape(b, q_seqlens.shape[1], h_q, s_q), jnp.float32, operands)
    if static.return_max_logit:  # each row's max logit, laid out as the softmax aux (-inf where none)
        return out, aux, _typed(aux.shape, jnp.float32, operands)
    return out, aux


def _bwd_abstract(q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
                  softmax_offset, *, static):
    _check_operands(static, q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset)
    expected_out = (*q.shape[:3], v.shape[3])
    for name, x in (("out", out), ("dout", dout)):
        if x.shape != expected_out or x.dtype != q.dtype:
            raise ValueError(f"`{name}` must be {q.dtype}{list(expected_out)}, got {x.dtype}{list(x.shape)}")
    aux_shape = attention_math.softmax_aux_shape(q.shape[0], q_seqlens.shape[1], q.shape[2], q.shape[1])
    if softmax_aux.shape != aux_shape or softmax_aux.dtype != jnp.float32:
        raise ValueError(f"`softmax_aux` must be float32{list(aux_shape)}, got {softmax_aux.dtype}{list(softmax_aux.shape)}")
    operands = (q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
                softmax_offset)
    grads = tuple(_typed(x.shape, x.dtype, operands) for x in (q, k, v, bias))
    return grads + (_typed(_dsink_shape(q, q_seqlens), jnp.float32, operands),)


# ================================================================================================
# Lowering
# ================================================================================================

_fwd_jnp_lowering = mlir.lower_fun(_fwd_impl, multiple_results=True)
_bwd_jnp_lowering = mlir.lower_fun(_bwd_impl, multiple_results=True)


def _fwd_cpu_lowering(ctx, *args, static):
    """The jnp math, or with NVTE_JAX_TRITON_INTERPRET=1 the Triton kernels under the interpreter (primitives.interpret)."""
    from transformer_engine.jax.primitives import interpret

    if interpret.interpreting():
        return interpret.fwd_lowering(ctx, *args, static=static)
    return _fwd_jnp_lowering(ctx, *args, static=static)


def _bwd_cpu_lowering(ctx, *args, static):
    from transformer_engine.jax.primitives import interpret

    if interpret.interpreting():
        return interpret.bwd_lowering(ctx, *args, static=static)
    return _bwd_jnp_lowering(ctx, *args, static=static)


def _fwd_cuda_lowering(ctx, *args, static):
    from transformer_engine.jax.primitives import gpu

    return gpu.fused_attn_fwd_lowering(ctx, *args, static=static)


def _bwd_cuda_lowering(ctx, *args, static):
    from transformer_engine.jax.primitives import gpu

    return gpu.fused_attn_bwd_lowering(ctx, *args, static=static)


# ================================================================================================
# Batching rule: vmap folds the mapped axis into the batch axis
# ================================================================================================


def _axis_size(args, dims) -> int:
    return next(x.shape[d] for x, d in zip(args, dims) if d is not None)


def _to_front(x, dim, n):
    """Mapped axis first; an unmapped operand is broadcast (every vmap instance sees the same)."""
    if dim is None:
        return jnp.broadcast_to(x, (n, *x.shape))
    return jnp.moveaxis(x, dim, 0)


def _fold(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _fold_operands(static, args, dims, bias_index):
    """Move the mapped axis of every operand to the front and merge it with the batch axis. A
    batch-broadcast bias ([1, ...]) is broadcast to the batch first, so each row keeps its own
    gradient. The per-head softmax_offset (last operand) stays as it is. Returns the folded
    operands, the vmap size and the batch size."""
    if dims[-1] is not None:
        raise NotImplementedError("fused_attn: `softmax_offset` must not be batched under vmap (it is one sink "
                                  "logit per head for the whole batch)")
    n = _axis_size(args, dims)
    fronted = [_to_front(x, d, n) for x, d in zip(args[:-1], dims[:-1])]
    b = fronted[0].shape[1]
    folded = []
    for i, x in enumerate(fronted):
        if i == bias_index:
            if not static.has_bias:
                folded.append(args[i] if dims[i] is None else x[0])
                continue
            x = jnp.broadcast_to(x, (n, b, *x.shape[2:]))
        folded.append(_fold(x))
    return folded + [args[-1]], n, b


def _unfold(x, n, b):
    return x.reshape(n, b, *x.shape[1:])


def _fwd_batch(args, dims, *, static):
    folded, n, b = _fold_operands(static, args, dims, bias_index=3)
    results = _fwd_outer_p.bind(*folded, static=static)
    return tuple(_unfold(x, n, b) for x in results), (0,) * len(results)


def _bwd_batch(args, dims, *, static):
    folded, n, b = _fold_operands(static, args, dims, bias_index=3)
    dq, dk, dv, dbias, dsink = _bwd_outer_p.bind(*folded, static=static)
    dsink = _unfold(dsink, n, b)
    if static.has_bias:
        bias, bias_dim = args[3], dims[3]
        bias_batch = bias.shape[1 if bias_dim == 0 else 0] if bias_dim is not None else bias.shape[0]
        dbias = _unfold(dbias, n, b)
        if bias_batch == 1 and b != 1:
            dbias = jnp.sum(dbias.astype(jnp.float32), axis=1, keepdims=True).astype(bias.dtype)
        return (_unfold(dq, n, b), _unfold(dk, n, b), _unfold(dv, n, b), dbias, dsink), (0, 0, 0, 0, 0)
    return (_unfold(dq, n, b), _unfold(dk, n, b), _unfold(dv, n, b), dbias, dsink), (0, 0, 0, None, 0)


# ================================================================================================
# custom_partitioning: batch stays split over dp/fsdp, heads over tp; sequence must be whole
# ================================================================================================


def _spec(info, name: str) -> Tuple:
    sharding = info.sharding
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            f"fused_attn under sharding needs a named mesh, got a {type(sharding).__name__} for `{name}`: "
            "run the computation inside `with mesh:` or `jax.sharding.use_mesh(mesh)`"
        )
    spec = tuple(sharding.spec)
    return spec + (None,) * (len(info.shape) - len(spec))


def _axes_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return size


def _axes_tuple(axes) -> Tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclass(frozen=True)
class _Layout:
    """How one call is split: mesh axes of the batch, of query heads and of key/value heads."""

    mesh: object
    batch: object
    heads: object
    kv_heads: object

    def named(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def bias(self, bias_shape, batch, static) -> NamedSharding:
        if not static.has_bias:
            return self.named(None)
        return self.named(
            self.batch if bias_shape[0] == batch and batch > 1 else None,
            self.heads if bias_shape[1] > 1 else None,
            None,
            None,
        )


def _layout(static, mesh, arg_infos, seq_operands) -> _Layout:
    """Batch and head sharding of ``q``; rejects a sharded sequence axis (context parallelism)."""
    for name, axis in seq_operands:
        info = arg_infos[name]
        spec = _spec(info, name)
        if spec[axis] is not None:
            raise NotImplementedError(
                f"fused_attn: the sequence axis of `{name}` is sharded over mesh axes {_axes_tuple(spec[axis])}, "
                "i.e. context parallelism, which fused_attn runs only when it is told the axis: pass "
                "context_parallel_axis= (or MeshResource(cp_resource=...)); otherwise shard the batch over dp/fsdp and "
                "the heads over tp (MeshResource), and keep the sequence axis replicated."
            )
    q_spec = _spec(arg_infos["q"], "q")
    batch, heads = q_spec[0], q_spec[2]
    h_kv = arg_infos["k"].shape[2]
    kv_heads = heads
    n_heads = _axes_size(mesh, heads)
    if n_heads > 1 and h_kv % n_heads:
        if h_kv != 1:
            raise NotImplementedError(
                f"fused_attn: query heads are split {n_heads} ways over mesh axes {_axes_tuple(heads)} but there are "
                f"{h_kv} key/value heads, not a multiple of {n_heads}; use a tp size dividing the number of "
                "key/value heads (num_gqa_groups)"
            )
        kv_heads = None  # MQA: the single key/value head is replicated
    return _Layout(mesh, batch, heads, kv_heads)


_FWD_NAMES = ("q", "k", "v", "bias", "q_seqlens", "kv_seqlens", "q_offsets", "kv_offsets", "seeds", "softmax_offset")
_BWD_NAMES = (
    "q", "k", "v", "bias", "out", "dout", "softmax_aux", "q_seqlens", "kv_seqlens", "q_offsets", "kv_offsets", "seeds",
    "softmax_offset",
)
_BWD_RESULTS = ("q", "k", "v", "bias", "dsink")
_FWD_SEQ_AXES = (("q", 1), ("k", 1), ("v", 1))
_BWD_SEQ_AXES = (("q", 1), ("k", 1), ("v", 1), ("out", 1), ("dout", 1), ("softmax_aux", 3))


def _operand_shardings(static, layout: _Layout, arg_infos) -> dict:
    b = arg_infos["q"].shape[0]
    L = layout
    shardings = {
        "q": L.named(L.batch, None, L.heads, None),
        "k": L.named(L.batch, None, L.kv_heads, None),
        "v": L.named(L.batch, None, L.kv_heads, None),
        "bias": L.bias(arg_infos["bias"].shape, b, static),
        "out": L.named(L.batch, None, L.heads, None),
        "dout": L.named(L.batch, None, L.heads, None),
        "softmax_aux": L.named(L.batch, None, L.heads, None),
        "seeds": L.named(L.batch, L.heads, None),
        "softmax_offset": L.named(L.heads),
        "dsink": L.named(L.batch, None, L.heads),
    }
    for name in ("q_seqlens", "kv_seqlens", "q_offsets", "kv_offsets"):
        shardings[name] = L.named(L.batch, None)
    return shardings


def _fwd_result_shardings(static, mesh, arg_shapes, result_shape):
    infos = dict(zip(_FWD_NAMES, arg_shapes))
    layout = _layout(static, mesh, infos, _FWD_SEQ_AXES)
    return _fwd_results(static, _operand_shardings(static, layout, infos))


def _fwd_results(static, shardings) -> Tuple:
    """The forward's result shardings: out, softmax aux and, with return_max_logit, the row maxima (as
    the aux: each shard's rows; the per-head max over them is the caller's, which XLA all-reduces)."""
    return (shardings["out"], shardings["softmax_aux"]) + ((shardings["softmax_aux"],) if static.return_max_logit
                                                            else ())


def _fwd_partition(static, mesh, arg_shapes, result_shape):
    infos = dict(zip(_FWD_NAMES, arg_shapes))
    layout = _layout(static, mesh, infos, _FWD_SEQ_AXES)
    shardings = _operand_shardings(static, layout, infos)
    arg_shardings = tuple(shardings[name] for name in _FWD_NAMES)
    result_shardings = _fwd_results(static, shardings)

    def lower_fn(*operands):
        return tuple(_fwd_inner_p.bind(*operands, static=static))

    return mesh, lower_fn, result_shardings, arg_shardings


def _bwd_result_shardings(static, mesh, arg_shapes, result_shape):
    infos = dict(zip(_BWD_NAMES, arg_shapes))
    layout = _layout(static, mesh, infos, _BWD_SEQ_AXES)
    shardings = _operand_shardings(static, layout, infos)
    return tuple(shardings[name] for name in _BWD_RESULTS)


def _psum_f32(x, axes):
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def _bwd_partition(static, mesh, arg_shapes, result_shape):
    infos = dict(zip(_BWD_NAMES, arg_shapes))
    layout = _layout(static, mesh, infos, _BWD_SEQ_AXES)
    shardings = _operand_shardings(static, layout, infos)
    arg_shardings = tuple(shardings[name] for name in _BWD_NAMES)
    result_shardings = tuple(shardings[name] for name in _BWD_RESULTS)
    # dbias of a bias broadcast over batch (or heads) sums over a split axis: all-reduce it.
    reduce_axes = ()
    if static.has_bias:
        bias_shape, b, h = infos["bias"].shape, infos["q"].shape[0], infos["q"].shape[2]
        if bias_shape[0] == 1 and b > 1:
            reduce_axes += _axes_tuple(layout.batch)
        if bias_shape[1] == 1 and h > 1:
            reduce_axes += _axes_tuple(layout.heads)

    # MQA with split query heads: each device holds part of the heads reading the one replicated
    # key/value head, so dK/dV are partial sums to all-reduce as well.
    kv_reduce_axes = _axes_tuple(layout.heads) if layout.kv_heads is None and static.backward_grads.has_dkdv else ()

    def lower_fn(*operands):
        # dsink holds each sequence's part (batch and heads as q): nothing to reduce here; the sum
        # over sequences is the custom_vjp's, in a fixed order.
        dq, dk, dv, dbias, dsink = _bwd_inner_p.bind(*operands, static=static)
        if reduce_axes:
            dbias = _psum_f32(dbias, reduce_axes)
        if kv_reduce_axes:
            dk, dv = _psum_f32(dk, kv_reduce_axes), _psum_f32(dv, kv_reduce_axes)
        return dq, dk, dv, dbias, dsink

    return mesh, lower_fn, result_shardings, arg_shardings


def _dims(value_type):
    from jax._src.lib.mlir import ir  # the rule callback receives MLIR types

    return tuple(ir.RankedTensorType(value_type).shape)


def _head_factor(h_q: int, h_kv: int) -> Tuple[str, dict]:
    """Query heads as factors: ``kh`` when h_q == h_kv, else the compound ``(kh g)`` (GQA groups
    are contiguous: query head i reads key/value head i // g). MQA's single key/value head is a
    factor of its own (a size-1 factor cannot be part of a compound one)."""
    if h_q == h_kv:
        return "kh", {}
    if h_kv == 1:
        return "qh", {}
    return "(kh g)", {"g": h_q // h_kv}


def _common_factors(static, value_types):
    q, k, v, bias = (_dims(t) for t in value_types[:4])
    hq, sizes = _head_factor(q[2], k[2])
    if static.has_bias:
        bias_rule = ("b" if bias[0] == q[0] and q[0] > 1 else "bias_b") + " " + (hq if bias[1] > 1 else "bias_h") + " s t"
    else:
        bias_rule = "nobias"
    return hq, sizes, bias_rule


def _fwd_sharding_rule(static, mesh, value_types, result_types):
    hq, sizes, bias_rule = _common_factors(static, value_types)
    operands = [f"b s {hq} d", "b t kh d", "b t kh e", bias_rule, "b m", "b m", "b m1", "b m1", f"b {hq} two", hq]
    results = [f"b s {hq} e", f"b m {hq} s"] + ([f"b m {hq} s"] if static.return_max_logit else [])
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    return rule, dict(sizes, need_replication_factors=("d", "e"))


def _bwd_sharding_rule(static, mesh, value_types, result_types):
    hq, sizes, bias_rule = _common_factors(static, value_types)
    operands = [
        f"b s {hq} d", "b t kh d", "b t kh e", bias_rule, f"b s {hq} e", f"b s {hq} e", f"b m {hq} s",
        "b m", "b m", "b m1", "b m1", f"b {hq} two", hq,
    ]
    dbias_rule = bias_rule if static.has_bias else "nodbias"
    results = [f"b s {hq} d", "b t kh d", "b t kh e", dbias_rule, f"b m {hq}"]
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    return rule, dict(sizes, need_replication_factors=("d", "e"))


def _fwd_partitioned(static, q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset):
    return tuple(_fwd_inner_p.bind(q, k, v, bias, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset,
                                   static=static))


def _bwd_partitioned(static, q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds,
                     softmax_offset):
    return tuple(
        _bwd_inner_p.bind(
            q, k, v, bias, out, dout, softmax_aux, q_seqlens, kv_seqlens, q_offsets, kv_offsets, seeds, softmax_offset,
            static=static
        )
    )


_fwd_cp = custom_partitioning(_fwd_partitioned, static_argnums=(0,))
_fwd_cp.def_partition(
    partition=_fwd_partition,
    infer_sharding_from_operands=_fwd_result_shardings,
    sharding_rule=_fwd_sharding_rule,
)
_bwd_cp = custom_partitioning(_bwd_partitioned, static_argnums=(0,))
_bwd_cp.def_partition(
    partition=_bwd_partition,
    infer_sharding_from_operands=_bwd_result_shardings,
    sharding_rule=_bwd_sharding_rule,
)


def _fwd_outer_lowering(ctx, *args, static):
    return mlir.lower_fun(functools.partial(_fwd_cp, static), multiple_results=True)(ctx, *args)


def _bwd_outer_lowering(ctx, *args, static):
    return mlir.lower_fun(functools.partial(_bwd_cp, static), multiple_results=True)(ctx, *args)


# ================================================================================================
# Registration
# ================================================================================================


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, static):
    return jax.jit(functools.partial(prim.bind, static=static))


def _eager(prim):
    def impl(*args, static):
        return _jitted_bind(prim, static)(*args)

    return impl


def _make_primitive(name, abstract, eager):
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract)
    if eager:
        prim.def_impl(_eager(prim))
    return prim


def _rocm_lowering(ctx, *args, **kwargs):
    """ROCm has no fused lowering (selection never picks it there): raise why."""
    from transformer_engine.jax.primitives import gpu

    return gpu.rocm_lowering(ctx, *args, **kwargs)


_fwd_inner_p = _make_primitive("te_fused_attn_fwd", _fwd_abstract, eager=True)
_bwd_inner_p = _make_primitive("te_fused_attn_bwd", _bwd_abstract, eager=True)
_fwd_outer_p = _make_primitive("te_fused_attn_fwd_wrapper", _fwd_abstract, eager=True)
_bwd_outer_p = _make_primitive("te_fused_attn_bwd_wrapper", _bwd_abstract, eager=True)

mlir.register_lowering(_fwd_inner_p, _fwd_cpu_lowering, platform="cpu")
mlir.register_lowering(_bwd_inner_p, _bwd_cpu_lowering, platform="cpu")
mlir.register_lowering(_fwd_inner_p, _fwd_cuda_lowering, platform="cuda")
mlir.register_lowering(_bwd_inner_p, _bwd_cuda_lowering, platform="cuda")
mlir.register_lowering(_fwd_inner_p, _rocm_lowering, platform="rocm")
mlir.register_lowering(_bwd_inner_p, _rocm_lowering, platform="rocm")
# The outer lowering emits custom_partitioning's custom call, which needs the device assignment
# while lowering (JAX has no public switch for this; custom_partitioning_p itself is registered so).
dispatch.prim_requires_devices_during_lowering.update({_fwd_outer_p, _bwd_outer_p})
mlir.register_lowering(_fwd_outer_p, _fwd_outer_lowering)
mlir.register_lowering(_bwd_outer_p, _bwd_outer_lowering)
batching.primitive_batchers[_fwd_outer_p] = _fwd_batch
batching.primitive_batchers[_bwd_outer_p] = _bwd_batch


# ================================================================================================
# custom_vjp
# ================================================================================================


def fused_attn_fwd(q, k, v, bias, seq: SeqInfo, seeds, static: FusedAttnStatic, softmax_offset=None):
    """Forward primitive: (output ``[b, s_q, h_q, d_v]``, softmax aux (log-sum-exp, fp32)), and with
    ``static.return_max_logit`` each row's max logit, fp32 laid out as the aux (-inf where a row sees no
    key; :func:`max_logit` reduces it per head). ``softmax_offset``: fp32 ``[h_q]`` sink logits (read
    with sink softmax only)."""
    if softmax_offset is None:
        softmax_offset = jnp.zeros((q.shape[2],), jnp.float32)
    q, k, v, bias, seq, seeds, softmax_offset = _vary_like(q, k, v, bias, seq, seeds, softmax_offset)
    return tuple(_fwd_outer_p.bind(q, k, v, bias, *seq, seeds, softmax_offset, static=static))


def max_logit(row_max, dtype):
    """Each head's max logit ``[h_q]`` in ``dtype`` from :func:`fused_attn_fwd`'s row maxima ``[b, m, h_q, s]``
    (fp32): a max, order-free, so the same bits however the rows are split or reduced."""
    return jnp.max(row_max, axis=(0, 1, 3), initial=-jnp.inf).astype(dtype)


def fused_attn_bwd(q, k, v, bias, out, dout, softmax_aux, seq: SeqInfo, seeds, static: FusedAttnStatic,
                   softmax_offset=None):
    """Backward primitive: (dq, dk, dv, dbias, dsink); dbias is a placeholder without bias, dsink
    ``[b, m, h_q]`` each sequence's part of d softmax_offset (zeros unless the sink is learnable)."""
    if softmax_offset is None:
        softmax_offset = jnp.zeros((q.shape[2],), jnp.float32)
    q, k, v, bias, out, dout, softmax_aux, seq, seeds, softmax_offset = _vary_like(
        q, k, v, bias, out, dout, softmax_aux, seq, seeds, softmax_offset)
    return tuple(_bwd_outer_p.bind(q, k, v, bias, out, dout, softmax_aux, *seq, seeds, softmax_offset,
                                   static=static))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_attn(static, q, k, v, bias, softmax_offset, seq, seeds):
    return _fused_attn_fwd_rule(static, q, k, v, bias, softmax_offset, seq, seeds)[0]


def _fused_attn_fwd_rule(static, q, k, v, bias, softmax_offset, seq, seeds):
    out, aux, *row_max = fused_attn_fwd(q, k, v, bias, seq, seeds, static, softmax_offset)
    out = checkpoint_name(out, static.checkpoint_name)
    aux = checkpoint_name(aux, static.checkpoint_name)
    primal = (out, max_logit(row_max[0], q.dtype)) if static.return_max_logit else out
    return primal, (q, k, v, bias, softmax_offset, seq, seeds, out, aux)


def _fused_attn_bwd_rule(static, residuals, dout):
    if static.return_max_logit:
        dout = dout[0]  # the max logit has no gradient
    q, k, v, bias, softmax_offset, seq, seeds, out, aux = residuals
    dq, dk, dv, dbias, dsink = fused_attn_bwd(q, k, v, bias, out, dout, aux, seq, seeds, static, softmax_offset)
    d_offset = None
    if static.softmax_type.is_learnable:
        # The sequences' parts, in batch order (row, then segment), summed as a fixed pairwise tree:
        # the same adds as the PyTorch frontend's kernel_runner.fixed_order_sum, on any sharding.
        d_offset = attention_math.fixed_order_sum(dsink.reshape(-1, dsink.shape[-1]), axis=0)
    return dq, dk, dv, (dbias if static.has_bias else None), d_offset, None, None


_fused_attn.defvjp(_fused_attn_fwd_rule, _fused_attn_bwd_rule)


# ================================================================================================
# Public function
# ================================================================================================


def fused_attn_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: Optional[jax.Array],
    seq: SeqInfo,
    seeds: jax.Array,
    static: FusedAttnStatic,
    softmax_offset: Optional[jax.Array] = None,
) -> jax.Array:
    """Fused attention on canonical operands (see :mod:`transformer_engine.jax.attention_math`),
    differentiable in ``q``, ``k``, ``v``, ``bias`` and (learnable sink softmax) ``softmax_offset``.
    With ``static.return_max_logit`` returns ``(out, max_logit)``: :func:`max_logit` ``[h_q]`` in q's dtype,
    no gradient.
    ``bias`` is ``None`` without bias; ``softmax_offset`` (``[h_q]`` or ``[1, h_q, 1, 1]``) is the
    learnable sink logits, ``None`` for the other softmax types."""
    if bias is None:
        if static.has_bias:
            raise ValueError(f"`bias` must be given with attn_bias_type={static.attn_bias_type.value!r}, got None")
        bias = jnp.zeros((0,), q.dtype)
    offset = attention_math.sink_logits(static.softmax_type, softmax_offset, q.shape[2])
    if offset is None:
        offset = jnp.zeros((q.shape[2],), jnp.float32)
    seq = SeqInfo(*(x.astype(jnp.int32) for x in seq))
    # The kernels take a positive scale: a zero or negative one runs on 0 * q or -q (and a pre-scale
    # bias times the same factor); JAX's autodiff maps dq and dbias back.
    q_factor, scale = kernel_scale(static.scaling_factor)
    if q_factor != 1.0:
        q = q * jnp.asarray(q_factor, q.dtype)
        if static.attn_bias_type == AttnBiasType.PRE_SCALE_BIAS:
            bias = bias * jnp.asarray(q_factor, bias.dtype)
        static = dataclasses.replace(static, scaling_factor=scale)
    # Under shard_map: one manual-axes type for all operands, so that each cotangent the custom_vjp
    # returns has its primal's type (the pcast's transpose sums a replicated operand's cotangent).
    q, k, v, bias, offset, seq, seeds = _vary_like(q, k, v, bias, offset, seq, seeds)
    return _fused_attn(static, q, k, v, bias, offset, seq, seeds)
