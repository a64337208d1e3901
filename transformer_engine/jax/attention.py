"""Fused attention for JAX with TransformerEngine's API: ``fused_attn`` and ``SequenceDescriptor``.

.. code-block:: python

    from transformer_engine.jax.attention import (
        fused_attn, SequenceDescriptor, QKVLayout, AttnMaskType, AttnBiasType)

    out = fused_attn((q, k, v), None, SequenceDescriptor.from_seqlens((q_lens, kv_lens)), None,
                     attn_bias_type=AttnBiasType.NO_BIAS,
                     attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK,
                     qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
                     scaling_factor=q.shape[-1] ** -0.5, dropout_probability=0.0, is_training=True)

Each call builds one :class:`~transformer_engine.common.attention.AttnConfig` and picks a backend
(``FlashAttention``: flash-attn-4 on Hopper/Blackwell GPUs when installed,
:mod:`transformer_engine.jax.flash_backend`; ``FusedAttention``: the project's Triton kernels on CUDA
GPUs; ``UnfusedDotProductAttention``: jnp math) with the project's selection, logging why under
``NVTE_DEBUG=1``. Determinism is read
at trace time of each call: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or XLA's
``--xla_gpu_deterministic_ops=true`` (in ``XLA_FLAGS``) make the backward pass bitwise
reproducible. Both backends work under ``jit``, ``grad``, ``vmap`` and ``remat``; the fused one
also keeps batch split over dp/fsdp and heads over tp under ``custom_partitioning``
(:mod:`transformer_engine.jax.sharding`).
"""

from __future__ import annotations

import os
import warnings
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from transformer_engine.common import settings
from transformer_engine.common.log import get_logger
from transformer_engine.common.attention.backends import (
    FlashAttention,
    FusedAttention,
    Selection,
    UnfusedDotProductAttention,
    select_backend,
)
from transformer_engine.common.attention import enums as _common
from transformer_engine.common.attention.config import (
    AttnConfig, gfx_target, normalize_window, resolve_bottom_right_diagonal,
)
from transformer_engine.common.attention.validation import check_segments, check_softmax_scale
from transformer_engine.jax import attention_math, context_parallel, flash_backend
from transformer_engine.jax.attention_math import SeqInfo
from transformer_engine.jax.context_parallel import ContextParallel
from transformer_engine.jax.enums import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    CPStrategy,
    QKVFormat,
    QKVLayout,
    ReorderStrategy,
    canonicalize_attn_mask_type,
    to_common,
)
from transformer_engine.jax.load_balancing import (
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.primitives.attention import FusedAttnStatic, fused_attn_core

__all__ = [
    "AttnBiasType",
    "AttnMaskType",
    "AttnSoftmaxType",
    "CPStrategy",
    "QKVFormat",
    "QKVLayout",
    "ReorderStrategy",
    "SequenceDescriptor",
    "canonicalize_attn_mask_type",
    "fused_attn",
    "inverse_reorder_causal_load_balancing",
    "is_fused_attn_kernel_available",
    "is_deterministic_mode",
    "fused_attn_unavailable_reasons",
    "mask_to_sequence_descriptor",
    "reorder_causal_load_balancing",
]


# ================================================================================================
# Determinism and device facts (read at trace time of each call)
# ================================================================================================

_XLA_DETERMINISTIC_FLAGS = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def _xla_flag(name: str) -> bool:
    """Value of boolean flag ``--name`` in XLA_FLAGS now (last occurrence wins)."""
    value = False
    for token in os.environ.get("XLA_FLAGS", "").split():
        key, sep, raw = token.lstrip("-").partition("=")
        if key == name:
            value = (raw.strip().lower() in ("true", "1", "t", "yes")) if sep else True
    return value


def is_deterministic_mode() -> bool:
    """True when the backward pass must be bitwise reproducible: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``
    or ``--xla_gpu_deterministic_ops=true`` (or ``--xla_gpu_exclude_nondeterministic_ops=true``) in
    ``XLA_FLAGS``. Read now, not cached."""
    if not settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        return True
    return any(_xla_flag(name) for name in _XLA_DETERMINISTIC_FLAGS)


def _device_facts() -> Tuple[str, Union[None, str, Tuple[int, int]]]:
    """(device type for AttnConfig, architecture) of the default backend: the compute capability
    (major, minor) of a CUDA GPU, the gfx target ("gfx942") of a ROCm one (JAX reports either as the
    device's ``compute_capability``), None on CPU."""
    device = jax.devices()[0]
    if device.platform in ("gpu", "cuda", "rocm"):
        capability = str(getattr(device, "compute_capability", ""))
        if capability.lower().startswith("gfx"):
            return "cuda", gfx_target(capability)
        try:
            major, minor = (int(x) for x in capability.split("."))
            return "cuda", (major, minor)
        except ValueError:
            pass
    return "cpu", None


def _arch_fields(arch: Union[None, str, Tuple[int, int]]) -> Dict[str, object]:
    """AttnConfig's vendor, compute_capability and gfx_arch for an architecture of ``_device_facts``."""
    if isinstance(arch, str):
        return dict(vendor="amd", compute_capability=None, gfx_arch=arch)
    return dict(vendor="nvidia", compute_capability=arch, gfx_arch=None)



def _frontend_extra(device_type: str, attn_bias_type: _common.AttnBiasType, dropout: float,
                    is_training: bool,
                    offset_sequences: bool = False, vendor: str = "nvidia",
                    compute_capability: Optional[Tuple[int, int]] = None, context_parallel_axis: bool = False,
                    top_left_lengths_may_differ: bool = False) -> Tuple[Tuple[str, str], ...]:
    """Reasons only the JAX frontend knows (the backends read them from ``config.extra``): FusedAttention's
    device, launcher build and what it wires to the kernels; FlashAttention's (``flash_backend``).
    ``offset_sequences``: the call's padded sequences may start after token 0 of their row."""
    flash = flash_backend.availability_reasons(device_type, vendor, compute_capability, context_parallel_axis,
                                               top_left_lengths_may_differ)
    return tuple((FlashAttention.NAME, r) for r in flash) + _fused_extra(
        device_type, attn_bias_type, dropout, is_training, offset_sequences, vendor)


def _interpreting() -> bool:
    """NVTE_JAX_TRITON_INTERPRET (primitives.interpret), read without importing the kernels' modules."""
    return bool(settings.get("NVTE_JAX_TRITON_INTERPRET"))


def _fused_extra(device_type: str, attn_bias_type: _common.AttnBiasType, dropout: float, is_training: bool,
                 offset_sequences: bool, vendor: str) -> Tuple[Tuple[str, str], ...]:
    if device_type == "cpu" and _interpreting():
        from transformer_engine.jax.primitives import interpret

        reason = interpret.unavailable_reason()
        return ((FusedAttention.NAME, reason),) if reason else ()
    if device_type != "cuda":
        return ((FusedAttention.NAME, f"device={device_type}: JAX launches the Triton kernels on CUDA GPUs only "
                 "(on CPU the fused primitives lower to jnp, for tests; NVTE_JAX_TRITON_INTERPRET=1 runs the "
                 "kernels under Triton's interpreter)"),)
    if vendor != "nvidia":
        return ((FusedAttention.NAME, f"vendor={vendor} (ROCm): JAX launches the Triton kernels through its XLA FFI "
                 "extension (csrc/triton_launch.cpp), which loads CUDA cubins on CUDA streams only; the kernels "
                 "compile for AMD GPUs and run there from PyTorch"),)
    from transformer_engine.jax.primitives import gpu

    reasons = []
    unavailable = gpu.unavailable_reason()
    if unavailable:
        reasons.append(unavailable)
    # The kernels index the bias from each sequence's first token; the bias is laid out by
    # position in the row. Equal only when sequences start at token 0 (SequenceDescriptor.from_seqlens).
    if attn_bias_type != _common.AttnBiasType.NO_BIAS and offset_sequences:
        reasons.append(f"attn_bias_type={attn_bias_type.value} with a sequence_descriptor of seq_offsets or "
                       "segment_ids (sequences that may start after token 0 of their row; the kernels index the "
                       "bias from each sequence's start): use SequenceDescriptor.from_seqlens")
    if dropout > 0 and is_training:
        reasons.append(f"dropout={dropout} (the JAX launch passes no dropout to the kernels yet)")
    return tuple((FusedAttention.NAME, r) for r in reasons)


def _bias_shape_name(bias_shape: Optional[Sequence[int]]) -> Optional[str]:
    if bias_shape is None:
        return None
    return ("b" if bias_shape[0] > 1 else "1") + ("h" if bias_shape[1] > 1 else "1") + "ss"


def _make_config(*, dtype, params: FusedAttnStatic, bias_shape: Optional[Sequence[int]],
                 offset_sequences: bool = False, context_parallel_axis: bool = False,
                 top_left_lengths_may_differ: bool = False, **geometry) -> AttnConfig:
    """The AttnConfig of a call: its parameters (``params``, the primitives' static arguments: selection reads
    the value the launch reads) and ``geometry`` as AttnConfig names it, plus what JAX knows now (device, the
    frontend's own reasons; see ``_frontend_extra``)."""
    device_type, arch = _device_facts()
    facts = _arch_fields(arch)
    extra = _frontend_extra(device_type, params.attn_bias_type, params.dropout_probability, params.is_training,
                            offset_sequences, vendor=facts["vendor"], compute_capability=facts["compute_capability"],
                            context_parallel_axis=context_parallel_axis,
                            top_left_lengths_may_differ=top_left_lengths_may_differ)
    return AttnConfig(
        dtype=jnp.dtype(dtype).name,
        params=params,
        bias_shape=_bias_shape_name(bias_shape),
        framework="jax",
        device_type=device_type,
        **facts,
        triton_interpret=device_type == "cpu" and _interpreting(),
        extra=extra,
        **geometry,
    )


# ================================================================================================
# Argument parsing
# ================================================================================================


_PACKING_ARITY = {"qkv": 1, "kv": 2, "separate": 3}


def _split_qkv(qkv, layout: _common.QKVLayout):
    """The user's tensors as (q, k, v) in the layout's own format (BSHD, SBHD or THD-in-BSHD)."""
    if not isinstance(qkv, (tuple, list)):
        raise ValueError(
            f"`qkv` must be a tuple of {_PACKING_ARITY[layout.packing]} array(s) for qkv_layout={layout.value!r}, "
            f"got {type(qkv).__name__}"
        )
    arity = _PACKING_ARITY[layout.packing]
    if len(qkv) != arity:
        raise ValueError(
            f"`qkv` must hold {arity} array(s) for qkv_layout={layout.value!r} "
            f"({'(qkv,)' if arity == 1 else '(q, kv)' if arity == 2 else '(q, k, v)'}), got {len(qkv)}"
        )
    arrays = [jnp.asarray(x) for x in qkv]
    if layout.packing == "qkv":
        (packed,) = arrays
        if packed.ndim != 5 or packed.shape[2] != 3:
            raise ValueError(f"`qkv[0]` must be [b, s, 3, h, d] for qkv_layout={layout.value!r}, got {packed.shape}")
        return packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    if layout.packing == "kv":
        q, kv = arrays
        if kv.ndim != 5 or kv.shape[2] != 2:
            raise ValueError(f"`qkv[1]` must be [b, s, 2, h, d] for qkv_layout={layout.value!r}, got {kv.shape}")
        return q, kv[:, :, 0], kv[:, :, 1]
    return tuple(arrays)


def _to_bshd(x, fmt: _common.QKVFormat):
    return jnp.swapaxes(x, 0, 1) if fmt == _common.QKVFormat.SBHD else x


def _check_tensors(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"`{name}` must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {x.shape}")
        if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
            raise ValueError(f"`{name}` must be float16, bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"`qkv` arrays must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"`qkv` arrays must share the batch size, got q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"`k` and `v` must share seqlen and heads, got k {k.shape}, v {v.shape}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"`q` and `k` must share head_dim, got q {q.shape}, k {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"`q` heads must be a multiple of `k` heads (GQA groups), got {q.shape[2]} and {k.shape[2]}"
        )


# ================================================================================================
# SequenceDescriptor
# ================================================================================================


def _pair(x, arg: str):
    """``x`` as a ``(q, kv)`` pair of arrays. A tuple is a pair (TransformerEngine's rule); a list of
    two arrays is read as a pair too, any other list (of numbers) as one array."""
    if x is None:
        return None
    is_pair = isinstance(x, tuple) or (isinstance(x, list) and any(np.ndim(a) > 0 for a in x))
    if is_pair:
        if len(x) != 2:
            raise ValueError(f"`{arg}` must be an array or a (q, kv) pair of arrays, got {len(x)} items")
        return tuple(None if a is None else jnp.asarray(a) for a in x)
    x = jnp.asarray(x)
    return (x, x)


# The smallest value each descriptor field may hold: -1 marks an unused (empty) sequence slot in
# lengths and offsets (TransformerEngine's fill); ids and positions count from 0.
_FIELD_MIN = {"seqlens": -1, "seq_offsets": -1, "segment_ids": 0, "segment_pos": 0}


def _check_field(pair, arg: str):
    """Eager check of a descriptor field: integer dtype, and (when concrete) no value below its
    minimum, so that a negative length or id fails here, naming the argument, instead of reading
    as an empty or shifted sequence later. Traced values (under ``jit``) are checked for dtype only."""
    if pair is None:
        return None
    for side, x in enumerate(pair):
        if x is None:
            continue
        name = arg if pair[0] is pair[1] else f"{arg}[{side}] ({'q' if side == 0 else 'kv'})"
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"`{name}` must be an integer array, got {x.dtype}")
        if not _concrete(x) or x.size == 0:
            continue
        low = _FIELD_MIN[arg]
        values = np.asarray(x)
        if values.min() < low:
            what = "non-negative" if low == 0 else "-1 (an unused slot) or non-negative"
            raise ValueError(f"`{name}` must be {what}, got {values.tolist()}")
    return pair


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class SequenceDescriptor:
    """Which tokens of each row are real, and how they split into sequences, for queries and
    keys/values. Build it with one of the ``from_*`` constructors; each takes an array (self
    attention: the same for queries and keys/values) or a ``(q, kv)`` pair.

    - :meth:`from_seqlens`: ``[b]`` lengths (BSHD/SBHD padding: tokens ``0 <= t < len`` are real),
      or ``[b, m]`` for THD rows packed from position 0 without gaps.
    - :meth:`from_seqlens_and_offsets`: THD rows with ``m`` segments each: lengths ``[b, m]`` and
      start offsets ``[b, m]`` or ``[b, m + 1]`` (a trailing end offset is ignored). Unused
      segments have length 0.
    - :meth:`from_segment_ids_and_pos`: ``[b, s]`` segment ids (0 = padding; a run of equal
      nonzero ids is one sequence). Positions, when given, must count from 0 within each
      segment (the kernels derive them from the segment starts).
    """

    seqlens: Optional[Tuple[Any, Any]] = None
    seq_offsets: Optional[Tuple[Any, Any]] = None
    segment_ids: Optional[Tuple[Any, Any]] = None
    segment_pos: Optional[Tuple[Any, Any]] = None

    def tree_flatten(self):
        return (self.seqlens, self.seq_offsets, self.segment_ids, self.segment_pos), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @classmethod
    def from_seqlens(cls, seqlens) -> "SequenceDescriptor":
        return cls(seqlens=_check_field(_pair(seqlens, "seqlens"), "seqlens"))

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, seq_offsets) -> "SequenceDescriptor":
        return cls(seqlens=_check_field(_pair(seqlens, "seqlens"), "seqlens"),
                   seq_offsets=_check_field(_pair(seq_offsets, "seq_offsets"), "seq_offsets"))

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos=None, *, is_thd: Optional[bool] = None,
                                 is_segment_ids_reordered: Optional[bool] = None) -> "SequenceDescriptor":
        """``is_thd`` and ``is_segment_ids_reordered`` are TransformerEngine's keywords (its newer
        releases require them): they only say how positions would be generated when ``segment_pos``
        is None, and load-balanced (reordered) THD ids need explicit positions."""
        for name, flag in (("is_thd", is_thd), ("is_segment_ids_reordered", is_segment_ids_reordered)):
            if flag is not None and not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"`{name}` must be a bool or None, got {flag!r}")
        if segment_pos is None and is_thd and is_segment_ids_reordered:
            raise ValueError("`segment_pos` must be given for load-balanced (reordered) THD segment ids, got None "
                             "(reorder the positions with reorder_causal_load_balancing as the ids were)")
        return cls(segment_ids=_check_field(_pair(segment_ids, "segment_ids"), "segment_ids"),
                   segment_pos=_check_field(_pair(segment_pos, "segment_pos"), "segment_pos"))

    def to_seq_info(self, batch: int, s_q: int, s_kv: int, is_thd: bool, max_segments_per_seq: int) -> SeqInfo:
        """Canonical per-row segments (see :mod:`transformer_engine.jax.attention_math`)."""
        sides = []
        for side, seqlen in ((0, s_q), (1, s_kv)):
            who = "q" if side == 0 else "kv"
            if self.segment_ids is not None:
                ids = self.segment_ids[side]
                _expect_shape(ids, (batch, seqlen), f"segment_ids[{side}] ({who})")
                if self.segment_pos is not None and self.segment_pos[side] is not None:
                    _expect_shape(self.segment_pos[side], (batch, seqlen), f"segment_pos[{side}] ({who})")
                sides.append(_segments_from_ids(ids, max_segments_per_seq if is_thd else 1))
            elif self.seqlens is not None:
                lens = self.seqlens[side]
                offsets = self.seq_offsets[side] if self.seq_offsets is not None else None
                sides.append(_segments_from_seqlens(lens, offsets, batch, seqlen, is_thd, max_segments_per_seq, who))
            else:
                raise ValueError("`sequence_descriptor` must hold seqlens or segment_ids, got an empty descriptor")
        (q_lens, q_offsets), (kv_lens, kv_offsets) = sides
        if q_lens.shape != kv_lens.shape:
            raise ValueError(
                f"`sequence_descriptor` must describe as many segments for q as for kv, got {q_lens.shape} and "
                f"{kv_lens.shape}"
            )
        return SeqInfo(q_lens, kv_lens, q_offsets, kv_offsets)


def _expect_shape(x, shape, arg):
    if tuple(x.shape) != tuple(shape) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"`{arg}` must be an integer array of shape {list(shape)}, got {x.dtype}{list(x.shape)}")


def _segments_from_seqlens(lens, offsets, batch, seqlen, is_thd, max_segments, who):
    lens = jnp.asarray(lens)
    if not jnp.issubdtype(lens.dtype, jnp.integer):
        raise ValueError(f"`seqlens` ({who}) must be integers, got {lens.dtype}")
    if lens.ndim == 1:
        lens = lens[:, None]
    if lens.ndim != 2 or lens.shape[0] != batch:
        raise ValueError(f"`seqlens` ({who}) must be [{batch}] or [{batch}, segments], got shape {lens.shape}")
    m = lens.shape[1]
    if not is_thd and m != 1:
        raise ValueError(f"`seqlens` ({who}) must be [{batch}] (one sequence per row) for BSHD/SBHD, got {lens.shape}")
    lens = lens.astype(jnp.int32)
    valid = lens > 0  # unused slots hold 0 or -1 (TransformerEngine's fill)
    lens = jnp.where(valid, lens, 0)
    if offsets is None:
        starts = jnp.cumsum(lens, axis=1) - lens  # packed from position 0
    else:
        offsets = jnp.asarray(offsets)
        if not jnp.issubdtype(offsets.dtype, jnp.integer) or offsets.shape not in ((batch, m), (batch, m + 1)):
            raise ValueError(
                f"`seq_offsets` ({who}) must be integer [{batch}, {m}] or [{batch}, {m + 1}], got "
                f"{offsets.dtype}{list(offsets.shape)}"
            )
        starts = offsets[:, :m].astype(jnp.int32)
    if m > max_segments:
        # TransformerEngine's THD form: [b, s] slots, the used ones first; keep the first
        # max_segments used slots of each row, in order (as segment ids beyond the limit are dropped).
        order = jnp.argsort(jnp.logical_not(valid).astype(jnp.int32), axis=1, stable=True)[:, :max_segments]
        lens, starts, valid = (jnp.take_along_axis(x, order, axis=1) for x in (lens, starts, valid))
    # An unused slot starts where the segments before it end (offsets stay non-decreasing, never -1).
    ends = jnp.where(valid, starts + lens, 0)
    ends_before = jnp.concatenate(
        [jnp.zeros((batch, 1), jnp.int32), jax.lax.cummax(ends, axis=1)[:, :-1]], axis=1)
    starts = jnp.where(valid, starts, ends_before)
    end = jnp.full((batch, 1), seqlen, jnp.int32)
    return lens, jnp.concatenate([starts, end], axis=1)


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _check_seq_values(descriptor: "SequenceDescriptor", seq: SeqInfo, s_q: int, s_kv: int, max_segments: int) -> None:
    """The descriptor's values, where they are concrete (eager calls; under jit they are traced and
    cannot be checked): by ``common.attention.validation.check_segments`` for lengths and offsets,
    and no row of segment ids with more runs than ``max_segments_per_seq`` (extra runs would be dropped)."""
    for side, who, seqlen, lens, offsets in ((0, "q", s_q, seq.q_seqlens, seq.q_offsets),
                                             (1, "kv", s_kv, seq.kv_seqlens, seq.kv_offsets)):
        if descriptor.segment_ids is not None:
            ids = descriptor.segment_ids[side]
            if not _concrete(ids):
                continue
            ids = np.asarray(ids)
            starts = (ids != 0) & np.concatenate([np.ones((ids.shape[0], 1), bool), ids[:, 1:] != ids[:, :-1]], 1)
            runs = int(starts.sum(axis=1).max()) if ids.size else 0
            if runs > max_segments:
                raise ValueError(f"`max_segments_per_seq` must be at least the number of segments in a row of "
                                 f"`segment_ids` ({who}: {runs}), got {max_segments}")
            continue
        if not _concrete(lens, offsets):
            continue
        check_segments(np.asarray(lens), np.asarray(offsets), seqlen, seqlens_arg="seqlens",
                       offsets_arg="seq_offsets" if descriptor.seq_offsets is not None else "seqlens", side=who)


def _segments_from_ids(ids, max_segments):
    """Runs of equal nonzero ids -> (lengths [b, m], offsets [b, m + 1]); runs past ``m`` are dropped."""
    ids = ids.astype(jnp.int32)
    batch, seqlen = ids.shape
    valid = ids != 0
    previous = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), ids[:, :-1]], axis=1)
    first = jnp.arange(seqlen)[None, :] == 0
    starts = valid & (first | (ids != previous))
    number = jnp.cumsum(starts.astype(jnp.int32), axis=1) * valid  # 1-based run number, 0 = padding
    k = jnp.arange(1, max_segments + 1, dtype=jnp.int32)[None, :, None]
    in_segment = number[:, None, :] == k  # [b, m, s]
    lens = jnp.sum(in_segment, axis=-1, dtype=jnp.int32)
    t = jnp.arange(seqlen, dtype=jnp.int32)[None, None, :]
    first_token = jnp.min(jnp.where(in_segment, t, seqlen), axis=-1).astype(jnp.int32)
    # An empty segment starts where the segments before it end (offsets stay non-decreasing).
    ends = jnp.where(lens > 0, first_token + lens, 0)
    ends_before = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jax.lax.cummax(ends, axis=1)[:, :-1]], axis=1)
    start = jnp.where(lens > 0, first_token, ends_before)
    end = jnp.full((batch, 1), seqlen, jnp.int32)
    return lens, jnp.concatenate([start, end], axis=1)


# ================================================================================================
# Public API
# ================================================================================================


@dataclass(frozen=True, eq=False)
class _FusedAttnArgs:
    """The arguments of one ``fused_attn`` call as given: its parameters, in its order, with its
    defaults (a test keeps the two equal). ``_parse_call`` checks them; the Flax modules and the
    test helpers build one too."""

    qkv: Tuple[Any, ...]
    bias: Any
    sequence_descriptor: Any
    seed: Any
    attn_bias_type: Any
    attn_mask_type: Any
    qkv_layout: Any
    softmax_type: Any = AttnSoftmaxType.VANILLA_SOFTMAX
    scaling_factor: Optional[float] = None
    dropout_probability: float = 0.0
    is_training: bool = True
    max_segments_per_seq: int = 1
    window_size: Optional[Tuple[int, int]] = None
    context_parallel_strategy: Any = CPStrategy.DEFAULT
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_checkpoint_name: str = "context"
    softmax_offset: Any = None
    stripe_size: Optional[int] = None
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None
    score_mod_tensors: Optional[Mapping[str, Any]] = None
    score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None
    bottom_right_diagonal: Optional[bool] = None
    return_max_logit: bool = False


@dataclass(frozen=True)
class _Kinds:
    """A call's enum arguments as common members (what everything past the parsing reads)."""

    layout: _common.QKVLayout
    mask: _common.AttnMaskType
    bias_type: _common.AttnBiasType
    softmax_type: _common.AttnSoftmaxType

    @property
    def fmt(self) -> _common.QKVFormat:
        return self.layout.qkv_format

    @property
    def is_thd(self) -> bool:
        return self.fmt == _common.QKVFormat.THD


@dataclass(frozen=True)
class _Call:
    """One parsed ``fused_attn`` call: canonical operands and its config."""

    q: Any
    k: Any
    v: Any
    bias: Any
    seq: SeqInfo
    seeds: Any
    softmax_offset: Any  # fp32 [h_q] learnable sink logits, or None
    config: AttnConfig  # its params: the primitives' static arguments (``static``)
    qkv_format: _common.QKVFormat
    cp: Optional[ContextParallel] = None  # context parallelism over a mesh axis of size > 1

    @property
    def static(self) -> FusedAttnStatic:
        """The call's parameters as the primitives take them: the value selection read (``config.params``)."""
        return self.config.params


def _softmax_type(softmax_type, softmax_offset) -> _common.AttnSoftmaxType:
    """The call's softmax type (sink softmax: off-by-one and learnable, see ``fused_attn``)."""
    if isinstance(softmax_type, (int, float)) and not isinstance(softmax_type, bool):
        raise ValueError(
            f"`softmax_type` must be an AttnSoftmaxType (or 'vanilla', 'off_by_one', 'learnable'), got "
            f"{softmax_type!r}: fused_attn takes softmax_type before scaling_factor, as TransformerEngine does "
            "(qkv, bias, sequence_descriptor, seed, attn_bias_type, attn_mask_type, qkv_layout, softmax_type, "
            "scaling_factor, dropout_probability, is_training, ...)"
        )
    if isinstance(softmax_type, AttnSoftmaxType):
        kind = softmax_type
    elif isinstance(softmax_type, str) and softmax_type.upper() in AttnSoftmaxType.__members__:
        kind = AttnSoftmaxType[softmax_type.upper()]
    else:
        kind = AttnSoftmaxType.from_str(softmax_type.value if hasattr(softmax_type, "value") else softmax_type)
    if softmax_offset is not None and kind != AttnSoftmaxType.LEARNABLE_SOFTMAX:
        raise ValueError(
            f"`softmax_offset` must be None unless softmax_type is LEARNABLE_SOFTMAX, got an array with "
            f"softmax_type={kind.name}"
        )
    return to_common(kind, _common.AttnSoftmaxType, "softmax_type")


def _check_softmax_offset(softmax_type: _common.AttnSoftmaxType, softmax_offset, heads: int):
    """The learnable sink logits as fp32 ``[h_q]`` (TransformerEngine passes ``[1, h_q, 1, 1]``), or None."""
    if not softmax_type.is_learnable:
        return None
    if softmax_offset is None:
        raise ValueError(f"`softmax_offset` must be a float32 array [1, {heads}, 1, 1] with softmax_type="
                         "LEARNABLE_SOFTMAX, got None")
    softmax_offset = jnp.asarray(softmax_offset)
    if softmax_offset.dtype != jnp.float32 or tuple(softmax_offset.shape) not in ((1, heads, 1, 1), (heads,)):
        raise ValueError(f"`softmax_offset` must be float32 [1, {heads}, 1, 1] (or [{heads}]), got "
                         f"{softmax_offset.dtype}{list(softmax_offset.shape)}")
    return softmax_offset.reshape(heads)


def _is_mask_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def mask_to_sequence_descriptor(mask, attn_mask_type) -> "SequenceDescriptor":
    """A padding mask ``[b, 1, s_q, s_kv]`` (True = masked out, TransformerEngine's convention;
    padding only at the end of each row) -> :meth:`SequenceDescriptor.from_seqlens`, as
    TransformerEngine reads it: the query length is the number of queries that see key 0, the
    key/value length the number of keys row 0 sees (the most keys any row sees, for causal masks)."""
    mask = jnp.asarray(mask)
    # TransformerEngine reads any [b, 1, ..., 1, s_q, s_kv] mask (its sums index the last two
    # axes); MaxText passes [b, 1, 1, s_q, s_kv]. Size-1 axes between batch and (s_q, s_kv) are dropped.
    if mask.ndim < 4 or any(n != 1 for n in mask.shape[1:-2]):
        raise ValueError(
            f"`sequence_descriptor` as a mask must be [b, 1, s_q, s_kv] (or [b, 1, ..., 1, s_q, s_kv]), got shape "
            f"{mask.shape}")
    mask = mask.reshape(mask.shape[0], 1, *mask.shape[-2:])
    kind = to_common(attn_mask_type, _common.AttnMaskType, "attn_mask_type")
    real = jnp.logical_not(mask.astype(bool))
    q_lens = jnp.sum(real, axis=-2, dtype=jnp.int32)[:, 0, 0]
    if kind == _common.AttnMaskType.PADDING_MASK:
        kv_lens = jnp.sum(real, axis=-1, dtype=jnp.int32)[:, 0, 0]
    else:
        kv_lens = jnp.max(jnp.sum(real, axis=-1, dtype=jnp.int32), axis=(-1, -2))
    return SequenceDescriptor.from_seqlens((q_lens, kv_lens))


# -- _parse_call's steps, in the order it runs them (which fixes which error a call with several
# -- faults gets) --------------------------------------------------------------------------------


def _parse_kinds(args: _FusedAttnArgs) -> _Kinds:
    """Layout (and so format), mask, bias and softmax kinds as common members; refuses the kinds
    ``fused_attn`` does not run (arbitrary masks, ALiBi) and THD layouts without a padding mask."""
    kinds = _Kinds(
        layout=to_common(args.qkv_layout, _common.QKVLayout, "qkv_layout"),
        mask=to_common(args.attn_mask_type, _common.AttnMaskType, "attn_mask_type"),
        bias_type=to_common(args.attn_bias_type, _common.AttnBiasType, "attn_bias_type"),
        softmax_type=_softmax_type(args.softmax_type, args.softmax_offset),
    )
    if kinds.mask == _common.AttnMaskType.ARBITRARY_MASK:
        raise NotImplementedError(
            "`attn_mask_type` must not be 'arbitrary' in transformer_engine.jax (express the mask as a "
            "post_scale_bias of 0 / -inf, or use padding/causal masks with a SequenceDescriptor)"
        )
    if kinds.bias_type == _common.AttnBiasType.ALIBI:
        raise NotImplementedError(
            "`attn_bias_type` must not be 'alibi' in transformer_engine.jax (pass the ALiBi bias as a "
            "post_scale_bias)"
        )
    if kinds.is_thd and not kinds.mask.is_padding():
        raise ValueError(
            f"`attn_mask_type` must be a padding mask (padding, padding_causal, padding_causal_bottom_right) with "
            f"qkv_layout={kinds.layout.value!r}, got {kinds.mask.value!r}"
        )
    return kinds


def _check_score_mods(args: _FusedAttnArgs) -> None:
    """The cuDNN frontend's score modification callbacks and their tensors must all be None."""
    callbacks = dict(score_mod=args.score_mod, score_mod_bprop=args.score_mod_bprop,
                     score_mod_tensors=args.score_mod_tensors, score_mod_bprop_tensors=args.score_mod_bprop_tensors)
    given = [name for name, value in callbacks.items() if value is not None]
    if given:
        raise NotImplementedError(
            f"`{given[0]}` must be None in transformer_engine.jax (score modification callbacks build cuDNN "
            "frontend graphs; the Triton kernels take none), got "
            f"{', '.join(given)}"
        )


def _resolve_context_parallel(args: _FusedAttnArgs) -> Optional[ContextParallel]:
    """The call's context parallelism (:mod:`transformer_engine.jax.context_parallel`) from its
    strategy, load balancing, axis and stripe size (each checked there); None without one."""
    return context_parallel.resolve_context_parallel(
        args.context_parallel_strategy, args.context_parallel_causal_load_balanced, args.context_parallel_axis,
        args.stripe_size)


def _check_checkpoint_name(name) -> str:
    """The remat checkpoint name of the output: a non-empty str."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"`context_checkpoint_name` must be a non-empty str, got {name!r}")
    return name


def _parse_descriptor_form(args: _FusedAttnArgs, kinds: _Kinds) -> Tuple[Any, int]:
    """(sequence descriptor, max_segments_per_seq): a positive segment count, read as 1 (with a
    warning) outside THD; a padding mask array becomes a SequenceDescriptor (BSHD/SBHD only, and
    only for the padding masks, as TransformerEngine reads it; the other masks ignore it)."""
    descriptor, max_segments = args.sequence_descriptor, args.max_segments_per_seq
    if not isinstance(max_segments, int) or isinstance(max_segments, bool) or max_segments < 1:
        raise ValueError(f"`max_segments_per_seq` must be a positive int, got {max_segments!r}")
    if _is_mask_array(descriptor):
        if kinds.is_thd or max_segments != 1:
            raise ValueError(
                f"`sequence_descriptor` must be a SequenceDescriptor with qkv_layout={kinds.layout.value!r} and "
                f"max_segments_per_seq={max_segments} (a mask array describes one sequence per row), got "
                "an array"
            )
        descriptor = mask_to_sequence_descriptor(descriptor, kinds.mask) if kinds.mask.is_padding() else None
    if not kinds.is_thd and max_segments != 1:
        warnings.warn(
            f"max_segments_per_seq={max_segments} applies to THD layouts only; qkv_layout={kinds.layout.value!r} "
            "holds one sequence per row",
            UserWarning,
            stacklevel=5,  # fused_attn's caller
        )
        max_segments = 1
    return descriptor, max_segments


def _parse_dropout(dropout_probability) -> float:
    """The dropout probability as a float in [0, 1)."""
    try:
        dropout = float(dropout_probability)
    except (TypeError, ValueError):
        raise ValueError(f"`dropout_probability` must be a float in [0, 1), got {dropout_probability!r}") from None
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout_probability` must be in [0, 1), got {dropout_probability!r}")
    return dropout


def _parse_tensors(qkv, kinds: _Kinds):
    """(q, k, v) as BSHD arrays from the layout's packing and format, checked for rank, dtype and
    matching batch, sequence, head and head-dim sizes."""
    q, k, v = (_to_bshd(x, kinds.fmt) for x in _split_qkv(qkv, kinds.layout))
    _check_tensors(q, k, v)
    return q, k, v


def _parse_scores(args: _FusedAttnArgs, kinds: _Kinds, head_dim_qk: int) -> Tuple[float, Tuple[int, int]]:
    """(softmax scale, window) of the scores: the scale a Python float (None: ``1 / sqrt(d_qk)``),
    the window as the mask bounds it, ``bottom_right_diagonal`` None or a bool."""
    scaling_factor = head_dim_qk**-0.5 if args.scaling_factor is None else args.scaling_factor
    if isinstance(scaling_factor, jax.core.Tracer):
        raise ValueError(f"`scaling_factor` must be a Python float, got {scaling_factor!r}")
    scale = check_softmax_scale(scaling_factor, "scaling_factor")
    window = normalize_window(args.window_size, kinds.mask)
    if args.bottom_right_diagonal is not None and not isinstance(args.bottom_right_diagonal, bool):
        raise ValueError(f"`bottom_right_diagonal` must be None or a bool, got {args.bottom_right_diagonal!r}")
    return scale, window


def _parse_bias(bias, bias_type: _common.AttnBiasType, q, k):
    """The bias array (None for no_bias): ``[1|b, 1|h_q, s_q, s_kv]`` in the dtype of q."""
    if bias_type == _common.AttnBiasType.NO_BIAS:
        if bias is not None:
            raise ValueError("`bias` must be None with attn_bias_type='no_bias', got an array")
        return None
    if bias is None:
        raise ValueError(f"`bias` must be an array with attn_bias_type={bias_type.value!r}, got None")
    b, s_q, h_q, _ = q.shape
    s_kv = k.shape[1]
    bias = jnp.asarray(bias)
    if bias.ndim != 4 or bias.shape[2:] != (s_q, s_kv) or bias.shape[0] not in (1, b) or bias.shape[1] not in (1, h_q):
        raise ValueError(f"`bias` must have shape [1|{b}, 1|{h_q}, {s_q}, {s_kv}], got {bias.shape}")
    if bias.dtype != q.dtype:
        raise ValueError(f"`bias` must have the dtype of q ({q.dtype}), got {bias.dtype}")
    return bias


def _parse_sequences(descriptor, kinds: _Kinds, cp: Optional[ContextParallel], max_segments: int, q, k) -> SeqInfo:
    """The per-row segments: every token for the non-padding masks; else from the SequenceDescriptor
    (required; THD under load-balanced context parallelism put back in token order), checked
    against the shapes and, where concrete, its values."""
    b, s_q, s_kv = q.shape[0], q.shape[1], k.shape[1]
    if not kinds.mask.is_padding():
        return attention_math.full_seq_info(b, s_q, s_kv)
    if descriptor is None:
        raise ValueError(
            f"`sequence_descriptor` must be given with attn_mask_type={kinds.mask.value!r} (which tokens are real), "
            "got None"
        )
    if not isinstance(descriptor, SequenceDescriptor):
        raise ValueError(f"`sequence_descriptor` must be a SequenceDescriptor, got {type(descriptor).__name__}")
    if cp is not None and kinds.is_thd:
        descriptor = context_parallel.descriptor_in_global_order(descriptor, cp)
    seq = descriptor.to_seq_info(b, s_q, s_kv, kinds.is_thd, max_segments)
    _check_seq_values(descriptor, seq, s_q, s_kv, max_segments)
    return seq


def _lengths_may_differ(descriptor, kinds: _Kinds) -> bool:
    """Whether a padding mask's key/value lengths may differ from its query lengths: not when the
    descriptor holds one array for both (``from_seqlens(lens)``; traced arguments of ``jit`` are two)."""
    if not kinds.mask.is_padding() or descriptor is None:
        return False
    for name in ("seqlens", "seq_offsets", "segment_ids"):
        pair = getattr(descriptor, name)
        if pair is not None and pair[0] is not pair[1]:
            return True
    return False


def _has_offset_sequences(descriptor, kinds: _Kinds) -> bool:
    """Whether a BSHD/SBHD call's padded sequences may start after token 0 of their row (offsets
    or segment ids; see ``_frontend_extra``)."""
    return kinds.mask.is_padding() and not kinds.is_thd and (
        descriptor.seq_offsets is not None or descriptor.segment_ids is not None)


def _check_context_parallel(cp: ContextParallel, kinds: _Kinds, dropout: float, is_training: bool,
                            window: Tuple[int, int], max_segments: int, q, k) -> None:
    """Refuse what the context-parallel path does not run (see ``context_parallel``)."""
    context_parallel.check_context_parallel_supported(
        cp, layout=kinds.layout, mask=kinds.mask, bias_type=kinds.bias_type, dropout=dropout,
        is_training=is_training, softmax_type=kinds.softmax_type, window=window, max_segments=max_segments,
        s_q=q.shape[1], s_kv=k.shape[1], local=cp.axis in context_parallel._manual_axes())


def _dropout_seeds(seed, dropout: float, is_training: bool, batch: int, heads: int):
    """Per (row, head) dropout seeds ``[b, h_q, 2]`` from ``seed`` (required with active dropout); zeros without."""
    if not (is_training and dropout > 0.0):
        return jnp.zeros((batch, heads, 2), jnp.uint32)
    if seed is None:
        raise ValueError("`seed` must be a PRNG key (or integer seed) when dropout is active, got None")
    return attention_math.head_seeds(attention_math.seed_words(seed), batch, heads)


def _call_config(static: FusedAttnStatic, kinds: _Kinds, qkv, bias, offset_sequences: bool,
                 context_parallel_axis: bool = False, top_left_lengths_may_differ: bool = False) -> AttnConfig:
    """The call's AttnConfig (what backend selection reads): its parameters ``static`` on its parsed tensors."""
    q, k, v = qkv
    return _make_config(
        batch_size=q.shape[0], num_heads_q=q.shape[2], num_heads_kv=k.shape[2], head_dim_qk=q.shape[3],
        head_dim_v=v.shape[3], max_seqlen_q=q.shape[1], max_seqlen_kv=k.shape[1], dtype=q.dtype, params=static,
        packing=kinds.layout.packing, bias_shape=None if bias is None else bias.shape,
        offset_sequences=offset_sequences, context_parallel_axis=context_parallel_axis,
        top_left_lengths_may_differ=top_left_lengths_may_differ,
    )


def _check_return_max_logit(value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`return_max_logit` must be a bool, got {value!r}")
    return bool(value)


def _parse_call(args: _FusedAttnArgs) -> _Call:
    """Check a ``fused_attn`` call and put it in canonical form: BSHD operands, per-row segments,
    dropout seeds, its AttnConfig (for selection) and the primitives' static arguments."""
    kinds = _parse_kinds(args)
    _check_score_mods(args)
    _check_return_max_logit(args.return_max_logit)
    cp = _resolve_context_parallel(args)
    checkpoint = _check_checkpoint_name(args.context_checkpoint_name)
    descriptor, max_segments = _parse_descriptor_form(args, kinds)
    dropout = _parse_dropout(args.dropout_probability)
    is_training = bool(args.is_training)
    q, k, v = _parse_tensors(args.qkv, kinds)
    scale, window = _parse_scores(args, kinds, head_dim_qk=q.shape[3])
    bias = _parse_bias(args.bias, kinds.bias_type, q, k)
    seq = _parse_sequences(descriptor, kinds, cp, max_segments, q, k)
    if cp is not None:
        _check_context_parallel(cp, kinds, dropout, is_training, window, max_segments, q, k)
    softmax_offset = _check_softmax_offset(kinds.softmax_type, args.softmax_offset, q.shape[2])
    seeds = _dropout_seeds(args.seed, dropout, is_training, q.shape[0], q.shape[2])
    # The call's parameters, once: backend selection (its AttnConfig) and the primitives read this value.
    static = FusedAttnStatic(
        attn_mask_type=kinds.mask, attn_bias_type=kinds.bias_type, qkv_format=kinds.fmt, window_size=window,
        scaling_factor=scale, dropout_probability=dropout, is_training=is_training,
        deterministic=is_deterministic_mode(), checkpoint_name=checkpoint,
        bottom_right_diagonal=resolve_bottom_right_diagonal(kinds.mask, args.bottom_right_diagonal, "jax"),
        softmax_type=kinds.softmax_type, return_max_logit=bool(args.return_max_logit),
    )
    config = _call_config(static, kinds, (q, k, v), bias,
                          offset_sequences=_has_offset_sequences(descriptor, kinds),
                          context_parallel_axis=cp is not None,
                          top_left_lengths_may_differ=(kinds.mask.is_top_left_causal()
                                                       and _lengths_may_differ(descriptor, kinds)))
    return _Call(q, k, v, bias, seq, seeds, softmax_offset, config, kinds.fmt, cp)


class _FlashBackend(FlashAttention):
    """flash-attn-4 (:mod:`transformer_engine.jax.flash_backend`)."""

    @staticmethod
    def run(call: _Call):
        return flash_backend.flash_attention(call.q, call.k, call.v, call.seq, call.static)


class _FusedBackend(FusedAttention):
    """The fused primitives (the Triton kernels on CUDA GPUs; their jnp lowering on CPU)."""

    @staticmethod
    def run(call: _Call):
        return fused_attn_core(call.q, call.k, call.v, call.bias, call.seq, call.seeds, call.static,
                               call.softmax_offset)


class _UnfusedBackend(UnfusedDotProductAttention):
    """jnp math."""

    @staticmethod
    def run(call: _Call):
        s = call.static
        out = attention_math.unfused_attention(
            call.q, call.k, call.v, call.bias, call.seq, call.seeds,
            attn_mask_type=s.attn_mask_type, attn_bias_type=s.attn_bias_type, window_size=s.window_size,
            scaling_factor=s.scaling_factor, dropout_probability=s.dropout_probability, is_training=s.is_training,
            bottom_right_diagonal=s.bottom_right,
            softmax_type=s.softmax_type, softmax_offset=call.softmax_offset, return_max_logit=s.return_max_logit,
        )
        if s.return_max_logit:
            out, max_logit = out
            return checkpoint_name(out, s.checkpoint_name), max_logit
        return checkpoint_name(out, s.checkpoint_name)


# The JAX backends: the common registry's JAX backends (backends_for("jax")), in its order, with runners.
_CANDIDATES = (_FlashBackend, _FusedBackend, _UnfusedBackend)


def _run(call: _Call, backend):
    """``call`` on ``backend`` (one of ``_CANDIDATES``); with a context-parallel axis, the fused
    primitives under context parallelism (on CPU their jnp lowering). The output in the call's format,
    and with ``return_max_logit`` ``(output, max_logit)``."""
    if call.cp is not None and issubclass(backend, FusedAttention):
        result = context_parallel.context_parallel_attention(call.q, call.k, call.v, call.static, call.cp, call.seq)
    elif call.cp is not None:  # the backend's own call on every rank's gathered rows
        bare = dataclasses.replace(call, q=None, k=None, v=None, seq=None, bias=None, seeds=None,
                                   softmax_offset=None, cp=None)
        result = context_parallel.replicated_attention(functools.partial(_whole_rows, bare, backend), call.q,
                                                       call.k, call.v, call.static, call.cp, call.seq)
    else:
        result = backend.run(call)
    out, rest = (result[0], result[1:]) if call.static.return_max_logit else (result, ())
    if call.cp is not None:
        out = checkpoint_name(out, call.static.checkpoint_name)
    out = _to_bshd(out, call.qkv_format)  # SBHD: swap back
    return (out, *rest) if rest else out


def _whole_rows(bare: _Call, backend, q, k, v, seq):
    """``backend`` on gathered rows (context parallelism of a whole-sequence backend): no bias, dropout or
    sink offset, which context parallelism refuses."""
    return backend.run(dataclasses.replace(bare, q=q, k=k, v=v, seq=seq))


def select_attention_backend(config: AttnConfig) -> Selection:
    """The backend ``fused_attn`` uses for ``config`` (honours NVTE_FUSED_ATTN_BACKEND etc.)."""
    return select_backend(config, _CANDIDATES)


def fused_attn(
    qkv: Tuple[jax.Array, ...],
    bias: Optional[jax.Array],
    sequence_descriptor: Optional[Union[SequenceDescriptor, jax.Array]],
    seed: Optional[jax.Array],
    attn_bias_type: AttnBiasType,
    attn_mask_type: AttnMaskType,
    qkv_layout: QKVLayout,
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
    scaling_factor: Optional[float] = None,
    dropout_probability: float = 0.0,
    is_training: bool = True,
    max_segments_per_seq: int = 1,
    window_size: Optional[Tuple[int, int]] = None,
    context_parallel_strategy: CPStrategy = CPStrategy.DEFAULT,
    context_parallel_causal_load_balanced: bool = False,
    context_parallel_axis: str = "",
    context_checkpoint_name: str = "context",
    softmax_offset: Optional[jax.Array] = None,
    stripe_size: Optional[int] = None,
    score_mod: Optional[Callable] = None,
    score_mod_bprop: Optional[Callable] = None,
    score_mod_tensors: Optional[Mapping[str, Any]] = None,
    score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None,
    bottom_right_diagonal: Optional[bool] = None,
    return_max_logit: bool = False,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    """Scaled dot-product attention, ``softmax(Q K^T * scaling_factor + bias) V``, with masks.

    The arguments are TransformerEngine-JAX's, in its order (:doc:`/jax_te_compat` lists what each
    one does here).

    :param qkv: by ``qkv_layout`` packing: ``(qkv,)`` with ``qkv`` ``[b, s, 3, h, d]`` (BS3HD,
        T3HD; ``[s, b, 3, h, d]`` for SB3HD), ``(q, kv)`` with ``kv`` ``[b, s_kv, 2, h_kv, d]``
        (BSHD_BS2HD, THD_T2HD, SBHD_SB2HD), or ``(q, k, v)``: ``q`` ``[b, s_q, h_q, d_qk]``, ``k``
        ``[b, s_kv, h_kv, d_qk]``, ``v`` ``[b, s_kv, h_kv, d_v]`` (SBHD: sequence first). THD
        layouts are ``[b, s, ...]`` too, each row packing up to ``max_segments_per_seq``
        sequences. ``h_q`` is a multiple of ``h_kv``: query head ``i`` uses key/value head
        ``i // (h_q // h_kv)`` (GQA; MQA when ``h_kv == 1``). float16, bfloat16 or float32.
    :param bias: ``[1 | b, 1 | h_q, s_q, s_kv]`` for post_scale_bias (added after scaling) or
        pre_scale_bias (added before); ``None`` for no_bias. Differentiable.
    :param sequence_descriptor: a :class:`SequenceDescriptor` (required for padding masks and THD),
        or, for BSHD/SBHD, a padding mask ``[b, 1, s_q, s_kv]`` with True where attention is masked
        out, read as TransformerEngine reads it (:func:`mask_to_sequence_descriptor`; only for the
        padding masks, the others ignore it).
    :param seed: PRNG key (or integer) for dropout; may be ``None`` without dropout.
    :param attn_mask_type: no_mask, padding, causal, padding_causal, causal_bottom_right,
        padding_causal_bottom_right (``AttnMaskType.CAUSAL_MASK`` etc.). Causal is top-left
        aligned; bottom_right aligns the diagonal with the last key of each sequence.
    :param softmax_type: ``AttnSoftmaxType`` (or ``'vanilla'``, ``'off_by_one'``, ``'learnable'``).
        Sink softmax adds one logit per row to the normaliser: 0 for ``OFF_BY_ONE_SOFTMAX``,
        ``softmax_offset[h]`` for ``LEARNABLE_SOFTMAX`` (added to the scaled scores as it is). The
        sink has no value vector: a query that sees no key still gets zeros, and dropout drops the
        keys' probabilities. A number here is refused with ``ValueError``: it is a call written for
        the order without ``softmax_type``.
    :param scaling_factor: logits scale; ``None`` is ``1 / sqrt(d_qk)``.
    :param dropout_probability: in ``[0, 1)``; applied only when ``is_training``.
    :param max_segments_per_seq: sequences per row for THD layouts (other layouts hold one; a
        larger value there warns, as TransformerEngine does, and is read as 1).
    :param window_size: ``(left, right)`` sliding window, ``-1`` unbounded (``None``: no window):
        query ``i`` sees keys ``i + d - left <= j <= i + d + right`` of its sequence (positions from the
        sequence start), with ``d = 0`` (top-left) or ``d = len_kv - len_q`` (bottom-right).
    :param bottom_right_diagonal: the window's diagonal for the non-causal masks: ``None`` (default)
        is TransformerEngine-JAX's top-left; ``True`` aligns it bottom-right, as TransformerEngine-PyTorch's
        default does. ``causal``/``padding_causal`` are always top-left and the ``*_bottom_right`` masks
        bottom-right (an explicit value is overridden, as in TransformerEngine-PyTorch). Not in
        TransformerEngine-JAX's signature (keyword only by convention).
    :param return_max_logit: also return each query head's max logit (for QK-clip), as
        TransformerEngine-PyTorch's ``return_max_logit``: ``(out, max_logit)``, ``max_logit`` ``[h_q]`` in
        the dtype of ``q``, no gradient: the largest ``scaling_factor * q k^T + bias`` over the visible
        (query, key) pairs of the batch, before dropout, the sink logit not included (-inf for a head with
        none). The fused kernels compute it in their forward (each row's max, then a max over the rows:
        order-free, so deterministic and the same on any sharding): split batch and sequence (context
        parallelism) are reduced over their mesh axes. Inside a ``shard_map`` it is the max over the local
        batch (and, with a context-parallel axis, the whole sequence). Not in TransformerEngine-JAX's
        signature (keyword only).
    :param context_parallel_strategy: ``CPStrategy.DEFAULT`` (= ``ALL_GATHER``), ``ALL_GATHER`` or
        ``RING``: how keys and values reach each rank when the sequence is split over
        ``context_parallel_axis`` (a mesh axis name; ``''`` reads ``MeshResource.cp_resource``). With
        ``context_parallel_causal_load_balanced`` the inputs are in ``reorder_causal_load_balancing``'s
        DualChunkSwap order (BSHD/SBHD; with a ``stripe_size``, ours, their Striped order) or Striped
        order with ``stripe_size`` (THD; None is 1). An axis
        of size 1 is the plain path. :mod:`transformer_engine.jax.context_parallel` says what runs
        (BSHD/SBHD with no_mask and causal; THD with the padding masks; no bias or dropout; in
        deterministic mode bitwise the same as the single-device call) and refuses the rest.
    :param context_checkpoint_name: the ``jax.ad_checkpoint.checkpoint_name`` given to the output
        (and, on the fused backend, to the saved softmax statistics) for remat policies.
    :param softmax_offset: float32 ``[1, h_q, 1, 1]``, the learnable sink logits (required for
        ``LEARNABLE_SOFTMAX``, ``None`` otherwise); differentiable. Its gradient sums each sequence's
        part (rows in a fixed order) over the sequences as a fixed pairwise tree in batch order, so in
        deterministic mode it is bitwise reproducible and the same on any sharding.
    :param score_mod: a cuDNN frontend callback; it, ``score_mod_bprop``, ``score_mod_tensors``
        and ``score_mod_bprop_tensors`` must be ``None`` (``NotImplementedError``).
    :returns: ``[b, s_q, h_q, d_v]`` (``[s_q, b, h_q, d_v]`` for SBHD) in the dtype of ``q``. A
        query that sees no key gets zeros, and zero gradients. With ``return_max_logit``, ``(out, max_logit)``.

    Determinism: the forward pass is always deterministic. With
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or ``--xla_gpu_deterministic_ops=true`` the backward is
    bitwise reproducible too (the fused kernels use their deterministic plan; the unfused backend
    always is).
    """
    args = _FusedAttnArgs(
        qkv=qkv,
        bias=bias,
        sequence_descriptor=sequence_descriptor,
        seed=seed,
        attn_bias_type=attn_bias_type,
        attn_mask_type=attn_mask_type,
        qkv_layout=qkv_layout,
        softmax_type=softmax_type,
        scaling_factor=scaling_factor,
        dropout_probability=dropout_probability,
        is_training=is_training,
        max_segments_per_seq=max_segments_per_seq,
        window_size=window_size,
        context_parallel_strategy=context_parallel_strategy,
        context_parallel_causal_load_balanced=context_parallel_causal_load_balanced,
        context_parallel_axis=context_parallel_axis,
        context_checkpoint_name=context_checkpoint_name,
        softmax_offset=softmax_offset,
        stripe_size=stripe_size,
        score_mod=score_mod,
        score_mod_bprop=score_mod_bprop,
        score_mod_tensors=score_mod_tensors,
        score_mod_bprop_tensors=score_mod_bprop_tensors,
        bottom_right_diagonal=bottom_right_diagonal,
        return_max_logit=return_max_logit,
    )
    out, _ = _attention_with_selection(args)
    return out


def _attention_with_selection(args: _FusedAttnArgs) -> Tuple[jax.Array, Selection]:
    """``fused_attn`` that also returns the backend selection (the Flax module logs fallbacks)."""
    call = _parse_call(args)
    selection = select_attention_backend(call.config)  # with or without a cp axis: one choice, one bits
    if call.cp is not None and not issubclass(selection.backend, (FusedAttention, UnfusedDotProductAttention)):
        reasons = "; ".join(selection.rejected.get(FusedAttention.NAME, ())) or f"selected {selection.name}"
        raise NotImplementedError(
            f"`context_parallel_axis` {call.cp.axis!r} (size {call.cp.size}) needs the fused or the unfused attention "
            f"backend, selected {selection.name}: {reasons}")
    return _run(call, selection.backend), selection


def is_fused_attn_kernel_available(
    is_training: bool,
    q_dtype,
    kv_dtype,
    qkv_layout: QKVLayout,
    attn_bias_type: AttnBiasType,
    attn_mask_type: AttnMaskType,
    softmax_type: AttnSoftmaxType,
    dropout_probability: float,
    q_num_heads: int,
    kv_num_heads: int,
    q_max_seqlen: int,
    kv_max_seqlen: int,
    head_dim_qk: int,
    head_dim_v: Optional[int] = None,
    window_size: Optional[Tuple[int, int]] = None,
    bias_shape: Optional[Sequence[int]] = None,
) -> bool:
    """Whether the fused (Triton) kernels can run this configuration here, now (device, build,
    NVTE_FUSED_ATTN, determinism). TransformerEngine's arguments, in its order (``bias_shape``
    added). ``fused_attn_unavailable_reasons`` says why not."""
    return not fused_attn_unavailable_reasons(
        is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type, attn_mask_type, softmax_type, dropout_probability,
        q_num_heads, kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk, head_dim_v, window_size, bias_shape,
    )


def fused_attn_unavailable_reasons(
    is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type, attn_mask_type, softmax_type, dropout_probability,
    q_num_heads, kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk, head_dim_v=None, window_size=None,
    bias_shape=None,
) -> List[str]:
    """Reasons ``fused_attn`` does not pick the fused backend for this configuration (empty: it does)."""
    return _fused_reasons(
        is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type, attn_mask_type, dropout_probability,
        q_num_heads, kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk, head_dim_v, window_size, bias_shape,
        softmax_type=softmax_type,
    )


def _fused_reasons(
    is_training, q_dtype, kv_dtype, qkv_layout, attn_bias_type, attn_mask_type, dropout_probability,
    q_num_heads, kv_num_heads, q_max_seqlen, kv_max_seqlen, head_dim_qk, head_dim_v=None, window_size=None,
    bias_shape=None, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX,
) -> List[str]:
    """Why the fused backend cannot run a configuration (what ``fused_attn`` selects by, and what the
    GPU tests ask before forcing it)."""
    mask = to_common(attn_mask_type, _common.AttnMaskType, "attn_mask_type")
    reasons = []
    stype = _softmax_type(softmax_type, None)
    if jnp.dtype(q_dtype) != jnp.dtype(kv_dtype):
        reasons.append(f"q_dtype={jnp.dtype(q_dtype).name} != kv_dtype={jnp.dtype(kv_dtype).name}")
    bias_type = to_common(attn_bias_type, _common.AttnBiasType, "attn_bias_type")
    if bias_shape is None and bias_type != _common.AttnBiasType.NO_BIAS:
        bias_shape = (1, q_num_heads, q_max_seqlen, kv_max_seqlen)
    layout = to_common(qkv_layout, _common.QKVLayout, "qkv_layout")
    params = FusedAttnStatic(  # the softmax scale is no selection's concern: TransformerEngine's default
        attn_mask_type=mask, attn_bias_type=bias_type, qkv_format=layout.qkv_format,
        window_size=normalize_window(window_size, mask), scaling_factor=1.0 / float(np.sqrt(head_dim_qk)),
        dropout_probability=float(dropout_probability), is_training=bool(is_training),
        deterministic=is_deterministic_mode(), softmax_type=stype)
    config = _make_config(
        batch_size=1, num_heads_q=q_num_heads, num_heads_kv=kv_num_heads, head_dim_qk=head_dim_qk,
        head_dim_v=head_dim_qk if head_dim_v is None else head_dim_v, max_seqlen_q=q_max_seqlen,
        max_seqlen_kv=kv_max_seqlen, dtype=q_dtype, params=params, packing=layout.packing, bias_shape=bias_shape,
    )
    if not settings.get(FusedAttention.ENABLE_VAR):
        reasons.append(f"disabled by {FusedAttention.ENABLE_VAR}=0")
    return reasons + FusedAttention.not_supported_reasons(config)
