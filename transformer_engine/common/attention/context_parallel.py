"""The context-parallel (CP) plan both frameworks carry out: chunking, load balance, per-rank work, support.

Framework-free data: PyTorch (``transformer_engine.pytorch.attention.context_parallel``) and JAX
(``transformer_engine.jax.context_parallel``) build these plans and run them with their own collectives
and kernel calls.

- Chunking: a sequence of ``s`` tokens is cut into :func:`num_chunks` equal chunks (``2 * cp`` in the
  dual-chunk order, ``cp`` contiguous). Each kernel call of a chunk ``[start, end)`` starts its rows
  (or key columns) at ``aligned_start``, ``start`` rounded down to the largest kernel tile
  (:func:`tile_alignment`), so its blocks are the single-device call's blocks.
- Load balance (:class:`LoadBalance`): which chunks rank ``r`` holds (:func:`rank_chunks`) and the
  order a sequence's chunks take when every rank's tokens are concatenated (:func:`chunk_order`):
  TransformerEngine's DualChunkSwap and Striped orders.
- Work (:func:`rank_plan`): for each own chunk, in order, the dK/dV pass of the chunk's keys, the dQ
  pass and the forward of its queries, each a list of ``(q_chunk, kv_chunk)`` blocks. Every reduction
  runs on one rank over its operands in global order (gathered by all_gather or a p2p ring), so the
  blocks of a pass are computed exactly once over the ranks. :attr:`RankPlan.calls` turns the work into
  the kernel calls the frameworks launch (:class:`ChunkCall`: rows, span of the other operand, mask,
  where the kept rows land); each result row is final in its call, so no partial results are combined.
- Gathering: the frameworks supply only the collective. A p2p ring's order (:func:`ring_next`,
  :func:`ring_prev`: the peers of a step; :func:`ring_source`, :func:`ring_step`: whose block a step
  brings) and where each gathered chunk goes in global order (:func:`chunk_places`) are written here.
- Support (:func:`unsupported_reasons`): why a configuration cannot run with CP, as reason strings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat

__all__ = [
    "CP_COMM_TYPES", "LoadBalance", "ChunkRange", "Pass", "ChunkCall", "RankPlan", "num_chunks", "rank_chunks",
    "chunk_order", "chunk_places", "ring_next", "ring_prev", "ring_source", "ring_step", "chunk_ranges",
    "tile_alignment", "rank_plan", "packed_balance", "unsupported_reasons", "PYTORCH_ARGS", "JAX_ARGS",
]

# "p2p": a ring of send/receive steps; "all_gather": one collective; "a2a": heads exchanged, whole
# sequences per rank; "a2a+p2p": a2a over one group, then p2p over the other (PyTorch).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class LoadBalance(enum.Enum):
    """Which tokens a rank holds."""

    CONTIGUOUS = "contiguous"  # cp chunks, rank r holds chunk r
    DUAL_CHUNK = "dual_chunk"  # 2 cp chunks, rank r holds chunks r and 2 cp - 1 - r (TE's DualChunkSwap)
    STRIPED = "striped"  # stripes dealt round-robin: rank r holds stripes r, r + cp, ... (TE's Striped, THD)


def num_chunks(cp: int, balance: LoadBalance, rounds: int = 1) -> int:
    """Chunks a sequence is cut into (STRIPED: the stripes of ``rounds`` rounds of ``cp`` stripes)."""
    if balance == LoadBalance.STRIPED:
        return cp * rounds
    return 2 * cp if balance == LoadBalance.DUAL_CHUNK else cp


def rank_chunks(cp: int, rank, balance: LoadBalance, rounds: int = 1) -> tuple:
    """The chunk indices rank ``rank`` holds, in its local order (``rank`` may be a traced int). STRIPED:
    the rank's stripe of each of ``rounds`` rounds of ``cp`` stripes."""
    if balance == LoadBalance.DUAL_CHUNK:
        return (rank, 2 * cp - 1 - rank)
    if balance == LoadBalance.STRIPED:
        return tuple(rank + i * cp for i in range(rounds))
    return (rank,)


def chunk_order(cp: int, balance: LoadBalance, rounds: int = 1) -> Tuple[int, ...]:
    """The chunks of a sequence in the order of every rank's tokens concatenated (rank 0's first): the
    load-balanced order of the inputs (``reorder_causal_load_balancing``); its inverse puts gathered
    tokens back in global order."""
    return tuple(c for r in range(cp) for c in rank_chunks(cp, r, balance, rounds))


def chunk_places(cp: int, balance: LoadBalance, rounds: int = 1) -> Tuple[Tuple[int, int], ...]:
    """For each chunk of a sequence in global order, ``(rank, slot)``: the rank holding it and its place among
    the rank's chunks. Gathered blocks (rank order) go back to global order by taking chunk ``c`` from
    block ``rank`` at slot ``slot`` (the inverse of :func:`chunk_order`)."""
    places = {c: (r, slot) for r in range(cp) for slot, c in enumerate(rank_chunks(cp, r, balance, rounds))}
    return tuple(places[c] for c in range(num_chunks(cp, balance, rounds)))


# The p2p ring that gathers every rank's block (the operands of the row-split comm types): each of the cp - 1
# steps receives from the previous rank and sends the block it received last on to the next, so after step
# t (0: the own block) rank r holds the block of rank (r - t) mod cp. ``rank`` may be a traced int.

def ring_next(cp: int, rank):
    """The rank a ring step sends to."""
    return (rank + 1) % cp


def ring_prev(cp: int, rank):
    """The rank a ring step receives from."""
    return (rank - 1) % cp


def ring_source(cp: int, rank, step):
    """The rank whose block rank ``rank`` holds after ring step ``step``."""
    return (rank - step) % cp


def ring_step(cp: int, rank, source):
    """The ring step after which rank ``rank`` holds the block of rank ``source`` (t -> (rank - t) mod cp is
    its own inverse)."""
    return ring_source(cp, rank, source)


@dataclass(frozen=True)
class ChunkRange:
    """One own chunk of a sequence: global positions ``[start, end)``, the kernel calls' first row (key)
    ``aligned_start`` (start rounded down to the tile) and where the chunk sits in the rank's tokens."""

    chunk: int
    start: int
    end: int
    aligned_start: int
    local_start: int

    @property
    def lead(self) -> int:
        """Rows before the chunk that its calls carry (zeros or gathered rows, dropped)."""
        return self.start - self.aligned_start


def chunk_ranges(seqlen: int, cp: int, rank: int, balance: LoadBalance, align: int = 1,
                 rounds: int = 1) -> Tuple[ChunkRange, ...]:
    """Rank ``rank``'s chunks of a sequence of ``seqlen`` tokens (divisible by :func:`num_chunks`; STRIPED:
    the stripes of ``rounds`` rounds)."""
    n = num_chunks(cp, balance, rounds)
    if seqlen % n:
        raise ValueError(f"`seqlen` must be a multiple of the {n} chunks of cp_size={cp} ({balance.value}), "
                         f"got {seqlen}")
    if align < 1:
        raise ValueError(f"`align` must be a positive int, got {align}")
    length = seqlen // n
    out = []
    for slot, c in enumerate(rank_chunks(cp, rank, balance, rounds)):
        a = c * length
        out.append(ChunkRange(c, a, a + length, a - a % align, slot * length))
    return tuple(out)


def tile_alignment(configs: Iterable) -> int:
    """The largest block (rows or columns) of any kernel the fused forward and backward plan for these
    AttnConfigs or PlanKeys (one per mask a CP call uses): chunk calls starting at multiples of it meet the
    single-device call's blocks."""
    from transformer_engine.common.attention.plan import backward_plan, forward_plan

    align = 1
    for config in configs:
        fwd, bwd = forward_plan(config), backward_plan(config)
        for tiles in (fwd.tiles, fwd.warp_specialized, bwd.dkdv, bwd.dq, bwd.dkdv_warp_specialized,
                      bwd.dq_warp_specialized, bwd.dv, bwd.dv_warp_specialized):  # dv: the separate dV pass
            if tiles is not None:
                align = max(align, tiles.block_m, tiles.block_n)
    return align


class Pass(enum.Enum):
    FORWARD = "forward"
    DQ = "dq"
    DKDV = "dkdv"


# A chunk call's mask in padded (thd) form: the call's sequences are pseudo-sequences of the packed rows.
_PADDED_MASK = {AttnMaskType.NO_MASK: AttnMaskType.PADDING_MASK,
                AttnMaskType.CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_MASK,
                AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK}


@dataclass(frozen=True)
class ChunkCall:
    """One kernel call of a rank: ``pass_`` over the own ``chunk``. ``rows``: the call's own-side positions
    ``[start, end)`` (queries of FORWARD and DQ, keys of DKDV), from the chunk's ``aligned_start`` (the
    rows before ``chunk.start`` are computed and dropped); ``span``: the other operand's positions (keys of
    FORWARD and DQ, queries of DKDV); ``mask`` in the call's own coordinates: NO_MASK, causal
    bottom-right (queries ``[lo, b)`` against keys ``[0, b)``) or causal top-left (queries ``[lo, s)``
    against keys ``[lo, b)``), each the global mask on those rows. The kept rows land at the rank's
    ``chunk.local_start``. ``preprocess``: the call computes ``rowsum(dO * O)`` for the rank's later
    backward calls (its span covers their query rows); a framework may instead compute it per call.
    ``window``: the call's ``window_size`` (left, right) with the diagonal of ``mask``: ``(-1, -1)``
    unmasked, ``(left, 0)`` causal (``left`` -1: unbounded); a row's window is the global one, as both
    causal forms put the diagonal on the row's own position."""

    pass_: Pass
    chunk: ChunkRange
    rows: Tuple[int, int]
    span: Tuple[int, int]
    mask: AttnMaskType
    preprocess: bool = False
    window: Tuple[int, int] = (-1, -1)

    @property
    def lead(self) -> int:
        return self.chunk.start - self.rows[0]

    @property
    def length(self) -> int:
        """Rows of the call (lead included)."""
        return self.rows[1] - self.rows[0]

    def padded_mask(self) -> AttnMaskType:
        """``mask`` for a call of pseudo-sequences (thd)."""
        return _PADDED_MASK[self.mask]


@dataclass(frozen=True)
class RankPlan:
    """One rank's work: its chunks and, in execution order, ``(pass, own chunk, blocks)`` where blocks are
    the ``(q_chunk, kv_chunk)`` pairs (chunk indices of :func:`num_chunks`) the pass computes. For
    ``"a2a"`` the rank computes every block for ``heads`` = (its head group, group count). ``calls``:
    the work as kernel calls (:class:`ChunkCall`), in the same order. ``window``: the causal sliding
    window's left size (-1: none), which every causal call carries."""

    comm_type: str
    cp: int
    rank: int
    balance: LoadBalance
    causal: bool
    ranges: Tuple[ChunkRange, ...]
    work: Tuple[Tuple[Pass, int, Tuple[Tuple[int, int], ...]], ...]
    heads: Tuple[int, int] = (0, 1)
    window: int = -1

    def blocks(self, pass_: Pass) -> Tuple[Tuple[int, int], ...]:
        return tuple(b for p, _, blocks in self.work if p == pass_ for b in blocks)

    @property
    def calls(self) -> Tuple[ChunkCall, ...]:
        """One call per ``work`` entry: its rows from the own chunk's aligned start, its span the blocks'
        other-side chunks (DKDV: from the aligned start too, so the query blocks meet the key blocks as in
        the single call); the first backward call computes ``rowsum(dO * O)`` for the rank."""
        if self.comm_type == "a2a":
            raise ValueError("`comm_type` 'a2a' runs the single-device call on whole sequences: no chunk calls")
        length = self.ranges[0].end - self.ranges[0].start
        ranges = {r.chunk: r for r in self.ranges}
        out, first_backward = [], True
        for pass_, chunk, blocks in self.work:
            r = ranges[chunk]
            rows = (r.aligned_start, r.end)
            other = [q if pass_ == Pass.DKDV else kv for q, kv in blocks]
            span = (min(other) * length, (max(other) + 1) * length)
            if pass_ == Pass.DKDV:
                span = (min(span[0], rows[0]), span[1])
            if not self.causal:
                mask = AttnMaskType.NO_MASK
            else:
                mask = AttnMaskType.CAUSAL_MASK if pass_ == Pass.DKDV else AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK
            preprocess = pass_ != Pass.FORWARD and first_backward
            first_backward = first_backward and pass_ == Pass.FORWARD
            window = (self.window, 0) if self.causal else (-1, -1)
            out.append(ChunkCall(pass_, r, rows, span, mask, preprocess, window))
        return tuple(out)

    def launches(self, merge_unmasked: bool = False) -> Tuple[Tuple[ChunkCall, ...], ...]:
        """``calls`` grouped into launches: one call each, or (``merge_unmasked``) the unmasked calls of a
        pass as one launch over the rank's rows (every row sees the same span, so a row's blocks do not
        depend on its neighbours), placed where the pass's first call is."""
        groups: List[List[ChunkCall]] = []
        for call in self.calls:
            if merge_unmasked and call.mask == AttnMaskType.NO_MASK:
                prev = next((g for g in groups if g[0].pass_ == call.pass_), None)
                if prev is not None and prev[0].span == call.span:
                    prev.append(call)
                    continue
            groups.append([call])
        return tuple(tuple(g) for g in groups)


def _pass_blocks(pass_: Pass, chunk: int, n: int, causal: bool) -> Tuple[Tuple[int, int], ...]:
    if pass_ == Pass.DKDV:  # the chunk's keys against every query chunk that sees them
        return tuple((q, chunk) for q in range(chunk if causal else 0, n))
    return tuple((chunk, kv) for kv in range(0, chunk + 1 if causal else n))  # the chunk's queries


def rank_plan(comm_type: str, cp: int, rank: int, seqlen: int, causal: bool, balance: LoadBalance,
              align: int = 1, heads: Tuple[int, int] = (0, 1), window: int = -1, rounds: int = 1) -> RankPlan:
    """The plan of rank ``rank`` of ``cp`` for one sequence of ``seqlen`` tokens (padded formats: the
    sequence length; thd: one padded sequence). Row-split comm types ("p2p", "all_gather") run, per own
    chunk in local order, the chunk's dK/dV pass, then its dQ pass; the forward runs per own chunk.
    "a2a+p2p" is the row split over the p2p group (``cp``, ``rank``: its size and the rank in it) for the
    head group ``heads`` = (a2a rank, a2a size) the a2a exchange gives the rank. ``window``: a causal
    sliding window's left size (-1: none); the rows split as without it (each row's window is global).
    ``rounds``: STRIPED's rounds of ``cp`` stripes (:func:`packed_balance`)."""
    if window != -1 and (not causal or window < 0):
        raise NotImplementedError(f"`window` must be -1 or, with a causal mask, >= 0, got {window} (causal="
                                  f"{causal}): a two-sided window is not split by rows")
    if comm_type not in CP_COMM_TYPES:
        choices = ", ".join(repr(c) for c in CP_COMM_TYPES)
        raise ValueError(f"`cp_comm_type` must be one of {choices}, got {comm_type!r}")
    n = num_chunks(cp, balance, rounds)
    if comm_type == "a2a":  # whole sequences, a head group per rank: one chunk, every block
        ranges = chunk_ranges(seqlen, 1, 0, LoadBalance.CONTIGUOUS, align)
        work = tuple((p, 0, tuple(b for c in range(n) for b in _pass_blocks(p, c, n, causal)))
                     for p in (Pass.FORWARD, Pass.DKDV, Pass.DQ))
        return RankPlan(comm_type, cp, rank, balance, causal, ranges, work, (rank, cp), window)
    ranges = chunk_ranges(seqlen, cp, rank, balance, align, rounds)
    work = [(Pass.FORWARD, r.chunk, _pass_blocks(Pass.FORWARD, r.chunk, n, causal)) for r in ranges]
    for r in ranges:
        work += [(p, r.chunk, _pass_blocks(p, r.chunk, n, causal)) for p in (Pass.DKDV, Pass.DQ)]
    return RankPlan(comm_type, cp, rank, balance, causal, ranges, tuple(work),
                    tuple(heads) if comm_type == "a2a+p2p" else (0, 1), window)


def packed_balance(cp: int, seqlen: int, striped: bool, stripe: int = 1) -> Tuple[LoadBalance, int]:
    """The plan's ``(balance, rounds)`` for a packed (thd) row of ``seqlen`` tokens that arrive in the
    Striped order of ``stripe``-token stripes (``striped``) or in ``cp`` contiguous chunks. The plan runs
    the arrival order while it keeps a rank's calls few: contiguous chunks, or at most two stripes per rank
    (each rank's kept rows are then its own: no exchange of results). With more stripes (a call per stripe
    would be too many) the dual-chunk order balances the causal work in two calls per pass, and the kept
    rows are exchanged to the ranks that hold them."""
    if not striped:
        return LoadBalance.CONTIGUOUS, 1
    rounds = seqlen // (cp * stripe)
    if rounds <= 2:
        return LoadBalance.STRIPED, rounds
    if seqlen % (2 * cp) == 0:
        return LoadBalance.DUAL_CHUNK, 1
    return LoadBalance.CONTIGUOUS, 1


# -- what CP supports ----------------------------------------------------------------------------------

# How each framework names the arguments the reasons refer to.
PYTORCH_ARGS = dict(bias="core_attention_bias_type", dropout="attention_dropout", softmax="softmax_type",
                    window="window_size", mask="attn_mask_type", max_logit="return_max_logit",
                    comm="cp_comm_type", format="qkv_format")
JAX_ARGS = dict(bias="attn_bias_type", dropout="dropout_probability", softmax="softmax_type", window="window_size",
                mask="attn_mask_type", max_logit="return_max_logit", comm="context_parallel_strategy",
                format="qkv_layout")

ROW_SPLIT_MASKS = (AttnMaskType.NO_MASK, AttnMaskType.CAUSAL_MASK, AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK)


def unsupported_reasons(*, comm_type: str, qkv_format: QKVFormat, mask: AttnMaskType,
                        bias_type: AttnBiasType = AttnBiasType.NO_BIAS, dropout: float = 0.0,
                        is_training: bool = True, softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
                        window: Tuple[int, int] = (-1, -1), return_max_logit: bool = False,
                        replicated_thd: bool = False, names: Optional[dict] = None) -> List[str]:
    """Why context parallelism cannot run this call: reason strings naming the argument ("`arg`=value is
    not supported with context parallelism ..."), empty when it can. ``replicated_thd``: THD runs as
    every rank computing the whole gathered rows (JAX), which takes any mask and window. ``names``:
    the framework's argument names (:data:`PYTORCH_ARGS`, the default, or :data:`JAX_ARGS`)."""
    arg = names or PYTORCH_ARGS
    cp = "is not supported with context parallelism"
    reasons = []
    if comm_type not in CP_COMM_TYPES:
        choices = ", ".join(repr(c) for c in CP_COMM_TYPES)
        reasons.append(f"`{arg['comm']}` must be one of {choices}, got {comm_type!r}: any other {cp}")
    if bias_type != AttnBiasType.NO_BIAS:
        reasons.append(f"`{arg['bias']}` must be 'no_bias', got {bias_type.value!r}: attention bias {cp}")
    if dropout > 0.0 and is_training:
        reasons.append(f"`{arg['dropout']}` must be 0 in training, got {dropout}: dropout {cp}")
    if softmax_type != AttnSoftmaxType.VANILLA_SOFTMAX:
        reasons.append(f"`{arg['softmax']}` must be 'vanilla', got {softmax_type.value!r}: sink softmax {cp}")
    if return_max_logit:
        reasons.append(f"`{arg['max_logit']}` must be False, got True: the max logit {cp}")
    if qkv_format == QKVFormat.THD and replicated_thd:
        return reasons
    window = tuple(window)
    if window not in ((-1, -1), (-1, 0)) or (window == (-1, 0) and not mask.is_causal()):
        reasons.append(f"`{arg['window']}` must be None (no sliding window), got {window}: sliding windows {cp}")
    if mask == AttnMaskType.ARBITRARY_MASK:
        reasons.append(f"`{arg['mask']}` must not be 'arbitrary': an arbitrary mask {cp}")
    elif mask.is_padding() and qkv_format != QKVFormat.THD:
        reasons.append(f"`{arg['mask']}` must be 'no_mask' or a causal mask with {arg['format']}="
                       f"{qkv_format.value!r}, got {mask.value!r}: padding outside the thd format {cp}")
    return reasons
