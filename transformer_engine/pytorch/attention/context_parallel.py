"""Context parallelism (CP) for DotProductAttention, invariant to the CP size by construction.

Each rank holds its part of the sequence in TransformerEngine's load-balanced split (docs:
context_parallelism.rst): the sequence in ``2 * cp`` chunks, rank ``r`` holding chunks ``r`` and
``2 * cp - 1 - r`` concatenated; for thd every sequence is split so (its padded length from
``cu_seqlens_*_padded``). With ``cp_stripe_size`` (ours) the ranks hold TransformerEngine-JAX's Striped
order instead: stripes of that many tokens dealt round-robin (thd: over the packed row), each stripe a
chunk of the plan (:class:`SeqSplit` carries the order). Every reduction of attention then runs on one
rank, in the single-device kernel's order:

- ``"a2a"``: an all-to-all gives each rank ``h / cp`` heads of the whole sequences (in global order),
  the unchanged single-device attention runs on them, an all-to-all gives the rows back. Heads are
  independent, so each head's result is the single-device one.
- ``"all_gather"`` and ``"p2p"`` (ring send/receive assembling the same operands): each rank keeps its
  own rows. Forward: for each own query chunk ``[a, b)`` the fused forward over keys ``[0, b)``, causal
  aligned bottom-right (all keys without a causal mask). Backward (:class:`_RowsAttention`, so autograd
  never sums partial dK/dV across ranks): dQ of the own chunk against keys ``[0, b)`` (a dQ-only fused
  backward); dK/dV of the own key chunk ``[a, b)`` against the gathered query rows ``[a, s)`` (all rows
  without a causal mask), causal aligned top-left, which is the global mask (a dK/dV-only one). Each
  runs one gradient pass of the whole backward's launches, unchanged: about the single-device backward
  divided by cp, plus the cheap preprocess (padded formats: once per rank, in its first call). Query (key)
  ranges start at the chunk start rounded down to the largest tile of the call's plans
  (:func:`tile_alignment`), so the kernels' blocks are the single-device call's blocks; rows before the
  chunk are zeros (forward) or the gathered rows (backward) and are dropped. The calls run the fused op's
  launches directly (``kernel_runner.forward`` / ``kernel_runner.backward``), so that a chunk's outputs and
  gradients land in views of the rank's tensors without concatenation.
- ``"a2a+p2p"``: ``cp_group = [a2a_group, p2p_group]``; the a2a over the first gives each rank
  ``h / cp_a2a`` heads of the tokens of its a2a group, which form the p2p group's load-balanced split;
  then "p2p" over the second. The rank's place in the split is ``p2p_rank * a2a_size + a2a_rank``.

The chunking, the load-balanced order, the per-rank blocks and what CP supports are the framework-free
plan of :mod:`transformer_engine.common.attention.context_parallel`, which JAX carries out too
(:func:`rank_plan` is this module's). The per-rank steps (:func:`fused_forward_step`,
:func:`fused_backward_step`) take the gathered operands as tensors and need no process group:
``run_ranks_in_one_process`` (tests/te_torch_testing.py) runs every rank's step on one
device with the exchanges as tensor copies (tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from transformer_engine.common.attention import (AttnBiasType, AttnMaskType, AttnSoftmaxType, BackwardGrads, QKVFormat,
                                                 UnfusedDotProductAttention)
from transformer_engine.common.attention import context_parallel as cp_plan
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.buffers import host_values, unfilled
from transformer_engine.pytorch.attention.call import AttnCall

__all__ = [
    "CP_COMM_TYPES", "ContextParallelGroup", "SeqSplit", "check_context_parallel_args", "tile_alignment",
    "FusedSpec", "fused_forward_step", "fused_backward_step", "assemble", "local_tokens", "context_parallel_attend",
    "rank_plan", "unsupported_reasons",
]

CP_COMM_TYPES = cp_plan.CP_COMM_TYPES
# The default load-balanced order of every format (TransformerEngine's): chunks r and 2 cp - 1 - r of each
# sequence on rank r. ``cp_stripe_size`` selects the Striped order instead (:class:`SeqSplit` carries it).
DUAL_CHUNK = cp_plan.LoadBalance.DUAL_CHUNK


def _to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host-built tensor (indices, lengths) on ``device`` without stalling the host: a copy from pageable
    memory waits for the device's stream, which would drain the queue of kernels at every CP call."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


# -- settings ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextParallelGroup:
    """What ``set_context_parallel_group`` was given, validated. ``groups`` is ``(group,)`` or, for
    ``"a2a+p2p"``, ``(a2a_group, p2p_group)``."""

    comm_type: str
    groups: Tuple[object, ...]
    global_ranks: Optional[Tuple[int, ...]] = None
    stream: Optional[object] = None
    stripe_size: Optional[int] = None  # None: the dual-chunk order; an int: the Striped order of such stripes

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(dist.get_world_size(g) for g in self.groups)

    @property
    def size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def check_context_parallel_args(cp_group, cp_global_ranks, cp_stream, cp_comm_type,
                                cp_stripe_size: Optional[int] = None) -> Optional[ContextParallelGroup]:
    """The validated settings, or None when context parallelism is off (no group)."""
    if cp_comm_type not in CP_COMM_TYPES:
        choices = ", ".join(repr(c) for c in CP_COMM_TYPES)
        raise ValueError(f"`cp_comm_type` must be one of {choices}, got {cp_comm_type!r}")
    if cp_stripe_size is not None and (isinstance(cp_stripe_size, bool) or not isinstance(cp_stripe_size, int)
                                       or cp_stripe_size < 1):
        raise ValueError(f"`cp_stripe_size` must be None (the dual-chunk order) or a positive int (the Striped "
                         f"order), got {cp_stripe_size!r}")
    if cp_group is None:
        if cp_global_ranks is not None:
            raise ValueError(f"`cp_group` must be given with `cp_global_ranks`, got None (cp_global_ranks="
                             f"{cp_global_ranks!r})")
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("`cp_group` must be a group of an initialized torch.distributed process group, got "
                         f"{cp_group!r} without torch.distributed.init_process_group")
    if cp_comm_type == "a2a+p2p":
        if not isinstance(cp_group, (list, tuple)) or len(cp_group) != 2:
            raise ValueError("`cp_group` must be a list of two process groups [a2a_group, p2p_group] with "
                             f"cp_comm_type='a2a+p2p', got {cp_group!r}")
        groups = tuple(cp_group)
    else:
        if isinstance(cp_group, (list, tuple)):
            raise ValueError(f"`cp_group` must be one process group with cp_comm_type={cp_comm_type!r} (a list of "
                             f"two is for 'a2a+p2p'), got a {type(cp_group).__name__} of {len(cp_group)}")
        groups = (cp_group,)
    ranks = None
    if cp_global_ranks is not None:
        ranks = tuple(int(r) for r in cp_global_ranks)
    return ContextParallelGroup(cp_comm_type, groups, ranks, cp_stream, cp_stripe_size)


# -- the load-balanced split ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SeqSplit:
    """Where one rank's tokens sit in the global sequences: ``cp`` ranks, each holding the chunks
    ``rank_chunks(cp, rank, balance, rounds)`` of every sequence (the dual-chunk order: chunks ``rank`` and
    ``2 * cp - 1 - rank``; STRIPED: stripe ``rank`` of each of ``rounds`` rounds of ``cp`` stripes). Padded
    formats: one length ``seqlen`` for the batch; thd: per-sequence global ``starts`` and ``padded`` lengths
    (``cu_seqlens_*_padded``) and real ``lengths`` (``cu_seqlens_*``), host ints."""

    fmt: QKVFormat
    cp: int
    rank: int
    seqlen: int = 0
    starts: Tuple[int, ...] = ()
    padded: Tuple[int, ...] = ()
    lengths: Tuple[int, ...] = ()
    balance: cp_plan.LoadBalance = DUAL_CHUNK
    rounds: int = 1

    @property
    def is_thd(self) -> bool:
        return self.fmt == QKVFormat.THD

    @property
    def packed(self) -> bool:
        """thd in the Striped order: the stripes (and the plan) run over the packed row of every sequence,
        as JAX's THD load balancing; the dual-chunk order splits each sequence."""
        return self.is_thd and self.balance == cp_plan.LoadBalance.STRIPED

    def with_rank(self, rank: int) -> "SeqSplit":
        return dataclasses.replace(self, rank=rank)

    @property
    def slots(self) -> Tuple[int, ...]:
        """The rank's chunk indices, in local order."""
        return cp_plan.rank_chunks(self.cp, self.rank, self.balance, self.rounds)

    @property
    def total(self) -> int:
        """Tokens of the global sequence dim (padded formats: s; thd: the padded packed total)."""
        return self.seqlen if not self.is_thd else sum(self.padded)

    @property
    def local_total(self) -> int:
        return self.total // self.cp

    def chunk_len(self, n: int = 0) -> int:
        return self.seq_len(n) // cp_plan.num_chunks(self.cp, self.balance, self.rounds)

    def seq_len(self, n: int = 0) -> int:
        """The length the plan splits: the (padded) length of sequence ``n``; the packed row's (``packed``)."""
        if self.packed:
            return self.total
        return self.padded[n] if self.is_thd else self.seqlen

    def token_index(self) -> torch.Tensor:
        """int64 [local tokens]: the global position (token dim) of each of this rank's tokens."""
        if not self.is_thd or self.packed:
            length = self.chunk_len()
            return torch.cat([torch.arange(c * length, (c + 1) * length) for c in self.slots])
        parts = []
        for n, start in enumerate(self.starts):
            length = self.chunk_len(n)
            for c in self.slots:
                parts.append(torch.arange(start + c * length, start + (c + 1) * length))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def local_starts(self) -> List[int]:
        """thd: where each sequence's first own chunk starts in the rank's tokens."""
        out, at = [], 0
        for n in range(len(self.starts)):
            out.append(at)
            at += len(self.slots) * self.chunk_len(n)
        return out


def global_permutation(split: SeqSplit) -> torch.Tensor:
    """int64 [total]: position, in the concatenation of every rank's tokens (rank order), of each global
    token."""
    index = torch.cat([split.with_rank(r).token_index() for r in range(split.cp)])
    return torch.argsort(index)


def assemble(parts: Sequence[torch.Tensor], dim: int, split: SeqSplit) -> torch.Tensor:
    """Every rank's tokens (``parts`` in rank order, token dim ``dim``) in global order. Padded formats move
    whole chunks (no index tensor); thd selects tokens through :func:`global_permutation`."""
    if split.cp == 1:  # one rank holds every chunk in order
        return parts[0]
    if not split.is_thd:
        length = split.chunk_len()
        return torch.cat([parts[r].narrow(dim, slot * length, length)
                          for r, slot in cp_plan.chunk_places(split.cp, split.balance, split.rounds)], dim=dim)
    perm = _to_device(global_permutation(split), parts[0].device)
    return torch.cat(list(parts), dim=dim).index_select(dim, perm)


def local_tokens(x_g: torch.Tensor, dim: int, split: SeqSplit) -> torch.Tensor:
    """The rank's own tokens (local order) of a tensor in global order, token dim ``dim``."""
    if split.cp == 1:
        return x_g
    if not split.is_thd:
        length = split.chunk_len()
        return torch.cat([x_g.narrow(dim, c * length, length) for c in split.slots], dim=dim)
    return x_g.index_select(dim, _to_device(split.token_index(), x_g.device))


# -- tiles ---------------------------------------------------------------------------------------------

def tile_alignment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: QKVFormat, causal: bool,
                   deterministic: bool) -> int:
    """The largest block (rows or columns) of any kernel the fused forward and backward plan for these
    tensors: chunk ranges starting at multiples of it meet the single-device call's blocks."""
    masks = (AttnMaskType.CAUSAL_MASK, AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK) if causal else (AttnMaskType.NO_MASK,)
    return cp_plan.tile_alignment(kernel_runner.plan_key(q, k, v, _chunk_call(fmt, 1.0, mask)) for mask in masks)


# -- the per-rank steps of "all_gather" / "p2p" (fused kernels) -------------------------------------------

@dataclass(frozen=True)
class FusedSpec:
    """What the fused steps need besides tensors: softmax scale, causal or not, deterministic backward,
    and the tile alignment of chunk ranges (:func:`tile_alignment`)."""

    softmax_scale: float
    causal: bool
    deterministic: bool
    align: int


def _seq_dim(fmt: QKVFormat) -> int:
    return 1 if fmt == QKVFormat.BSHD else 0


def _chunk_call(fmt: QKVFormat, softmax_scale: float, mask: AttnMaskType, cu_q=None, cu_k=None, off_q=None,
                off_k=None, max_q: Optional[int] = None, max_k: Optional[int] = None) -> AttnCall:
    """The AttnCall of one chunk's fused call: no window, the mask's own diagonal, thd's longest sequences
    ``max_q``/``max_k``."""
    thd = fmt == QKVFormat.THD
    params = AttnParams(attn_mask_type=mask, attn_bias_type=AttnBiasType.NO_BIAS, qkv_format=fmt,
                        window_size=normalize_window(None, mask), scaling_factor=softmax_scale,
                        bottom_right_diagonal=resolve_bottom_right_diagonal(mask, None, "pytorch"),
                        max_seqlen_q=max_q if thd else None, max_seqlen_kv=max_k if thd else None)
    return AttnCall(params=params, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, cu_seqlens_q_padded=off_q,
                    cu_seqlens_kv_padded=off_k)


def _fwd(q, k, v, fmt, spec, mask, cu_q=None, cu_k=None, off_q=None, off_k=None, max_q=None, max_k=None,
         out=None, lse=None):
    """The fused forward (the custom op's launches, run directly: ``out``/``lse`` may be views to fill)."""
    sd = _seq_dim(fmt)
    call = _chunk_call(fmt, spec.softmax_scale, mask, cu_q, cu_k, off_q, off_k,
                       max_q if max_q is not None else q.shape[sd], max_k if max_k is not None else k.shape[sd])
    return kernel_runner.forward(q, k, v, call, out=out, lse=lse)


def _bwd(grads: BackwardGrads, q, k, v, out, d_out, lse, fmt, spec, mask, cu_q=None, cu_k=None, off_q=None,
         off_k=None, max_q=None, max_k=None, dq=None, dk=None, dv=None, delta=None, preprocess=True):
    """The fused backward's ``grads`` part: dq (``DQ``) or (dk, dv) (``DKDV``), bitwise the whole backward's.
    ``dq``/``dk``/``dv`` may be views to fill; ``delta`` (lse's shape and strides) the rows' rowsum(dO * O),
    computed by this call unless ``preprocess`` is False (then an earlier call filled it)."""
    sd = _seq_dim(fmt)
    call = _chunk_call(fmt, spec.softmax_scale, mask, cu_q, cu_k, off_q, off_k,
                       max_q if max_q is not None else q.shape[sd], max_k if max_k is not None else k.shape[sd])
    if delta is None:
        lse = lse.contiguous()
    dq, dk, dv, _, _ = kernel_runner.backward(q, k, v, out, d_out, lse, call, grads=grads, dq=dq, dk=dk, dv=dv,
                                              delta=delta, preprocess=preprocess)
    return dq if grads == BackwardGrads.DQ else (dk, dv)


def _zeros_before(x: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    if count == 0:
        return x
    shape = list(x.shape)
    shape[dim] = count
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def rank_plan(split: SeqSplit, spec: FusedSpec, comm_type: str = "p2p", n: int = 0,
              heads: Tuple[int, int] = (0, 1)) -> cp_plan.RankPlan:
    """The common plan this module runs for ``split``'s rank (thd: of sequence ``n``); "a2a+p2p": ``split``
    is the p2p group's and ``heads`` the rank's (a2a rank, a2a size)."""
    # packed: the calls' rows are cut per sequence and aligned from its start (_packed_segments), not here.
    return cp_plan.rank_plan(comm_type, split.cp, split.rank, split.seq_len(n), spec.causal, split.balance,
                             1 if split.packed else spec.align, heads, rounds=split.rounds)


def fused_forward_step(q: torch.Tensor, k_glob: torch.Tensor, v_glob: torch.Tensor, split: SeqSplit,
                       spec: FusedSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """One rank's forward: (out of its tokens, lse of its tokens) from its queries ``q`` and the global
    keys/values. lse is [b, h, local s] (padded formats) or [h, local t] (thd), fp32."""
    if split.is_thd:
        return (_packed_forward if split.packed else _thd_forward)(q, k_glob, v_glob, split, spec)
    fmt, sd = split.fmt, _seq_dim(split.fmt)
    length = split.chunk_len()
    # Each forward call of the plan writes its chunk's rows of out and lse (a copy where rows lead the chunk).
    out = unfilled(tuple(q.shape[:-1]) + (v_glob.shape[-1],), q.dtype, q.device)
    lse = unfilled((q.shape[1 - sd], q.shape[-2], split.local_total), torch.float32, q.device)
    for call in rank_plan(split, spec).calls:
        if call.pass_ != cp_plan.Pass.FORWARD:
            continue
        at, lead = call.chunk.local_start, call.lead
        out_c, lse_c = out.narrow(sd, at, length), lse.narrow(2, at, length)
        q_c = _zeros_before(q.narrow(sd, at, length), sd, lead)
        k_c, v_c = (t.narrow(sd, call.span[0], call.span[1] - call.span[0]) for t in (k_glob, v_glob))
        if not lead:
            _fwd(q_c, k_c, v_c, fmt, spec, call.mask, out=out_c, lse=lse_c)
        else:
            o, l_ = _fwd(q_c, k_c, v_c, fmt, spec, call.mask)
            out_c.copy_(o.narrow(sd, lead, length))
            lse_c.copy_(l_[:, :, lead:])
    return out, lse


def fused_backward_step(q_g, k_g, v_g, out_g, d_out_g, lse_g, split: SeqSplit,
                        spec: FusedSpec) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's backward from the global (gathered, global order) q, k, v, out, d_out and lse:
    (dq, dk, dv) of its own tokens."""
    d_out_g = d_out_g.contiguous()  # an expanded dO has stride 0: no TMA
    if split.is_thd:
        return (_packed_backward if split.packed else _thd_backward)(q_g, k_g, v_g, out_g, d_out_g, lse_g, split,
                                                                      spec)
    fmt, sd = split.fmt, _seq_dim(split.fmt)
    length = split.chunk_len()
    local = lambda t: t.new_empty(tuple(t.shape[:sd]) + (split.local_total,) + tuple(t.shape[sd + 1:]))  # noqa: E731
    dq, dk, dv = local(q_g), local(k_g), local(v_g)
    # rowsum(dO * O) once per rank, in the plan's preprocessing call (its query span holds every row a later
    # call of the rank reads); the other calls skip the preprocess.
    lse_g = lse_g.contiguous()
    delta = unfilled(lse_g.shape, lse_g.dtype, lse_g.device)  # the rows a call reads are written first
    for call in rank_plan(split, spec).calls:
        if call.pass_ == cp_plan.Pass.FORWARD:
            continue
        at, lead, (lo, hi), (r0, r1) = call.chunk.local_start, call.lead, call.rows, call.span
        if call.pass_ == cp_plan.Pass.DKDV:  # the chunk's keys [lo, hi) against query rows [r0, r1)
            keys = [t.narrow(sd, lo, hi - lo) for t in (k_g, v_g)]
            rows = [t.narrow(sd, r0, r1 - r0) for t in (q_g, out_g, d_out_g)]
            targets = dict(dk=dk.narrow(sd, at, length), dv=dv.narrow(sd, at, length)) if not lead else {}
            g_k, g_v = _bwd(BackwardGrads.DKDV, rows[0], keys[0], keys[1], rows[1], rows[2], lse_g.narrow(2, r0, r1 - r0),
                            fmt, spec, call.mask, delta=delta.narrow(2, r0, r1 - r0), preprocess=call.preprocess,
                            **targets)
            if lead:
                dk.narrow(sd, at, length).copy_(g_k.narrow(sd, lead, length))
                dv.narrow(sd, at, length).copy_(g_v.narrow(sd, lead, length))
            continue
        # dQ: the chunk's query rows [lo, hi) against keys [r0, r1)
        rows = [t.narrow(sd, lo, hi - lo) for t in (q_g, out_g, d_out_g)]
        keys = [t.narrow(sd, r0, r1 - r0) for t in (k_g, v_g)]
        g_q = _bwd(BackwardGrads.DQ, rows[0], keys[0], keys[1], rows[1], rows[2], lse_g.narrow(2, lo, hi - lo), fmt,
                   spec, call.mask, delta=delta.narrow(2, lo, hi - lo), preprocess=call.preprocess,
                   dq=dq.narrow(sd, at, length) if not lead else None)
        if lead:
            dq.narrow(sd, at, length).copy_(g_q.narrow(sd, lead, length))
    return dq, dk, dv


# thd: one call per chunk slot, one pseudo-sequence per sequence (ranges through seq_offsets).

def _i32(values, device) -> torch.Tensor:
    return _to_device(torch.tensor(list(values), dtype=torch.int32), device)


def _cu(lengths, device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return _i32(out, device)


def _offsets(starts, device) -> torch.Tensor:
    return _i32(list(starts) + [0], device)  # the kernels read entries [0, n)


def _thd_launches(split: SeqSplit, spec: FusedSpec, *passes: cp_plan.Pass):
    """The rank's launches of ``passes``, in the plan's order: call ``i`` of every sequence's plan in one launch,
    a pseudo-sequence per sequence (the plans differ only in their sequence's length)."""
    plans = [rank_plan(split, spec, n=n) for n in range(len(split.starts))]
    for calls in zip(*(p.calls for p in plans)):
        assert len({(c.pass_, c.mask, c.chunk.chunk) for c in calls}) == 1, calls
        if calls[0].pass_ in passes:
            yield calls


def _thd_pseudo(call: cp_plan.ChunkCall, real: int) -> Tuple[int, int]:
    """(own rows, other operand's rows) of ``call``'s pseudo-sequence in a sequence of ``real`` real tokens: the
    call's rows and span cut at the padding. A chunk of padding only computes no rows; its dK/dV call then
    reads no query rows either."""
    end = min(call.rows[1], real)
    has = end > call.chunk.start
    other = min(call.span[1], real) - call.span[0]
    return (end - call.rows[0] if has else 0), (other if has or call.pass_ != cp_plan.Pass.DKDV else 0)


def _lse_for_call(lse_g: torch.Tensor, row_starts: List[int], lens: List[int], max_len: int) -> torch.Tensor:
    """[n, h, max_len] lse of pseudo-sequences whose rows start at global tokens ``row_starts`` (from the
    global [h, T] lse; rows past a pseudo-sequence read +inf)."""
    h, total = lse_g.shape
    ext = torch.cat([lse_g, lse_g.new_full((h, 1), float("inf"))], dim=1)
    pos = torch.arange(max_len)
    idx = torch.stack([torch.where(pos < ln, st + pos, torch.full_like(pos, total)) for st, ln in zip(row_starts, lens)]
                      ) if row_starts else torch.zeros(0, max_len, dtype=torch.int64)
    return ext[:, _to_device(idx, lse_g.device)].permute(1, 0, 2).contiguous()


def _thd_forward(q, k_g, v_g, split: SeqSplit, spec: FusedSpec):
    device, t_local = q.device, q.shape[0]
    local_starts = split.local_starts()
    out_parts, lse_parts, out_rows, lse_cols, real = [], [], [], [], []
    row_base = col_base = 0
    q_ext = torch.cat([q, q.new_zeros((1,) + tuple(q.shape[1:]))], dim=0)  # row t_local: the zero row
    for calls in _thd_launches(split, spec, cp_plan.Pass.FORWARD):
        # The queries of each sequence's call, from its aligned start (zero rows before the chunk), in one buffer.
        index, buf_starts, len_q, len_k, at = [], [], [], [], 0
        for n, call in enumerate(calls):
            first = local_starts[n] + call.chunk.local_start
            index.append(torch.full((call.lead,), t_local, dtype=torch.int64))
            index.append(torch.arange(first, first + call.chunk.end - call.chunk.start))
            buf_starts.append(at)
            own, other = _thd_pseudo(call, split.lengths[n])
            len_q.append(own)
            len_k.append(other)
            at += call.length
        q_buf = q_ext.index_select(0, _to_device(torch.cat(index), device))
        max_q, max_k = max(max(len_q), 1), max(max(len_k), 1)
        out, lse = _fwd(q_buf, k_g, v_g, QKVFormat.THD, spec, calls[0].padded_mask(), _cu(len_q, device),
                        _cu(len_k, device), _offsets(buf_starts, device),
                        _offsets([st + c.span[0] for st, c in zip(split.starts, calls)], device), max_q, max_k)
        out_parts.append(out)
        lse_parts.append(lse.permute(1, 0, 2).reshape(lse.shape[1], -1))
        for n, call in enumerate(calls):
            a, lead, length = call.chunk.start, call.lead, call.chunk.end - call.chunk.start
            pos = torch.arange(length)
            dst = local_starts[n] + call.chunk.local_start + pos
            out_rows.append((row_base + buf_starts[n] + lead + pos, dst))
            col = torch.where(a + pos < split.lengths[n], col_base + n * max_q + lead + pos, torch.zeros_like(pos))
            lse_cols.append((col, dst))
            real.append((a + pos < split.lengths[n], dst))
        row_base += q_buf.shape[0]
        col_base += len(split.starts) * max_q
    rows = torch.empty(t_local, dtype=torch.int64)
    cols = torch.empty(t_local, dtype=torch.int64)
    keep = torch.zeros(t_local, dtype=torch.bool)
    for src, dst in out_rows:
        rows[dst] = src
    for src, dst in lse_cols:
        cols[dst] = src
    for ok, dst in real:
        keep[dst] = ok
    out = torch.cat(out_parts, dim=0).index_select(0, _to_device(rows, device))
    lse = torch.cat(lse_parts, dim=1).index_select(1, _to_device(cols, device))
    lse = torch.where(_to_device(keep, device)[None, :], lse, torch.full_like(lse, float("inf")))
    return out, lse


def _thd_backward(q_g, k_g, v_g, out_g, d_out_g, lse_g, split: SeqSplit, spec: FusedSpec):
    """The rank's (dq, dk, dv) from the plan's backward calls, each launch over the global rows: a dQ launch
    fills the rows of its query chunks, a dK/dV launch those of its key chunks; the rank's rows are picked."""
    device = q_g.device
    total = q_g.shape[0]
    starts = list(split.starts)
    parts = {cp_plan.Pass.DQ: [], cp_plan.Pass.DKDV: []}  # per launch: (grads, the rows it keeps in local order)
    for calls in _thd_launches(split, spec, cp_plan.Pass.DKDV, cp_plan.Pass.DQ):
        pass_ = calls[0].pass_
        own = [st + c.rows[0] for st, c in zip(starts, calls)]
        other = [st + c.span[0] for st, c in zip(starts, calls)]
        lens = [_thd_pseudo(c, n) for c, n in zip(calls, split.lengths)]
        len_own, len_other = [x for x, _ in lens], [y for _, y in lens]
        max_own, max_other = max(max(len_own), 1), max(max(len_other), 1)
        q_side = (own, len_own, max_own) if pass_ == cp_plan.Pass.DQ else (other, len_other, max_other)
        k_side = (other, len_other, max_other) if pass_ == cp_plan.Pass.DQ else (own, len_own, max_own)
        grads = _bwd(BackwardGrads.DQ if pass_ == cp_plan.Pass.DQ else BackwardGrads.DKDV, q_g, k_g, v_g, out_g,
                     d_out_g, _lse_for_call(lse_g, *q_side), QKVFormat.THD, spec, calls[0].padded_mask(),
                     _cu(q_side[1], device), _cu(k_side[1], device), _offsets(q_side[0], device),
                     _offsets(k_side[0], device), q_side[2], k_side[2])
        rows = [(n, c.chunk.local_start, st + c.chunk.start + torch.arange(c.chunk.end - c.chunk.start))
                for n, (st, c) in enumerate(zip(starts, calls))]
        parts[pass_].append((grads, rows))

    def kept(pass_: cp_plan.Pass, i: int) -> torch.Tensor:
        """The rank's rows (local order: per sequence, its chunks in order) of the pass's gradient ``i``."""
        grads = [g if pass_ == cp_plan.Pass.DQ else g[i] for g, _ in parts[pass_]]
        index = sorted((n, at, j * total + r) for j, (_, rows) in enumerate(parts[pass_]) for n, at, r in rows)
        return torch.cat(grads, dim=0).index_select(0, _to_device(torch.cat([r for _, _, r in index]), device))

    return kept(cp_plan.Pass.DQ, 0), kept(cp_plan.Pass.DKDV, 0), kept(cp_plan.Pass.DKDV, 1)


# thd in the Striped order: the plan runs over the packed row (its chunks are the stripes), as JAX's packed-row
# plan. Each call of the plan is one pseudo-sequence per sequence the call's chunk's real rows meet: those rows
# from the tile boundary before them (tiles counted from the sequence's start, so that the kernels' blocks are
# the single call's), against the call's span cut to the sequence (from that boundary on for dK/dV, whose
# queries and keys start together, top-left). The calls of a pass are one launch (a rank holds many stripes):
# the own-side rows of each pseudo-sequence are copied to a buffer of their own, since one call's lead rows
# are another call's kept rows and the kernels write every row they compute. Padding rows are kept by no call:
# their outputs and gradients are zero.

@dataclass(frozen=True)
class _Segment:
    """One pseudo-sequence of a packed call, in sequence coordinates (the sequence starts at global ``start``):
    own rows ``[lo, pe)`` of which ``[pa, pe)`` are kept and sit at ``local`` in the rank's tokens, the other
    operand's rows ``[sa, se)``."""

    start: int
    lo: int
    pa: int
    pe: int
    sa: int
    se: int
    local: int

    @property
    def own(self) -> int:
        return self.pe - self.lo

    @property
    def lead(self) -> int:
        return self.pa - self.lo


def _packed_segments(split: SeqSplit, spec: FusedSpec, call: cp_plan.ChunkCall) -> List[_Segment]:
    clip = lambda x, n: min(max(x, 0), n)  # noqa: E731
    out = []
    for start, real in zip(split.starts, split.lengths):
        pa, pe = clip(call.chunk.start - start, real), clip(call.chunk.end - start, real)
        if pe <= pa:
            continue
        lo = pa - pa % spec.align
        sa, se = clip(call.span[0] - start, real), clip(call.span[1] - start, real)
        if call.pass_ == cp_plan.Pass.DKDV:
            sa = min(sa, lo)
        out.append(_Segment(start, lo, pa, pe, sa, se, call.chunk.local_start + start + pa - call.chunk.start))
    return out


def _packed_launch(split: SeqSplit, spec: FusedSpec, pass_: cp_plan.Pass):
    """The pass's launch: (mask, the pseudo-sequences of its calls in the plan's order, where each one's own rows
    start in the launch's own-side buffer), or None when no call has a real row."""
    calls = [c for c in rank_plan(split, spec).calls if c.pass_ == pass_]
    assert len({c.mask for c in calls}) <= 1, calls
    segments = [g for c in calls for g in _packed_segments(split, spec, c)]
    if not segments:
        return None
    starts = [0]
    for g in segments[:-1]:
        starts.append(starts[-1] + g.own)
    return calls[0].padded_mask(), segments, starts


def _packed_keep(segments: List[_Segment], starts: List[int], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows of the own-side buffer, rows of the rank's tokens) of the kept rows."""
    src = torch.cat([torch.arange(b + g.lead, b + g.own) for b, g in zip(starts, segments)])
    dst = torch.cat([torch.arange(g.local, g.local + g.pe - g.pa) for g in segments])
    return _to_device(src, device), _to_device(dst, device)


def _packed_forward(q, k_g, v_g, split: SeqSplit, spec: FusedSpec):
    device, t_local = q.device, q.shape[0]
    out = q.new_zeros(tuple(q.shape[:-1]) + (v_g.shape[-1],))
    lse = torch.full((q.shape[1], t_local), float("inf"), dtype=torch.float32, device=device)
    launch = _packed_launch(split, spec, cp_plan.Pass.FORWARD)
    if launch is None:
        return out, lse
    mask, segments, starts = launch
    # The queries of each pseudo-sequence (zero rows before the kept ones: rows do not interact).
    q_ext = torch.cat([q, q.new_zeros((1,) + tuple(q.shape[1:]))], dim=0)  # row t_local: the zero row
    index = torch.cat([torch.cat([torch.full((g.lead,), t_local, dtype=torch.int64),
                                  torch.arange(g.local, g.local + g.pe - g.pa)]) for g in segments])
    q_buf = q_ext.index_select(0, _to_device(index, device))
    len_q, len_k = [g.own for g in segments], [g.se - g.sa for g in segments]
    max_q = max(len_q)
    o, l_ = _fwd(q_buf, k_g, v_g, QKVFormat.THD, spec, mask, _cu(len_q, device), _cu(len_k, device),
                 _offsets(starts, device), _offsets([g.start + g.sa for g in segments], device), max_q,
                 max(max(len_k), 1))
    rows, dst = _packed_keep(segments, starts, device)
    cols = torch.cat([torch.arange(i * max_q + g.lead, i * max_q + g.own) for i, g in enumerate(segments)])
    out.index_copy_(0, dst, o.index_select(0, rows))
    lse.index_copy_(1, dst, l_.permute(1, 0, 2).reshape(l_.shape[1], -1).index_select(1, _to_device(cols, device)))
    return out, lse


def _packed_backward(q_g, k_g, v_g, out_g, d_out_g, lse_g, split: SeqSplit, spec: FusedSpec):
    """The rank's (dq, dk, dv): a dQ launch and a dK/dV launch over the global rows, the own side (queries with
    their outputs and output gradients; keys and values) copied per pseudo-sequence."""
    device, t_local = q_g.device, split.local_total
    local = lambda t: t.new_zeros((t_local,) + tuple(t.shape[1:]))  # noqa: E731  (padding rows: zero)
    dq, dk, dv = local(q_g), local(k_g), local(v_g)
    for pass_ in (cp_plan.Pass.DKDV, cp_plan.Pass.DQ):
        launch = _packed_launch(split, spec, pass_)
        if launch is None:
            continue
        mask, segments, starts = launch
        index = _to_device(torch.cat([torch.arange(g.start + g.lo, g.start + g.pe) for g in segments]), device)
        own_rows, own_lens = [g.start + g.lo for g in segments], [g.own for g in segments]
        other_rows, other_lens = [g.start + g.sa for g in segments], [g.se - g.sa for g in segments]
        if pass_ == cp_plan.Pass.DQ:  # q side: the buffer (lse read at the rows' global places)
            q_, out_, d_out_ = (t.index_select(0, index) for t in (q_g, out_g, d_out_g))
            k_, v_ = k_g, v_g
            q_rows, q_lens, q_off, k_lens, k_off = own_rows, own_lens, starts, other_lens, other_rows
        else:  # k side: the buffer
            q_, out_, d_out_ = q_g, out_g, d_out_g
            k_, v_ = (t.index_select(0, index) for t in (k_g, v_g))
            q_rows, q_lens, q_off, k_lens, k_off = other_rows, other_lens, other_rows, own_lens, starts
        max_q, max_k = max(max(q_lens), 1), max(max(k_lens), 1)
        grads = _bwd(BackwardGrads.DQ if pass_ == cp_plan.Pass.DQ else BackwardGrads.DKDV, q_, k_, v_, out_, d_out_,
                     _lse_for_call(lse_g, q_rows, q_lens, max_q), QKVFormat.THD, spec, mask, _cu(q_lens, device),
                     _cu(k_lens, device), _offsets(q_off, device), _offsets(k_off, device), max_q, max_k)
        src, dst = _packed_keep(segments, starts, device)
        if pass_ == cp_plan.Pass.DQ:
            dq.index_copy_(0, dst, grads.index_select(0, src))
        else:
            dk.index_copy_(0, dst, grads[0].index_select(0, src))
            dv.index_copy_(0, dst, grads[1].index_select(0, src))
    return dq, dk, dv


# -- exchanges -----------------------------------------------------------------------------------------

def _group_global_ranks(group) -> List[int]:
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def _all_gather(x: torch.Tensor, group, ring: bool) -> List[torch.Tensor]:
    """Every group rank's ``x`` (same shape), in group-rank order: one all_gather, or a ring of
    send/receive steps passing the blocks on (``ring``)."""
    x = x.contiguous()
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if not ring:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return parts
    ranks = _group_global_ranks(group)
    parts: List[Optional[torch.Tensor]] = [None] * size
    parts[me] = x
    send = x
    for step in range(1, size):  # the common plan's ring: pass the last block on to the next rank
        recv = torch.empty_like(x)
        ops_ = [dist.P2POp(dist.isend, send, ranks[cp_plan.ring_next(size, me)], group),
                dist.P2POp(dist.irecv, recv, ranks[cp_plan.ring_prev(size, me)], group)]
        for req in dist.batch_isend_irecv(ops_):
            req.wait()
        parts[cp_plan.ring_source(size, me, step)] = recv
        send = recv
    return parts


def _all_to_all(inputs: List[torch.Tensor], outputs: List[torch.Tensor], group) -> None:
    """outputs[i] <- rank i's inputs[me]."""
    inputs = [t.contiguous() for t in inputs]
    if dist.get_backend(group) != "gloo":
        dist.all_to_all(outputs, inputs, group=group)
        return
    size, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = _group_global_ranks(group)
    outputs[me].copy_(inputs[me])
    ops_ = []
    for i in range(size):
        if i != me:
            ops_.append(dist.P2POp(dist.isend, inputs[i], ranks[i], group))
            ops_.append(dist.P2POp(dist.irecv, outputs[i], ranks[i], group))
    for req in dist.batch_isend_irecv(ops_) if ops_ else []:
        req.wait()


# -- autograd --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rows:
    """One call of the row-keeping CP ("all_gather" / "p2p") on one group."""

    group: object
    ring: bool
    split: SeqSplit
    spec: Optional[FusedSpec]  # None: run ``attend`` on whole sequences (the unfused path)
    attend: Optional[Callable] = None

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return assemble(_all_gather(x, self.group, self.ring), dim, self.split)

    def local(self, x_g: torch.Tensor, dim: int) -> torch.Tensor:
        return local_tokens(x_g, dim, self.split)


class _RowsAttention(torch.autograd.Function):
    """Each rank keeps its rows: the backward returns dq, dk, dv of its own tokens, each computed whole on
    this rank (autograd sums nothing across ranks)."""

    @staticmethod
    def forward(ctx, q, k, v, run: _Rows):
        sd = _seq_dim(run.split.fmt)
        k_g, v_g = run.gather(k, sd), run.gather(v, sd)
        if run.spec is not None:
            out, lse = fused_forward_step(q, k_g, v_g, run.split, run.spec)
        else:  # whole sequences on every rank, own rows kept (module docstring of the unfused path: docs)
            out, lse = run.local(run.attend(run.gather(q, sd), k_g, v_g), sd), q.new_empty(0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run = run
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        run: _Rows = ctx.run
        sd = _seq_dim(run.split.fmt)
        q_g, k_g, v_g, do_g = (run.gather(t, sd) for t in (q, k, v, d_out))
        if run.spec is not None:
            out_g = run.gather(out, sd)
            lse_g = run.gather(lse, 1 if run.split.is_thd else 2)
            dq, dk, dv = fused_backward_step(q_g, k_g, v_g, out_g, do_g, lse_g, run.split, run.spec)
        else:
            leaves = [t.detach().requires_grad_() for t in (q_g, k_g, v_g)]
            with torch.enable_grad():
                out_g = run.attend(*leaves)
                grads = torch.autograd.grad(out_g, leaves, do_g)
            dq, dk, dv = (run.local(g, sd) for g in grads)
        return dq, dk, dv, None


@dataclass(frozen=True)
class _Heads:
    """The a2a exchange over ``group``: a rank's tokens (``src`` split, all heads) <-> ``h / size`` heads
    of the group's tokens in the order ``dst`` gives (global positions)."""

    group: object
    src: SeqSplit  # the split of the whole CP group; ranks of this group are src ranks ``base + i``
    base: int
    stride: int
    dst: torch.Tensor  # global positions of the tokens the head-side tensor holds, in its order

    def member_index(self, i: int) -> torch.Tensor:
        return self.src.with_rank(self.base + i * self.stride).token_index()

    def placement(self) -> torch.Tensor:
        """Positions in the concatenation of the members' tokens of each ``dst`` token."""
        cat = torch.cat([self.member_index(i) for i in range(dist.get_world_size(self.group))])
        where = torch.full((int(cat.max()) + 1,), -1, dtype=torch.int64)
        where[cat] = torch.arange(cat.numel())
        return where[self.dst]


def _to_heads(x: torch.Tensor, h: _Heads) -> torch.Tensor:
    sd = _seq_dim(h.src.fmt)
    size = dist.get_world_size(h.group)
    inputs = list(x.chunk(size, dim=-2))
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    _all_to_all(inputs, outputs, h.group)
    return torch.cat(outputs, dim=sd).index_select(sd, _to_device(h.placement(), x.device))


def _to_seq(y: torch.Tensor, h: _Heads) -> torch.Tensor:
    sd = _seq_dim(h.src.fmt)
    size = dist.get_world_size(h.group)
    place = h.placement()
    inv = torch.empty_like(place)
    inv[place] = torch.arange(place.numel())
    per = place.numel() // size
    inv = _to_device(inv, y.device)
    inputs = [y.index_select(sd, inv[i * per:(i + 1) * per]) for i in range(size)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    _all_to_all(inputs, outputs, h.group)
    return torch.cat(outputs, dim=-2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h: _Heads):
        ctx.h = h
        return _to_heads(x, h)

    @staticmethod
    def backward(ctx, g):
        return _to_seq(g, ctx.h), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, h: _Heads):
        ctx.h = h
        return _to_seq(y, h)

    @staticmethod
    def backward(ctx, g):
        return _to_heads(g, ctx.h), None


# -- the module's entry --------------------------------------------------------------------------------

def _split_of(fmt: QKVFormat, q: torch.Tensor, k: torch.Tensor, cp: int, rank: int, seqs,
              stripe: Optional[int] = None) -> SeqSplit:
    """The rank's split of the call's tokens: the dual-chunk order, or (``stripe``) the Striped order of
    ``stripe``-token stripes (thd: over the packed row)."""
    sd = _seq_dim(fmt)
    striped = dict(balance=cp_plan.LoadBalance.STRIPED) if stripe is not None else {}
    if fmt != QKVFormat.THD:
        s_local = q.shape[sd]
        if stripe is not None:
            if s_local % stripe or k.shape[sd] != s_local:
                raise ValueError(
                    f"`query_layer` must hold whole stripes of cp_stripe_size={stripe} tokens on each rank (the "
                    f"global sequence length divisible by cp_size * cp_stripe_size = {cp * stripe}; keys as long as "
                    f"queries), got local sequence lengths {s_local} (queries) and {k.shape[sd]} (keys)")
            return SeqSplit(fmt, cp, rank, seqlen=s_local * cp, rounds=s_local // stripe, **striped)
        if s_local % 2 or k.shape[sd] != s_local:
            raise ValueError(
                f"`query_layer` must hold two equal chunks of the sequence on each rank (the global sequence "
                f"length divisible by 2 * cp_size = {2 * cp}; keys as long as queries), got local sequence "
                f"lengths {s_local} (queries) and {k.shape[sd]} (keys)")
        return SeqSplit(fmt, cp, rank, seqlen=s_local * cp)
    cu = seqs.cu_seqlens_q
    if seqs.cu_seqlens_kv is not None and seqs.cu_seqlens_kv is not cu and not torch.equal(seqs.cu_seqlens_kv, cu):
        raise NotImplementedError("context parallelism with qkv_format='thd' needs `cu_seqlens_kv` equal to "
                                  "`cu_seqlens_q` (self attention)")
    padded = seqs.cu_seqlens_q_padded if seqs.cu_seqlens_q_padded is not None else cu
    lengths = [int(x) for x in host_values(cu[1:] - cu[:-1])]
    bounds = [int(x) for x in host_values(padded)]
    padded_lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    name = "cu_seqlens_q_padded" if seqs.cu_seqlens_q_padded is not None else "cu_seqlens_q"
    if stripe is None and any(p % (2 * cp) for p in padded_lengths):
        raise ValueError(f"`{name}` must give every sequence a length divisible by 2 * cp_size = {2 * cp} under "
                         f"context parallelism, got lengths {padded_lengths}")
    if stripe is not None and bounds[-1] % (cp * stripe):
        raise ValueError(f"`{name}` must give a packed total divisible by cp_size * cp_stripe_size = {cp * stripe} "
                         f"(the Striped order of the packed row), got {bounds[-1]}")
    if any(n > p for n, p in zip(lengths, padded_lengths)):
        raise ValueError(f"`cu_seqlens_q` must give lengths no longer than `cu_seqlens_q_padded`'s, got {lengths} "
                         f"and {padded_lengths}")
    if bounds[0] != 0 or q.shape[0] * cp != bounds[-1]:
        raise ValueError(f"`query_layer` must hold {bounds[-1]} // cp_size = {bounds[-1] // cp} tokens on each rank "
                         f"(the padded sequences from `{name}` without gaps), got {q.shape[0]}")
    if stripe is not None:
        striped["rounds"] = bounds[-1] // (cp * stripe)
    return SeqSplit(fmt, cp, rank, starts=tuple(bounds[:-1]), padded=tuple(padded_lengths), lengths=tuple(lengths),
                    **striped)


def unsupported_reasons(comm_type: str, fmt: QKVFormat, mask: AttnMaskType, window, bias_type: AttnBiasType,
                        dropout: float, softmax_type: AttnSoftmaxType, return_max_logit: bool = False) -> List[str]:
    """Why this module's context parallelism cannot run a call (the common plan's reasons, PyTorch's
    argument names); ``dropout`` is the call's (0 outside training)."""
    return cp_plan.unsupported_reasons(
        comm_type=comm_type, qkv_format=fmt, mask=mask, bias_type=bias_type, dropout=dropout,
        softmax_type=softmax_type, window=window, return_max_logit=return_max_logit, names=cp_plan.PYTORCH_ARGS)


def context_parallel_attend(cp: ContextParallelGroup, attend: Callable, *, backend: type, q, k, v,
                            fmt: QKVFormat, mask: AttnMaskType, seqs, window, softmax_scale: float,
                            deterministic: bool, num_heads: int, num_kv_heads: int,
                            bias_type: AttnBiasType = AttnBiasType.NO_BIAS, dropout: float = 0.0,
                            softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
                            return_max_logit: bool = False) -> Callable:
    """The module's attention under context parallelism: a function of the local (q, k, v) returning the
    local output (q's format, head dim d_v). ``attend`` is the single-device call on whole sequences (a2a,
    unfused); ``dropout`` is the call's (0 outside training). What CP does not take raises
    NotImplementedError with the common plan's reasons (``cp_plan.unsupported_reasons``)."""
    reasons = unsupported_reasons(cp.comm_type, fmt, mask, window, bias_type, dropout, softmax_type, return_max_logit)
    if reasons:
        raise NotImplementedError("; ".join(reasons))
    causal = mask.is_causal()
    sizes = cp.sizes
    ranks = [dist.get_rank(g) for g in cp.groups]
    if cp.comm_type == "a2a+p2p":
        (size_a, size_p), (rank_a, rank_p) = sizes, ranks
    elif cp.comm_type == "a2a":
        (size_a, size_p), (rank_a, rank_p) = (sizes[0], 1), (ranks[0], 0)
    else:
        (size_a, size_p), (rank_a, rank_p) = (1, sizes[0]), (0, ranks[0])
    total = size_a * size_p
    split = _split_of(fmt, q, k, total, rank_p * size_a + rank_a, seqs, cp.stripe_size)
    if size_a > 1:
        for name, heads in (("num_attention_heads", num_heads), ("num_gqa_groups", num_kv_heads)):
            if heads % size_a:
                raise ValueError(f"`{name}` (per tensor-parallel partition) must be divisible by the a2a "
                                 f"context-parallel size {size_a} with cp_comm_type={cp.comm_type!r}, got {heads}")
    # The selected backend class; FlashAttention rows run the fused kernels (their bits are what CP keeps).
    use_fused = not issubclass(backend, UnfusedDotProductAttention)
    spec = None
    if use_fused:
        spec = FusedSpec(softmax_scale, causal, deterministic, tile_alignment(q, k, v, fmt, causal, deterministic))
    p2p_group = cp.groups[-1]
    # The tokens of an a2a group are the p2p group's split in the same order: dual chunks of 2 * cp chunks, or
    # (Striped) the same rounds of stripes size_a times longer.
    coarse = dataclasses.replace(split, cp=size_p, rank=rank_p)

    def rows_attention(q_, k_, v_):
        if size_p == 1:
            return attend(q_, k_, v_)
        return _RowsAttention.apply(q_, k_, v_, _Rows(p2p_group, cp.comm_type != "all_gather", coarse, spec, attend))

    if size_a == 1:
        return rows_attention
    dst = coarse.token_index() if size_p > 1 else torch.arange(split.total)
    heads = _Heads(cp.groups[0], split, rank_p * size_a, 1, dst)

    def a2a_attention(q_, k_, v_):
        q_h, k_h, v_h = (_SeqToHeads.apply(t, heads) for t in (q_, k_, v_))
        return _HeadsToSeq.apply(rows_attention(q_h, k_h, v_h), heads)

    return a2a_attention
