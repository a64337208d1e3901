"""Context parallelism for ``fused_attn``: the sequence split over a mesh axis, each reduction on one device.

TransformerEngine-JAX's arguments: ``context_parallel_axis`` (a mesh axis name; ``''`` reads
``MeshResource.cp_resource`` of :func:`~transformer_engine.jax.sharding.global_shard_guard`),
``context_parallel_strategy`` (:class:`~transformer_engine.jax.enums.CPStrategy`: ``ALL_GATHER``,
``RING``; ``DEFAULT`` is ``ALL_GATHER``) and ``context_parallel_causal_load_balanced`` (the tokens
were reordered with ``reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, cp, seq_dim)``:
the sequence in ``2 * cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``; with
``stripe_size``, ours for BSHD/SBHD, in the Striped order of ``ReorderStrategy.Striped`` with that
stripe size, which the common plan runs as its STRIPED order, one call per own stripe and pass). With a
context-parallel axis of size 1 the call takes the plain path, at no cost.

Called under ``jit`` with the mesh in effect, ``fused_attn`` runs the attention in a ``shard_map``
over the mesh (sequence over the context-parallel axis, batch over dp/fsdp and heads over tp as
``MeshResource`` names them); called inside the user's own ``shard_map`` in which the axis is
manual, it runs on the local chunks directly.

How each device computes its rows (the design, for every strategy):

- Forward, for each own query chunk ``[a, a + c)``: keys and values are gathered (``ALL_GATHER``:
  ``all_gather``; ``RING``: ``cp - 1`` ``ppermute`` steps) and put back in global token order;
  the chunk attends to them through the fused forward primitive. Causal: keys ``[0, a + c)``
  (the rest is padding) with the diagonal aligned bottom-right, which is the top-left causal mask
  of those rows of the whole sequence. No mask: every key.
- Backward, inside one ``jax.custom_vjp`` around the whole context-parallel attention (so autodiff
  never reduce-scatters partial dK/dV): dQ of an own chunk from the fused backward primitive over
  the same keys (dQ only); dK/dV of an own key/value chunk from the fused backward primitive
  over the gathered query rows ``[a, s)`` (queries, outputs, output gradients and log-sum-exp
  gathered in global order, the chunk's queries a sequence starting at ``a``) with the causal
  mask top-left (dK/dV only).

Every sum (the softmax over keys, dQ over keys, dK/dV over queries and over the heads of a GQA
group) then runs on one device, over the same keys or queries in the same order as the
single-device call: in deterministic mode the outputs and gradients of every token are bitwise the
same for any cp, and the same as without context parallelism. For the kernels' query and key blocks
to be the single call's, each causal chunk call starts at the common plan's ``aligned_start``: the
chunk start rounded down to the largest tile of the call's plans (:func:`tile_alignment`; 1 on the
CPU lowering, which contracts row-independently in deterministic mode, see ``attention_math``). When
a chunk length is not a multiple of that tile, the chunk buffers get zero rows in front (as many as
the largest such lead of any rank, a static size) and the calls take the rows from the tile boundary
as a sequence at an offset of the buffer; the extra rows' results are dropped. Without a mask the
calls need no lead: every row sees every key from key 0, and the dK/dV call's queries start at 0.
The backward runs two fused backward calls per chunk, each only the pass whose results it keeps
(``FusedAttnStatic.backward_grads``: dQ only, dK/dV only; the kernels are the whole backward's, so
the bits are too): over the ``cp`` devices the dQ and dK/dV passes together do about the
single-device backward's work (each device about ``1 / cp`` of it), plus the cheap preprocess
(``delta``, O(s d) per head) once in each call.

The chunking, the load-balanced order, each rank's (query chunk, key chunk) blocks, the tile
alignment and what context parallelism supports are the framework-free plan of
:mod:`transformer_engine.common.attention.context_parallel`, which PyTorch carries out too
(:meth:`_Plan.rank_plan` is the plan this module runs). Without a mask the two own chunks' calls are
one call over the rank's rows (the same blocks: every row sees every key).

What runs: the layouts of the BSHD and SBHD formats (separate, kv-packed, qkv-packed), masks
``no_mask``, ``causal`` and ``causal_bottom_right`` (the same mask, as ``s_q == s_kv``), no bias,
no dropout, vanilla softmax, no sliding window, one sequence per row, ``s_q == s_kv`` for causal;
TransformerEngine-JAX runs no more (it has no SBHD).

THD (packed rows, from ``jit`` with the mesh set): the padding masks, several sequences per row, any
window, no bias, no dropout, vanilla softmax. With ``context_parallel_causal_load_balanced`` the
tokens (and the segment ids and positions) are in the Striped order of
``reorder_causal_load_balancing(x, ReorderStrategy.Striped, cp, 1, stripe_size)`` (``stripe_size``
None is 1), as TransformerEngine-JAX's THD load balancing expects; without it, in contiguous
chunks. The common plan chunks the packed row and each call runs one pseudo-sequence per segment over
the gathered rows (see "THD" below): each rank computes about 1 / cp of the rows, bitwise the cp = 1
result, causal sliding windows included (the plan's calls carry the window). A window on a non-causal
padding mask runs the single-device call on the gathered rows on every rank instead.

The backend is the one the call selects without context parallelism: the fused primitives as
above, or (the CPU's choice) the unfused backend on every rank's gathered rows
(:func:`replicated_attention`), so that cp = N is bitwise cp = 1 on every device.

The rest is refused with ``NotImplementedError``; malformed arguments with ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from transformer_engine.common.attention import context_parallel as cp_plan
from transformer_engine.common.attention import enums as _common
from transformer_engine.common.attention.enums import BackwardGrads
from transformer_engine.jax.attention_math import SeqInfo, full_seq_info, lse_to_segments, lse_to_tokens
from transformer_engine.jax import jax_compat
from transformer_engine.jax.enums import CPStrategy, ReorderStrategy
from transformer_engine.jax.load_balancing import (_permute_chunks, inverse_reorder_causal_load_balancing,
                                                     reorder_causal_load_balancing)
from transformer_engine.jax.primitives.attention import FusedAttnStatic, fused_attn_bwd, fused_attn_fwd, max_logit
from transformer_engine.jax.sharding import batch_axes, global_mesh_resource, head_axes

__all__ = ["ContextParallel", "resolve_context_parallel", "check_context_parallel_supported",
           "context_parallel_attention", "replicated_attention", "descriptor_in_global_order", "make_plan",
           "tile_alignment", "rank_forward", "rank_backward", "unsupported_reasons"]


@dataclass(frozen=True)
class ContextParallel:
    """A call's context parallelism: mesh axis, its size (> 1), strategy, load-balanced order."""

    axis: str
    size: int
    strategy: CPStrategy  # ALL_GATHER or RING (DEFAULT resolved)
    load_balanced: bool
    # The Striped order's stripe: THD's (None: 1); BSHD/SBHD take DualChunkSwap with None and the Striped
    # order of such stripes with an int (ours: TransformerEngine-JAX has no Striped BSHD).
    stripe_size: Optional[int] = None

    def reorder(self, thd: bool) -> Optional[ReorderStrategy]:
        """The order the tokens arrive in: None (contiguous chunks), DualChunkSwap or Striped (THD, or
        BSHD/SBHD with a ``stripe_size``)."""
        if not self.load_balanced:
            return None
        if thd or self.stripe_size is not None:
            return ReorderStrategy.Striped
        return ReorderStrategy.DualChunkSwap

    def reorder_stripe(self, thd: bool) -> Optional[int]:
        """``reorder_causal_load_balancing``'s ``stripe_size`` for the order of :meth:`reorder`."""
        return self.stripe if self.reorder(thd) == ReorderStrategy.Striped else None

    @property
    def stripe(self) -> int:
        return 1 if self.stripe_size is None else int(self.stripe_size)

    @property
    def balance(self) -> cp_plan.LoadBalance:
        """The common plan's load balance of the BSHD/SBHD path: the input's order."""
        if not self.load_balanced:
            return cp_plan.LoadBalance.CONTIGUOUS
        return cp_plan.LoadBalance.DUAL_CHUNK if self.stripe_size is None else cp_plan.LoadBalance.STRIPED

    @property
    def unit(self) -> int:
        """What a BSHD/SBHD sequence length must be a multiple of: the plan's chunks (Striped: a round of
        ``cp`` stripes)."""
        if self.balance == cp_plan.LoadBalance.STRIPED:
            return self.size * self.stripe
        return cp_plan.num_chunks(self.size, self.balance)

    def rounds(self, seqlen: int) -> int:
        """The plan's rounds of ``cp`` stripes for a BSHD/SBHD sequence of ``seqlen`` tokens (1 unless
        Striped)."""
        return seqlen // (self.size * self.stripe) if self.balance == cp_plan.LoadBalance.STRIPED else 1

    @property
    def comm_type(self) -> str:
        """The common plan's comm type: ALL_GATHER gathers in one collective, RING in a p2p ring."""
        return "p2p" if self.strategy == CPStrategy.RING else "all_gather"


# ================================================================================================
# Arguments
# ================================================================================================


def _current_meshes():
    """The meshes in effect: ``with mesh:`` (TransformerEngine's way) and ``jax.set_mesh``."""
    return jax_compat.current_meshes()


def _manual_axes() -> frozenset:
    """Mesh axes that are manual here (inside ``shard_map``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return frozenset()
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def mesh_axis_size(axis: str) -> int:
    """Size of mesh axis ``axis`` in the mesh in effect; 1 when there is no such mesh or axis."""
    for mesh in _current_meshes():
        if axis in mesh.axis_names:
            return int(mesh.shape[axis])
    return 1


def resolve_context_parallel(strategy, load_balanced, axis, stripe_size) -> Optional[ContextParallel]:
    """The call's :class:`ContextParallel`, or None when there is none (no axis, or one of size 1)."""
    if not isinstance(strategy, CPStrategy):
        raise ValueError(
            f"`context_parallel_strategy` must be a CPStrategy (DEFAULT, ALL_GATHER or RING), got {strategy!r}")
    if not isinstance(axis, str):
        raise ValueError(f"`context_parallel_axis` must be a mesh axis name (str, '' for none), got {axis!r}")
    if not isinstance(load_balanced, (bool, np.bool_)):
        raise ValueError(f"`context_parallel_causal_load_balanced` must be a bool, got {load_balanced!r}")
    if stripe_size is not None and (not isinstance(stripe_size, (int, np.integer)) or isinstance(stripe_size, bool)
                                    or stripe_size < 1):
        raise ValueError(f"`stripe_size` must be None or a positive int, got {stripe_size!r}")
    if not axis:
        axis = global_mesh_resource().cp_resource or ""
    size = mesh_axis_size(axis) if axis else 1
    if size == 1:
        return None  # with one rank the load-balancing order is the identity: nothing to do
    if strategy == CPStrategy.DEFAULT:
        strategy = CPStrategy.ALL_GATHER
    return ContextParallel(axis=axis, size=size, strategy=strategy, load_balanced=bool(load_balanced),
                           stripe_size=None if stripe_size is None else int(stripe_size))


def unsupported_reasons(cp: ContextParallel, *, layout, mask, bias_type, dropout, is_training, softmax_type, window,
                        max_segments, local: bool) -> list:
    """Why this module's context parallelism cannot run a call: the common plan's reasons (JAX's argument
    names; THD runs replicated, see "THD" below) and those of JAX's own forms. The kinds are common
    enum members (or their string values)."""
    layout, mask = _common.QKVLayout(layout), _common.AttnMaskType(mask)
    bias_type, softmax_type = _common.AttnBiasType(bias_type), _common.AttnSoftmaxType(softmax_type)
    thd = layout.qkv_format == _common.QKVFormat.THD
    reasons = cp_plan.unsupported_reasons(
        comm_type=cp.comm_type, qkv_format=layout.qkv_format, mask=mask, bias_type=bias_type, dropout=dropout,
        is_training=is_training, softmax_type=softmax_type, window=window, replicated_thd=True,
        names=cp_plan.JAX_ARGS)
    if thd and local:
        reasons.insert(0, "`qkv_layout` must be a BSHD or SBHD layout inside shard_map: THD context parallelism "
                          "runs from jit with the mesh set, where the segment ids are global")
    if not thd and max_segments != 1:
        reasons.append(f"`max_segments_per_seq` must be 1, got {max_segments}: several segments per row of a "
                       "BSHD/SBHD layout are not supported with context parallelism")
    return reasons


def check_context_parallel_supported(cp: ContextParallel, *, layout, mask, bias_type, dropout, is_training,
                                     softmax_type, window, max_segments, s_q, s_kv, local: bool) -> None:
    """Refuse what the context-parallel path does not run, naming the argument. ``s_q``/``s_kv``:
    the sequence lengths the call sees (local chunks when ``local``)."""
    where = f"with context parallelism over mesh axis {cp.axis!r} of size {cp.size}"
    layout, mask = _common.QKVLayout(layout), _common.AttnMaskType(mask)
    thd = layout.qkv_format == _common.QKVFormat.THD
    reasons = unsupported_reasons(cp, layout=layout, mask=mask, bias_type=bias_type, dropout=dropout,
                                  is_training=is_training, softmax_type=softmax_type, window=window,
                                  max_segments=max_segments, local=local)
    if reasons:
        raise NotImplementedError(f"{'; '.join(reasons)} ({where})")
    if thd:
        if s_q != s_kv:
            raise NotImplementedError(f"`qkv` must have as many query as key tokens per row with THD {where}, got "
                                      f"s_q={s_q}, s_kv={s_kv}")
        unit = cp.size * cp.stripe if cp.load_balanced else cp.size
        if s_q % unit:
            why = (f"cp_size * stripe_size = {unit} (Striped order)" if cp.load_balanced else f"cp_size = {unit}")
            raise ValueError(f"`qkv` sequence length must be a multiple of {why} {where}, got {s_q}")
        return
    if cp.stripe_size is not None and not cp.load_balanced:
        raise ValueError(f"`stripe_size` must be None without context_parallel_causal_load_balanced=True with "
                         f"qkv_layout={layout.value!r} {where} (it sets the Striped order of load-balanced "
                         f"inputs), got {cp.stripe_size}")
    total_q, total_kv = (s_q * cp.size, s_kv * cp.size) if local else (s_q, s_kv)
    if mask.is_causal() and total_q != total_kv:
        raise NotImplementedError(
            f"`qkv` must have as many queries as keys with a causal mask {where}, got s_q={total_q}, s_kv={total_kv}")
    unit = cp.unit
    for name, total in (("s_q", total_q), ("s_kv", total_kv)):
        if total % unit:
            if cp.balance == cp_plan.LoadBalance.STRIPED:
                why = f"cp_size * stripe_size = {unit} (Striped order)"
            elif cp.load_balanced:
                why = f"2 * cp_size = {unit} (context_parallel_causal_load_balanced=True: DualChunkSwap chunks)"
            else:
                why = f"cp_size = {unit}"
            raise ValueError(f"`qkv` sequence length ({name}) must be a multiple of {why} {where}, got {total}")


def descriptor_in_global_order(descriptor, cp: ContextParallel):
    """A THD call's SequenceDescriptor with its segment ids and positions put back in token order.

    Load-balanced THD inputs arrive in the Striped order (``reorder_causal_load_balancing(x,
    ReorderStrategy.Striped, cp, 1, stripe_size)`` applied to q, k, v, segment ids and positions
    alike); the segments are runs of the original order. Lengths and offsets
    (``from_seqlens_and_offsets``) hold no token order: they describe the original sequence."""
    if not cp.load_balanced or descriptor.segment_ids is None:
        return descriptor
    s = descriptor.segment_ids[0].shape[-1]
    if s % (cp.size * cp.stripe):
        raise ValueError(f"`segment_ids` length must be a multiple of cp_size * stripe_size = {cp.size * cp.stripe} "
                         f"(Striped order, mesh axis {cp.axis!r}), got {s}")

    def back(pair):
        if pair is None:
            return None
        return tuple(None if x is None else inverse_reorder_causal_load_balancing(
            x, ReorderStrategy.Striped, cp.size, 1, cp.stripe) for x in pair)

    return dataclasses.replace(descriptor, segment_ids=back(descriptor.segment_ids),
                               segment_pos=back(descriptor.segment_pos))


# ================================================================================================
# Collectives: gather along the sequence, in global token order
# ================================================================================================


def _gather(x, cp: ContextParallel, seq_axis: int, thd: bool = False):
    """The full sequence of ``x`` (local chunks along ``seq_axis``) on every rank, in global order."""
    if cp.strategy == CPStrategy.RING:
        # The common plan's ring: cp - 1 steps, each passing the last block on to the next rank.
        r = jax.lax.axis_index(cp.axis)
        blocks, y = [x], x
        perm = [(i, cp_plan.ring_next(cp.size, i)) for i in range(cp.size)]
        for _ in range(cp.size - 1):
            y = jax.lax.ppermute(y, cp.axis, perm)
            blocks.append(y)
        stacked = jnp.stack(blocks)  # [cp, ...]: step t
        ranked = jnp.take(stacked, cp_plan.ring_step(cp.size, r, jnp.arange(cp.size)), axis=0)  # rank order
        ranked = jnp.moveaxis(ranked, 0, seq_axis)
        shape = list(x.shape)
        shape[seq_axis] *= cp.size
        full = ranked.reshape(shape)
    else:
        full = jax.lax.all_gather(x, cp.axis, axis=seq_axis, tiled=True)
    reorder = cp.reorder(thd)
    if reorder is not None:
        full = inverse_reorder_causal_load_balancing(full, reorder, cp.size, seq_axis, cp.reorder_stripe(thd))
    return full


def _own_rows(x, cp: ContextParallel, seq_axis: int, thd: bool):
    """This rank's rows of a global-order ``x``: the inverse of :func:`_gather`."""
    reorder = cp.reorder(thd)
    if reorder is not None:
        x = reorder_causal_load_balancing(x, reorder, cp.size, seq_axis, cp.reorder_stripe(thd))
    n = x.shape[seq_axis] // cp.size
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(cp.axis) * n, n, axis=seq_axis)


# ================================================================================================
# The per-rank computation
# ================================================================================================


@dataclass(frozen=True)
class _Plan:
    """Static description of one rank's work (the rank index itself is traced)."""

    static: FusedAttnStatic
    cp: ContextParallel
    causal: bool
    align: int = 1  # tile_alignment of the call (1: the CPU lowering, which has no tiles)
    # return_max_logit: the mesh axes whose ranks hold other rows of the call (the context-parallel axis,
    # and the batch's axes in the shard_map this module runs); each head's max logit is a pmax over them.
    max_axes: Tuple[str, ...] = ()

    def rank_plan(self, rank: int, seqlen: int) -> cp_plan.RankPlan:
        """The common plan rank ``rank`` carries out for a sequence of ``seqlen`` tokens (BSHD/SBHD), in the
        input's order (Striped: its rounds of stripes)."""
        return cp_plan.rank_plan(self.cp.comm_type, self.cp.size, rank, seqlen, self.causal, self.cp.balance,
                                 self.align, window=self.window, rounds=self.cp.rounds(seqlen))

    @property
    def window(self) -> int:
        """The plan's causal sliding window (left; -1: none)."""
        return int(self.static.window_size[0]) if self.causal else -1

    def lead_rows(self, local_len: int) -> int:
        """The most rows any rank's masked call carries before its chunk (the plan's ``ChunkCall.lead``,
        the chunk start's distance from the tile boundary before it): the static length of the zero rows
        in front of each masked call's buffer (0: the calls take the chunks as they are). Unmasked calls
        need none: every row sees the same keys, so a row's blocks do not depend on its neighbours."""
        seqlen = local_len * self.cp.size
        return max((c.lead for rank in range(self.cp.size) for c in self.rank_plan(rank, seqlen).calls
                    if c.mask != _common.AttnMaskType.NO_MASK), default=0)

    def launches(self, local_len: int, rank, pass_: cp_plan.Pass):
        """The ``pass_`` launches of the common plan (unmasked calls of a pass merged: every row sees every key)
        for local sequences of ``local_len`` rows: (rank 0's calls of the launch, the traced rank's call as
        :class:`_At`). The ranks' launches differ only in where their chunks sit in the sequence."""
        plans = [self.rank_plan(r, local_len * self.cp.size) for r in range(self.cp.size)]
        for groups in zip(*(p.launches(merge_unmasked=True) for p in plans)):
            assert len({tuple((c.pass_, c.mask, c.chunk.local_start, c.chunk.end - c.chunk.start) for c in g)
                        for g in groups}) == 1, groups
            if groups[0][0].pass_ != pass_:
                continue
            yield groups[0], _At.of([g[0] for g in groups], rank)


class _At(NamedTuple):
    """One launch's positions on the traced rank, read from its plan call (int32 scalars): the chunk's
    ``start``, the call's first row ``row`` (``ChunkCall.rows[0]``) and the other operand's ``span``."""

    start: jax.Array
    row: jax.Array
    span: Tuple[jax.Array, jax.Array]

    @classmethod
    def of(cls, calls, rank) -> "_At":
        pick = lambda f: jnp.asarray([f(c) for c in calls], jnp.int32)[rank]  # noqa: E731
        return cls(pick(lambda c: c.chunk.start), pick(lambda c: c.rows[0]),
                   (pick(lambda c: c.span[0]), pick(lambda c: c.span[1])))

    @property
    def lead(self):
        """Rows of the call before its chunk (``ChunkCall.lead``)."""
        return self.start - self.row


def _launch_static(static: FusedAttnStatic, call: cp_plan.ChunkCall, offset: bool = False,
                   grads: Optional[BackwardGrads] = None) -> FusedAttnStatic:
    """``static`` for one plan call: the call's mask (in padded form when masked: the call's span is a
    sequence of the gathered operand), and the THD format when ``offset`` (the call's sequences start at an
    offset of their buffers); ``grads``: the one gradient pass the call runs."""
    fields = dict(attn_mask_type=call.mask, window_size=call.window)
    if call.mask != _common.AttnMaskType.NO_MASK:
        fields.update(attn_mask_type=call.padded_mask(), bottom_right_diagonal=None)
    if offset:
        fields["qkv_format"] = _common.QKVFormat.THD
    if grads is not None:
        fields["backward_grads"] = grads
    return dataclasses.replace(static, **fields)


def make_plan(static: FusedAttnStatic, cp: ContextParallel, align: int = 1) -> _Plan:
    """The per-rank plan of a call (what :func:`rank_forward` and :func:`rank_backward` take); ``align``:
    :func:`tile_alignment` of the call."""
    causal = _common.AttnMaskType(static.attn_mask_type).is_causal()  # refuses a member of another enum
    return _Plan(static=static, cp=cp, causal=causal, align=int(align))


def tile_alignment(plan: _Plan, q, k, v, capability: Optional[Tuple[int, int]] = None) -> int:
    """The largest tile of the fused kernels' plans for the calls of ``plan`` (canonical BSHD ``q``, ``k``,
    ``v``) on an NVIDIA GPU of ``capability`` (None: the GPU JAX runs on; 1 on the CPU, whose lowering has
    no tiles)."""
    from transformer_engine.jax.primitives import gpu

    if capability is None:
        if jax.devices()[0].platform not in ("gpu", "cuda"):
            return 1
        capability = gpu._compute_capability()
    calls = plan.rank_plan(0, plan.cp.unit).calls  # the shortest sequence: the same masks as any length
    statics = {_launch_static(plan.static, c, _offset(c, 0)) for c in calls}
    shapes = dict(q=q.shape, k=k.shape, v=v.shape)
    return cp_plan.tile_alignment(
        gpu.launch_call(st, shapes, q.dtype, q.shape[0], None, capability).plan_key for st in statics)


def _column(b, value):
    return jnp.broadcast_to(jnp.asarray(value, jnp.int32), (b, 1))


def _chunk_seq(b, c, keys, s_kv) -> SeqInfo:
    """A chunk of ``c`` queries against keys ``[0, keys)`` of a length-``s_kv`` key axis."""
    return SeqInfo(_column(b, c), _column(b, keys), jnp.concatenate([_column(b, 0), _column(b, c)], 1),
                   jnp.concatenate([_column(b, 0), _column(b, s_kv)], 1))


def _seq(b, q_len, kv_len, q_start, kv_start) -> SeqInfo:
    """One sequence per row: ``q_len`` queries from buffer row ``q_start``, ``kv_len`` keys from ``kv_start``."""
    return SeqInfo(_column(b, q_len), _column(b, kv_len),
                   jnp.concatenate([_column(b, q_start), _column(b, q_start + q_len)], 1),
                   jnp.concatenate([_column(b, kv_start), _column(b, kv_start + kv_len)], 1))


def _lead(x, rows: int):
    """``x`` ([b, s, h, d]) after ``rows`` zero rows."""
    if not rows:
        return x
    return jnp.concatenate([jnp.zeros((x.shape[0], rows) + x.shape[2:], x.dtype), x], axis=1)


def _placeholders(q):
    b, _, h, _ = q.shape
    return jnp.zeros((0,), q.dtype), jnp.zeros((b, h, 2), jnp.uint32)


def _launch_rows(calls) -> Tuple[int, int]:
    """(first local row, rows) of a launch's chunks (adjacent in the rank's rows)."""
    return calls[0].chunk.local_start, sum(c.chunk.end - c.chunk.start for c in calls)


def _offset(call: cp_plan.ChunkCall, pad: int) -> bool:
    """Whether ``call``'s sequences start at an offset of their buffers: a masked dK/dV call's queries (from
    its span's start in the gathered rows), or a masked call's rows after ``pad`` zero rows."""
    return call.mask != _common.AttnMaskType.NO_MASK and (call.pass_ == cp_plan.Pass.DKDV or pad > 0)


def rank_forward(plan: _Plan, rank, q, k_all, v_all):
    """One rank's forward from gathered operands: (local output, local log-sum-exp ``[b, 1, h, n_local]``
    in local row order), and with ``return_max_logit`` the local rows' max logits (laid out as the
    log-sum-exp). ``q``: the rank's rows; ``k_all``, ``v_all``: every key and value in global order;
    ``rank``: its index on the context-parallel axis (int or traced). Each launch is one of the common
    plan's (:meth:`_Plan.launches`): its mask, rows and key span are the plan call's."""
    b, n_local = q.shape[:2]
    bias, seeds = _placeholders(q)
    s_kv = k_all.shape[1]
    pad = plan.lead_rows(n_local)
    parts = []  # per launch, in row order: (out, lse[, row_max])
    for calls, at in plan.launches(n_local, rank, cp_plan.Pass.FORWARD):
        lo, c = _launch_rows(calls)
        static = _launch_static(plan.static, calls[0], _offset(calls[0], pad))
        if calls[0].mask == _common.AttnMaskType.NO_MASK:  # the rank's rows against every key
            parts.append(fused_attn_fwd(q[:, lo:lo + c], k_all, v_all, bias, full_seq_info(b, c, s_kv), seeds,
                                        static))
        elif not pad:  # keys of the span [0, end): causal bottom-right
            parts.append(fused_attn_fwd(q[:, lo:lo + c], k_all, v_all, bias, _chunk_seq(b, c, at.span[1], s_kv),
                                        seeds, static))
        else:  # the call's rows from the tile boundary before the chunk (zero rows in front, dropped)
            part = fused_attn_fwd(_lead(q[:, lo:lo + c], pad), k_all, v_all, bias,
                                  _seq(b, c + at.lead, at.span[1], pad - at.lead, 0), seeds, static)
            parts.append((part[0][:, pad:],) + tuple(jax.lax.dynamic_slice_in_dim(x, at.lead, c, axis=3)
                                                     for x in part[1:]))
    if len(parts) == 1:
        return parts[0]
    return (jnp.concatenate([p[0] for p in parts], axis=1),) + tuple(
        jnp.concatenate([p[i] for p in parts], axis=3) for i in range(1, len(parts[0])))


def _global_max_logit(row_max, dtype, axes: Tuple[str, ...]):
    """Each head's max logit from this rank's row maxima, over the ranks of ``axes`` too (a max:
    order-free, so every rank gets the bits of the single-device call)."""
    local = max_logit(row_max, jnp.float32)
    return (jax.lax.pmax(local, axes) if axes else local).astype(dtype)


def rank_backward(plan: _Plan, rank, local, gathered):
    """One rank's (dq, dk, dv) of its own rows from gathered operands. ``local``: the rank's
    ``(q, k, v, out, lse, dout)``; ``gathered``: ``(q, k, v, out, lse, dout)`` of the whole sequence
    in global order (lse ``[b, 1, h, s]``). Each launch is one of the common plan's, running only its pass,
    its mask, rows and span (queries of dK/dV, keys of dQ) the plan call's."""
    q, k, v, out, lse, dout = local
    q_all, k_all, v_all, out_all, lse_all, dout_all = gathered
    b, n_local = q.shape[:2]
    bias, seeds = _placeholders(q)
    s_q, s_kv = q_all.shape[1], k_all.shape[1]
    bias_k, seeds_k = _placeholders(q_all)
    pad = plan.lead_rows(n_local)
    # The log-sum-exp of the queries [a, s) as one sequence starting at a: positions from a (+inf past s - a).
    lse_padded = jnp.concatenate([lse_all, jnp.full(lse_all.shape, jnp.inf, lse_all.dtype)], axis=3)
    dks, dvs = [], []
    for calls, at in plan.launches(n_local, rank, cp_plan.Pass.DKDV):  # the own keys' dK/dV
        lo, c = _launch_rows(calls)
        static = _launch_static(plan.static, calls[0], _offset(calls[0], pad), BackwardGrads.DKDV)
        if calls[0].mask == _common.AttnMaskType.NO_MASK:  # every query; the own operand's rows (s_kv may differ)
            _, dk, dv, _, _ = fused_attn_bwd(q_all, k, v, bias_k, out_all, dout_all, lse_all,
                                             full_seq_info(b, s_q, k.shape[1]), seeds_k, static)
        else:  # the call's keys (from the tile boundary: ``pad`` rows in front, dropped) against the span's
            # queries [span start, s) as one sequence, causal top-left
            span_len = at.span[1] - at.span[0]
            _, dk, dv, _, _ = fused_attn_bwd(q_all, _lead(k[:, lo:lo + c], pad), _lead(v[:, lo:lo + c], pad), bias_k,
                                             out_all, dout_all,
                                             jax.lax.dynamic_slice_in_dim(lse_padded, at.span[0], s_q, axis=3),
                                             _seq(b, span_len, c + at.lead, at.span[0], pad - at.lead), seeds_k,
                                             static)
            dk, dv = dk[:, pad:], dv[:, pad:]
        dks.append(dk)
        dvs.append(dv)
    dqs = []
    for calls, at in plan.launches(n_local, rank, cp_plan.Pass.DQ):  # the own queries' dQ
        lo, c = _launch_rows(calls)
        static = _launch_static(plan.static, calls[0], _offset(calls[0], pad), BackwardGrads.DQ)
        if calls[0].mask == _common.AttnMaskType.NO_MASK:
            dq = fused_attn_bwd(q[:, lo:lo + c], k_all, v_all, bias, out[:, lo:lo + c], dout[:, lo:lo + c],
                                lse[..., lo:lo + c], full_seq_info(b, c, s_kv), seeds, static)[0]
        elif not pad:  # keys of the span [0, end), causal bottom-right
            dq = fused_attn_bwd(q[:, lo:lo + c], k_all, v_all, bias, out[:, lo:lo + c], dout[:, lo:lo + c],
                                lse[..., lo:lo + c], _chunk_seq(b, c, at.span[1], s_kv), seeds, static)[0]
        else:
            chunk_lse = jax.lax.dynamic_slice_in_dim(lse_padded, at.row, pad + c, axis=3)
            dq = fused_attn_bwd(_lead(q[:, lo:lo + c], pad), k_all, v_all, bias, _lead(out[:, lo:lo + c], pad),
                                _lead(dout[:, lo:lo + c], pad), chunk_lse,
                                _seq(b, c + at.lead, at.span[1], pad - at.lead, 0), seeds, static)[0][:, pad:]
        dqs.append(dq)
    cat = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)  # noqa: E731
    return cat(dqs), cat(dks), cat(dvs)


def _forward(plan: _Plan, q, k, v):
    """(out, lse) of this rank's rows, and with ``return_max_logit`` (out, lse, max_logit)."""
    rank = jax.lax.axis_index(plan.cp.axis)
    results = rank_forward(plan, rank, q, _gather(k, plan.cp, 1), _gather(v, plan.cp, 1))
    if plan.static.return_max_logit:
        out, lse, row_max = results
        return out, lse, _global_max_logit(row_max, q.dtype, plan.max_axes)
    return results


def _primal(static: FusedAttnStatic, results):
    """What the attention returns: the output, and with ``return_max_logit`` ``(out, max_logit)``."""
    return (results[0], results[2]) if static.return_max_logit else results[0]


def _backward(plan: _Plan, q, k, v, out, lse, dout):
    rank = jax.lax.axis_index(plan.cp.axis)
    gathered = tuple(_gather(x, plan.cp, 3 if i == 4 else 1) for i, x in enumerate((q, k, v, out, lse, dout)))
    return rank_backward(plan, rank, (q, k, v, out, lse, dout), gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cp_attention(plan: _Plan, q, k, v):
    return _primal(plan.static, _forward(plan, q, k, v))


def _cp_attention_fwd(plan, q, k, v):
    results = _forward(plan, q, k, v)
    out, lse = results[:2]
    return _primal(plan.static, results), (q, k, v, out, lse)


def _cp_attention_bwd(plan, residuals, dout):
    if plan.static.return_max_logit:
        dout = dout[0]  # the max logit has no gradient
    q, k, v, out, lse = residuals
    return _backward(plan, q, k, v, out, lse, dout)


_cp_attention.defvjp(_cp_attention_fwd, _cp_attention_bwd)


# ================================================================================================
# THD (packed rows): the common plan over the row, one pseudo-sequence per segment and call
# ================================================================================================
#
# The plan chunks the packed row (length s) as it chunks one sequence, in the order the common
# ``packed_balance`` gives for the input's: contiguous; Striped input with at most two stripes per rank in
# its own STRIPED order; with more stripes in the dual-chunk order (the causal work balanced over the
# ranks when segments are long).
# Each of the plan's calls runs over the gathered rows as pseudo-sequences, one per segment: the
# segment's tokens inside the call's chunk, from the tile boundary before them (counted from the
# segment's start, so that the kernels' blocks are the single call's), against the segment's keys
# the global mask lets them see (forward and dQ: causal bottom-right against the keys up to the
# chunk's end; dK/dV: the chunk's keys against the queries from the same boundary on, causal top-left;
# no mask: the whole segment). Every real token is kept from exactly one call, so each rank computes
# about 1 / cp of the rows. A rank's kept rows are the plan's chunks: its own rows when the plan runs the
# input's order, else they reach the ranks that hold them by an all-gather of the chunks. A causal sliding
# window is each row's own (both causal forms put the diagonal on the row's position), so the calls run
# it as given; a window on a non-causal mask runs the single-device call on the gathered rows on every
# rank instead (the cp = 1 cost).


def _thd_splits(static: FusedAttnStatic) -> bool:
    """Whether a THD call runs split by the plan: the padding masks, causal ones with any window (a causal
    window is each row's own: the plan's calls carry it), others without one."""
    mask = _common.AttnMaskType(static.attn_mask_type)
    return mask.is_padding() and (mask.is_causal() or tuple(static.window_size) == (-1, -1))


def thd_balance(cp: ContextParallel, s: int) -> Tuple[cp_plan.LoadBalance, int]:
    """The plan's ``(balance, rounds)`` for packed rows of ``s`` tokens in this call's input order
    (:func:`~transformer_engine.common.attention.context_parallel.packed_balance`)."""
    return cp_plan.packed_balance(cp.size, s, cp.load_balanced, cp.stripe)


def thd_rank_plans(plan: _Plan, s: int) -> Tuple[cp_plan.RankPlan, ...]:
    """Every rank's plan for packed rows of ``s`` tokens (tiles are counted per segment, so the plan's own
    alignment is 1)."""
    balance, rounds = thd_balance(plan.cp, s)
    return tuple(cp_plan.rank_plan(plan.cp.comm_type, plan.cp.size, r, s, plan.causal, balance,
                                   window=plan.window, rounds=rounds) for r in range(plan.cp.size))


def _steps(plans: Tuple[cp_plan.RankPlan, ...], rank):
    """The plans' calls step by step: (the calls of every rank, the traced rank's call as :class:`_At`). The
    ranks' calls differ only in their chunk."""
    for calls in zip(*(p.calls for p in plans)):
        assert len({(c.pass_, c.mask, c.chunk.end - c.chunk.start) for c in calls}) == 1, calls
        yield calls, _At.of(calls, rank)


def _pseudo_seq(seq: SeqInfo, call: cp_plan.ChunkCall, at: _At, align: int) -> SeqInfo:
    """The pseudo-sequences of ``call`` (the traced rank's positions ``at``) over the gathered rows, one per
    segment: its own-side tokens in the call's chunk from the tile boundary before them (tiles counted from
    the segment's start), and the call's span inside the segment, from that boundary on for dK/dV (whose
    queries and keys start together, top-left)."""
    a = at.start
    b = a + (call.chunk.end - call.chunk.start)
    dkdv = call.pass_ == cp_plan.Pass.DKDV
    own_off, own_len = (seq.kv_offsets, seq.kv_seqlens) if dkdv else (seq.q_offsets, seq.q_seqlens)
    oth_off, oth_len = (seq.q_offsets, seq.q_seqlens) if dkdv else (seq.kv_offsets, seq.kv_seqlens)
    m = own_len.shape[1]
    start, length = own_off[:, :m], own_len
    pa = jnp.clip(a - start, 0, length)
    pe = jnp.clip(b - start, 0, length)
    lo = pa - pa % align
    has = pe > pa
    zero = jnp.zeros_like(length)
    own = (start + lo, jnp.where(has, pe - lo, zero))
    oth_start = oth_off[:, :m]
    sa = jnp.clip(at.span[0] - oth_start, 0, oth_len)
    se = jnp.clip(at.span[1] - oth_start, 0, oth_len)
    if dkdv:
        sa = jnp.minimum(sa, lo)
    other = (oth_start + sa, jnp.where(has, se - sa, zero))
    (q_off, q_len), (kv_off, kv_len) = (other, own) if dkdv else (own, other)
    end = lambda off: jnp.concatenate([off, off[:, -1:]], axis=1)  # noqa: E731  (only starts are read)
    return SeqInfo(q_len, kv_len, end(q_off), end(kv_off))


def _call_static(static: FusedAttnStatic, call: cp_plan.ChunkCall, grads=None) -> FusedAttnStatic:
    fields = dict(attn_mask_type=call.padded_mask(), bottom_right_diagonal=None, window_size=call.window)
    if grads is not None:
        fields["backward_grads"] = grads
    return dataclasses.replace(static, **fields)


def _slab(x, a, length: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, a, length, axis=axis)


def thd_rank_forward(plan: _Plan, plans, rank, q_all, k_all, v_all, seq: SeqInfo):
    """One rank's THD forward over gathered rows: its kept chunks of the output ``[b, c_local, h, d]`` and
    per-token log-sum-exp ``[b, h, c_local]`` (the plan's chunks in local order), and with
    ``return_max_logit`` the max logit of its calls ``[h]`` (fp32)."""
    bias, seeds = _placeholders(q_all)
    outs, lses, maxes = [], [], []
    for calls, at in _steps(plans, rank):
        call, a = calls[0], at.start
        if call.pass_ != cp_plan.Pass.FORWARD:
            continue
        c = call.chunk.end - call.chunk.start
        pseudo = _pseudo_seq(seq, call, at, plan.align)
        results = fused_attn_fwd(q_all, k_all, v_all, bias, pseudo, seeds, _call_static(plan.static, call))
        outs.append(_slab(results[0], a, c, 1))
        lses.append(_slab(lse_to_tokens(results[1], pseudo), a, c, 2))
        if plan.static.return_max_logit:
            maxes.append(max_logit(results[2], jnp.float32))
    cat = lambda xs, axis: jnp.concatenate(xs, axis=axis)  # noqa: E731
    return (cat(outs, 1), cat(lses, 2)) + ((functools.reduce(jnp.maximum, maxes),) if maxes else ())


def thd_rank_backward(plan: _Plan, plans, rank, gathered, seq: SeqInfo):
    """One rank's THD (dq, dk, dv) of its kept chunks (local order) from the gathered ``(q, k, v, out,
    per-token lse [b, h, s], dout)``, each call running one gradient pass."""
    q_all, k_all, v_all, out_all, lse_all, dout_all = gathered
    bias, seeds = _placeholders(q_all)
    dq, dk, dv = [], [], []
    for calls, at in _steps(plans, rank):
        call, a = calls[0], at.start
        if call.pass_ == cp_plan.Pass.FORWARD:
            continue
        c = call.chunk.end - call.chunk.start
        pseudo = _pseudo_seq(seq, call, at, plan.align)
        grads = BackwardGrads.DKDV if call.pass_ == cp_plan.Pass.DKDV else BackwardGrads.DQ
        results = fused_attn_bwd(q_all, k_all, v_all, bias, out_all, dout_all, lse_to_segments(lse_all, pseudo),
                                 pseudo, seeds, _call_static(plan.static, call, grads))
        if grads == BackwardGrads.DQ:
            dq.append(_slab(results[0], a, c, 1))
        else:
            dk.append(_slab(results[1], a, c, 1))
            dv.append(_slab(results[2], a, c, 1))
    return tuple(jnp.concatenate(x, axis=1) for x in (dq, dk, dv))


def _kept_to_owners(x, plan: _Plan, axis: int):
    """A rank's kept chunks (the plan's, local order) -> the rows it holds in the input's order: the same rows
    when the plan runs the input's order (contiguous, or its stripes), else an all-gather and a permutation."""
    balance, _ = thd_balance(plan.cp, x.shape[axis] * plan.cp.size)
    if balance == cp_plan.LoadBalance.STRIPED or (balance == cp_plan.LoadBalance.CONTIGUOUS
                                                  and not plan.cp.load_balanced):
        return x  # the plan's chunks are the rank's own rows
    full = jax.lax.all_gather(x, plan.cp.axis, axis=axis, tiled=True)
    full = jnp.moveaxis(_permute_chunks(jnp.moveaxis(full, axis, 1), 1, cp_plan.chunk_order(plan.cp.size, balance),
                                        inverse=True), 1, axis)
    return _own_rows(full, plan.cp, axis, True)


def _thd_split_forward(plan: _Plan, max_axes, q, k, v, seq):
    q_all, k_all, v_all = (_gather(x, plan.cp, 1, thd=True) for x in (q, k, v))
    s = q_all.shape[1]
    plans = thd_rank_plans(plan, s)
    results = thd_rank_forward(plan, plans, jax.lax.axis_index(plan.cp.axis), q_all, k_all, v_all, seq)
    own = (_kept_to_owners(results[0], plan, 1), _kept_to_owners(results[1], plan, 2))
    if plan.static.return_max_logit:
        return own + ((jax.lax.pmax(results[2], max_axes) if max_axes else results[2]).astype(q.dtype),)
    return own


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _thd_split_attention(plan, max_axes, q, k, v, seq):
    return _primal(plan.static, _thd_split_forward(plan, max_axes, q, k, v, seq))


def _thd_split_attention_fwd(plan, max_axes, q, k, v, seq):
    results = _thd_split_forward(plan, max_axes, q, k, v, seq)
    return _primal(plan.static, results), (q, k, v, results[0], results[1], seq)


def _thd_split_attention_bwd(plan, max_axes, residuals, dout):
    if plan.static.return_max_logit:
        dout = dout[0]  # the max logit has no gradient
    q, k, v, out, lse, seq = residuals
    gathered = tuple(_gather(x, plan.cp, 2 if i == 4 else 1, thd=True) for i, x in enumerate((q, k, v, out, lse, dout)))
    s = gathered[0].shape[1]
    grads = thd_rank_backward(plan, thd_rank_plans(plan, s), jax.lax.axis_index(plan.cp.axis), gathered, seq)
    return tuple(_kept_to_owners(g, plan, 1) for g in grads) + (None,)


_thd_split_attention.defvjp(_thd_split_attention_fwd, _thd_split_attention_bwd)


# Windows on non-causal masks: every rank runs the single-device kernels on the gathered rows, keeping its own.

def _thd_forward(cp: ContextParallel, static: FusedAttnStatic, max_axes: Tuple[str, ...], q, k, v, seq: SeqInfo):
    q_all, k_all, v_all = (_gather(x, cp, 1, thd=True) for x in (q, k, v))
    bias, seeds = _placeholders(q_all)
    results = fused_attn_fwd(q_all, k_all, v_all, bias, seq, seeds, static)
    own = (_own_rows(results[0], cp, 1, True), _own_rows(results[1], cp, 3, True))
    if static.return_max_logit:  # every rank has every row's: the pmax makes it the axes' common value
        return own + (_global_max_logit(results[2], q.dtype, max_axes),)
    return own


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _thd_cp_attention(cp, static, max_axes, q, k, v, seq):
    return _primal(static, _thd_forward(cp, static, max_axes, q, k, v, seq))


def _thd_cp_attention_fwd(cp, static, max_axes, q, k, v, seq):
    results = _thd_forward(cp, static, max_axes, q, k, v, seq)
    out, lse = results[:2]
    return _primal(static, results), (q, k, v, out, lse, seq)


def _thd_cp_attention_bwd(cp, static, max_axes, residuals, dout):
    if static.return_max_logit:
        dout = dout[0]  # the max logit has no gradient
    q, k, v, out, lse, seq = residuals
    q_all, k_all, v_all, out_all, dout_all = (_gather(x, cp, 1, thd=True) for x in (q, k, v, out, dout))
    lse_all = _gather(lse, cp, 3, thd=True)
    bias, seeds = _placeholders(q_all)
    dq, dk, dv, _, _ = fused_attn_bwd(q_all, k_all, v_all, bias, out_all, dout_all, lse_all, seq, seeds, static)
    return tuple(_own_rows(x, cp, 1, True) for x in (dq, dk, dv)) + (None,)


_thd_cp_attention.defvjp(_thd_cp_attention_fwd, _thd_cp_attention_bwd)


# ================================================================================================
# The unfused backend under context parallelism (what the CPU selects): whole rows on every rank
# ================================================================================================
#
# The unfused backend's fixed reduction structure sums every query or key from position 0 of its
# sequence, so a row subset would change its trees: each rank gathers the rows and runs the backend's
# own call on them, keeping its rows, in the forward and (recomputing) in the backward. Each result is
# then the single call's, whatever the cp size, at the single call's cost on every rank.


def _whole_seq(seq: Optional[SeqInfo], q, cp: ContextParallel, thd: bool) -> SeqInfo:
    """The gathered rows' segments: ``seq`` (THD, global order) or one segment of the whole sequence."""
    if thd:
        return seq
    n = q.shape[1] * cp.size
    return full_seq_info(q.shape[0], n, n)


def _replicated_forward(attend, cp, thd, max_axes, q, k, v, seq):
    q_all, k_all, v_all = (_gather(x, cp, 1, thd) for x in (q, k, v))
    seq = _whole_seq(seq, q, cp, thd)
    result = attend(q_all, k_all, v_all, seq)
    if isinstance(result, tuple):  # return_max_logit: the max over the batch shards too
        out, ml = result
        return _own_rows(out, cp, 1, thd), (jax.lax.pmax(ml, max_axes[1:]) if max_axes[1:] else ml)
    return _own_rows(result, cp, 1, thd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _replicated(attend, cp, thd, max_axes, q, k, v, seq):
    return _replicated_forward(attend, cp, thd, max_axes, q, k, v, seq)


def _replicated_fwd(attend, cp, thd, max_axes, q, k, v, seq):
    return _replicated_forward(attend, cp, thd, max_axes, q, k, v, seq), (q, k, v, seq)


def _replicated_bwd(attend, cp, thd, max_axes, residuals, dout):
    q, k, v, seq = residuals
    if isinstance(dout, tuple):
        dout = dout[0]  # the max logit has no gradient
    q_all, k_all, v_all, dout_all = (_gather(x, cp, 1, thd) for x in (q, k, v, dout))
    whole = _whole_seq(seq, q, cp, thd)

    def out_of(q_, k_, v_):
        result = attend(q_, k_, v_, whole)
        return result[0] if isinstance(result, tuple) else result

    _, pullback = jax.vjp(out_of, q_all, k_all, v_all)
    return tuple(_own_rows(g, cp, 1, thd) for g in pullback(dout_all)) + (None,)


_replicated.defvjp(_replicated_fwd, _replicated_bwd)


def replicated_attention(attend, q, k, v, static: FusedAttnStatic, cp: ContextParallel,
                         seq: Optional[SeqInfo] = None):
    """Context parallelism of a backend that runs whole sequences (the unfused one): ``attend(q, k, v,
    seq)`` on every rank's gathered rows (global order), each rank keeping its own rows of the output and
    of the gradients. The arguments and results are :func:`context_parallel_attention`'s."""
    thd = static.qkv_format == _common.QKVFormat.THD
    seq = None if seq is None or not thd else SeqInfo(*(x.astype(jnp.int32) for x in seq))
    if cp.axis in _manual_axes():
        if thd:
            raise NotImplementedError("THD context parallelism runs from jit with the mesh set")
        return _replicated(attend, cp, False, (cp.axis,), q, k, v, None)
    mesh, spec, batch, out_specs = _shard_specs(q, k, static, cp)
    max_axes = (cp.axis,) + _axes_tuple(batch)
    fn = functools.partial(_replicated, attend, cp, thd, max_axes)
    if thd:
        seq_spec = SeqInfo(*(PartitionSpec(batch, None) for _ in seq))
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, seq_spec), out_specs=out_specs)(q, k, v, seq)
    return jax.shard_map(lambda q_, k_, v_: fn(q_, k_, v_, None), mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=out_specs)(q, k, v)


# ================================================================================================
# Entry point
# ================================================================================================


def _divisible_axes(axes: Tuple[str, ...], mesh, *sizes: int):
    """``axes`` (those in ``mesh``) when their product divides every size, else None (replicated)."""
    axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes:
        return None
    n = int(np.prod([mesh.shape[a] for a in axes]))
    if any(size % n for size in sizes):
        return None
    return axes if len(axes) > 1 else axes[0]


def context_parallel_attention(q, k, v, static: FusedAttnStatic, cp: ContextParallel, seq: Optional[SeqInfo] = None):
    """Attention of canonical BSHD ``q``, ``k``, ``v`` with the sequence split over ``cp.axis``
    (global arrays under ``jit``, or the local chunks inside a ``shard_map`` where the axis is manual).
    ``seq``: the segments of a THD call, in global token order (see :func:`descriptor_in_global_order`).
    With ``static.return_max_logit`` returns ``(out, max_logit)``: each head's max over the whole
    sequence (and, from ``jit``, the whole batch; inside a ``shard_map`` the local batch's)."""
    thd = static.qkv_format == _common.QKVFormat.THD
    plan = make_plan(static, cp)
    manual = cp.axis in _manual_axes()
    plan = make_plan(static, cp, tile_alignment(plan, q, k, v))
    if manual:
        return _cp_attention(dataclasses.replace(plan, max_axes=(cp.axis,)), q, k, v)
    mesh, spec, batch, out_specs = _shard_specs(q, k, static, cp)
    max_axes = (cp.axis,) + _axes_tuple(batch)
    if thd:
        seq_spec = SeqInfo(*(PartitionSpec(batch, None) for _ in seq))
        if _thd_splits(static):
            fn = functools.partial(_thd_split_attention, plan, max_axes)
        else:
            fn = functools.partial(_thd_cp_attention, cp, static, max_axes)
        run = jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec, seq_spec), out_specs=out_specs)
        return run(q, k, v, SeqInfo(*(x.astype(jnp.int32) for x in seq)))
    run = jax.shard_map(functools.partial(_cp_attention, dataclasses.replace(plan, max_axes=max_axes)), mesh=mesh,
                        in_specs=(spec, spec, spec), out_specs=out_specs)
    return run(q, k, v)


def _shard_specs(q, k, static: FusedAttnStatic, cp: ContextParallel):
    """(mesh, operand spec, batch axes, result specs) of the shard_map a call from ``jit`` runs in:
    sequence over the cp axis, batch over dp/fsdp and heads over tp where they divide."""
    mesh = next(m for m in _current_meshes() if cp.axis in m.axis_names)
    resource = global_mesh_resource()
    batch = _divisible_axes(batch_axes(resource), mesh, q.shape[0])
    heads = _divisible_axes(head_axes(resource), mesh, q.shape[2], k.shape[2])
    spec = PartitionSpec(batch, cp.axis, heads, None)
    out_specs = (spec, PartitionSpec(heads)) if static.return_max_logit else spec
    return mesh, spec, batch, out_specs


def _axes_tuple(axes) -> Tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)
