"""The kernel launches of one attention call, framework-free: one description that both frontends launch.

From the call's parameters (:class:`~transformer_engine.common.attention.params.AttnParams`), shapes,
strides and dtype (:class:`Call`) and its launch plan (``plan.py``, keyed by :attr:`Call.plan_key`), the
forward and the backward are each an ordered list of :class:`Launch`: the Triton or Gluon kernel, its
grid, every kernel parameter by name (tensors as :class:`Slot`, which the frontend binds to its
buffers; numbers and constexprs as values) and the launch options. The PyTorch frontend
(``pytorch/attention/kernel_runner.py``) runs them on tensors, the JAX frontend (``jax/primitives/gpu.py``)
compiles them into its FFI launch programs, and the resource report (``kernels/resources.py``)
compiles them for any target. A kernel change is made here once; ``tests/common/test_launches.py``
checks that both frontends describe the same launches for the same call.

Layout: every tensor is seen as (b, s, h, d) by its strides (:class:`View`). In packed mode (THD, and
the JAX frontend's padding masks) the sequences are rows of one token axis: the kernels get batch
stride 0 and per-sequence starts and lengths; the dBias kernel, which has no packed mode, reads the
rows with the views' own strides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Tuple, Union

from transformer_engine.common.attention.config import PlanKey
from transformer_engine.common.attention.enums import AttnBiasType, BackwardGrads
from transformer_engine.common.attention.explain import log_plan
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.plan import (
    BackwardPlan, ForwardPlan, Tiles, backward_plan, block_grid, forward_plan, gluon_page_reason, mask_flags,
    padded_head_dim, tma_eligible, window_mask_flags,
)

__all__ = ["Slot", "View", "Bias", "Call", "Launch", "SplitKV", "plan_key", "split_kv", "forward_launches",
           "backward_launches", "fp8_forward_launches", "fp8_backward_launches", "LOG2E", "ELEMENT_SIZES"]

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: qk_scale = softmax_scale * log2(e)
ELEMENT_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Slot:
    """A tensor parameter of a launch, by role: ``q``, ``lse``, ``seq_len_q``, ``bias``, ... (the
    frontend's buffer of that name). A pointer whose feature is off gets the ``lse`` slot: never read."""

    name: str


@dataclass(frozen=True)
class View:
    """One tensor seen as (b, s, h, d): its element strides, and whether its base address is 16-byte
    aligned (the Gluon kernels read through TMA descriptors only then)."""

    strides: Tuple[int, int, int, int]
    aligned: bool = True


@dataclass(frozen=True)
class Bias:
    """A post-scale bias [1|b, 1|h, s_q|1, s_kv]: its shape and element strides."""

    shape: Tuple[int, int, int, int]
    strides: Tuple[int, int, int, int]

    @property
    def kernel_strides(self) -> Tuple[int, int, int, int]:
        """(zb, zh, zm, zn): 0 along a broadcast axis (size 1: batch, heads, or the query rows)."""
        return tuple(st if n > 1 else 0 for n, st in zip(self.shape, self.strides))

    @property
    def grad_strides(self) -> Tuple[int, int, int, int]:
        """Strides of dBias: a contiguous tensor of the bias's shape."""
        b, h, m, n = self.shape
        return (h * m * n, m * n, n, 1)


@dataclass(frozen=True)
class Call:
    """What the launches of one call depend on: its parameters (``params``: the launches read the mask,
    window, diagonal, scale, dropout and softmax type) and the tensors' geometry. ``views`` holds the
    (b, s, h, d) view of each tensor the launches read or write (q, k, v, out; d_out, dq, dk, dv for the
    backward); ``num_seqs`` is the grid's sequence count (b, or the number of packed sequences),
    ``max_q``/``max_k`` the kernels' seqlen_q/_k; ``packed``: sequences by starts (IS_THD); ``has_seqlens``:
    by lengths. ``bias`` and ``alibi_batch_stride`` say which score modifier the kernels add (whatever
    ``params.attn_bias_type`` calls it: JAX's pre-scale bias reaches them as a bias). ``device``: the
    device facts of AttnConfig (device_type, vendor, compute_capability, gfx_arch)."""

    params: AttnParams
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str
    num_seqs: int
    max_q: int
    max_k: int
    packed: bool
    has_seqlens: bool
    views: Mapping[str, View]
    lse_strides: Tuple[int, int]
    device: Mapping[str, object]
    bias: Optional[Bias] = None
    alibi_batch_stride: Optional[int] = None  # ALiBi slopes: 0 for [h], the batch stride for [b, h]; None: none
    # Packed sequences in rows of this many (sequences r * m .. r * m + m - 1 share row r; max_q/max_k are the
    # rows' lengths): the kernels' segment-row grid covers each row's blocks (cdiv(row, block) + m - 1 per row and
    # head) instead of m sequences of the row's length each. 1: the (block, sequence) grid.
    segments_per_row: int = 1
    # A paged KV cache (forward only): K and V are the cache's rows (views "k", "v" with batch stride 0; page p's
    # row r at row p * page_size + r) and slot ``page_table`` (int32 [num_seqs, max pages], row stride
    # ``page_table_stride``) lists each sequence's pages; key n of sequence i is row n % page_size of page
    # page_table[i, n // page_size]. 0: K/V rows in place (packed starts or the batch stride). ``page_rows``: the
    # rows of the pools (pages * page_size), the extent of the Gluon forward's TMA descriptors over them.
    page_size: int = 0
    page_table_stride: int = 0
    page_rows: int = 0
    # FP8 attention (fp8_*_launches): the (batch, kv head) strides of slot ``descale`` (fp32 [..., 4]: q, k, v, dO
    # descale factors); (0, 0) for one scale per tensor.
    descale_strides: Tuple[int, int] = (0, 0)

    def __post_init__(self):
        m = self.segments_per_row
        if m < 1 or self.num_seqs % m:
            raise ValueError(f"`segments_per_row` must be a positive divisor of num_seqs={self.num_seqs}, got {m}")
        if m > 1 and not (self.packed and self.has_seqlens):
            raise ValueError("`segments_per_row` > 1 needs packed sequences with lengths (packed and has_seqlens), "
                             f"got packed={self.packed} has_seqlens={self.has_seqlens}")
        if self.page_size < 0:
            raise ValueError(f"`page_size` must be positive for a paged KV cache (0: none), got {self.page_size}")
        if self.page_size and m > 1:
            raise ValueError("a paged KV cache (`page_size` > 0) takes one sequence per row (segments_per_row 1), "
                             f"got segments_per_row={m}")
        if self.page_size and (self.page_rows <= 0 or self.page_rows % self.page_size):
            raise ValueError(f"`page_rows` must be the pools' rows, a positive multiple of page_size={self.page_size}, "
                             f"got {self.page_rows}")

    @property
    def paged(self) -> bool:
        """Whether K and V are read through a page table (:attr:`page_size`)."""
        return self.page_size > 0

    @property
    def bias_type(self) -> AttnBiasType:
        """The score modifier the kernels add: a post-scale bias, ALiBi or none."""
        if self.bias is not None:
            return AttnBiasType.POST_SCALE_BIAS
        if self.alibi_batch_stride is not None:
            return AttnBiasType.ALIBI
        return AttnBiasType.NO_BIAS

    @property
    def plan_key(self) -> PlanKey:
        """What the call's plans read (:func:`plan_key`)."""
        return plan_key(self.params, self.head_dim_qk, self.head_dim_v, self.dtype, self.bias_type, self.device,
                        self.page_size)

    def grid_rows(self, max_len: int, block: int, heads: int) -> Tuple[int, int]:
        """(blocks, rows * heads) of a block-loop pass over sequences of at most ``max_len`` in ``block``s."""
        m = self.segments_per_row
        if m > 1:  # a row's blocks: sum over its sequences of cdiv(len, block) <= cdiv(row, block) + m - 1
            return _cdiv(max_len, block) + m - 1, (self.num_seqs // m) * heads
        return _cdiv(max_len, block), self.num_seqs * heads


def plan_key(params: AttnParams, head_dim_qk: int, head_dim_v: int, dtype: str, bias_type: AttnBiasType,
             device: Mapping[str, object], kv_page_size: int = 0) -> PlanKey:
    """The PlanKey of a call's launches: its head dims and dtype, the mask, window, diagonal, dropout and
    softmax type of ``params``, the score modifier the kernels add (``bias_type``: Call.bias_type), the
    device facts and the keys per page where K/V are read through a page table (``kv_page_size``:
    Call.page_size; 0: rows in place). The plans are the same in both determinism modes (no atomic or
    autotuned variant exists)."""
    return _plan_key(params, head_dim_qk, head_dim_v, dtype, bias_type, tuple(device.items()), kv_page_size)


@functools.lru_cache(maxsize=1024)
def _plan_key(params: AttnParams, head_dim_qk: int, head_dim_v: int, dtype: str, bias_type: AttnBiasType,
              device: Tuple[Tuple[str, object], ...], kv_page_size: int) -> PlanKey:
    # Memoized: a pure function of frozen values, built twice a training step (forward, backward).
    # The mask, window, diagonal, softmax type and return_max_logit are params' by name.
    return PlanKey.of(params, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, dtype=dtype, attn_bias_type=bias_type,
                      kv_page_size=kv_page_size, **dict(device))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel`` (Triton or Gluon JIT function) on ``grid`` with ``args`` (every
    parameter of the kernel by name, in its order: :class:`Slot` for tensors) and ``options``
    (num_warps, num_stages, maxnreg)."""

    kernel: object
    grid: Tuple[int, int, int]
    args: Dict[str, object] = field(hash=False)
    options: Dict[str, int] = field(hash=False)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def is_gluon(self) -> bool:
        """A warp-specialized Gluon kernel: it builds TMA descriptors in the launch's global scratch."""
        return bool(getattr(self.kernel, "is_gluon", lambda: False)())

    def bind(self, buffers: Mapping[str, object]) -> Dict[str, object]:
        """``args`` with each slot replaced by ``buffers[slot.name]``."""
        return {name: buffers[value.name] if isinstance(value, Slot) else value for name, value in self.args.items()}

    def describe(self) -> Tuple:
        """Plain data for comparisons: (kernel name, grid, args with slots as their names, options)."""
        args = tuple((name, ("slot", value.name) if isinstance(value, Slot) else value)
                     for name, value in self.args.items())
        return (self.name, tuple(self.grid), args, tuple(sorted(self.options.items())))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tma_ok(call: Call, *names: str) -> bool:
    """Whether the Gluon kernels may read these tensors through TMA descriptors (plan.tma_eligible)."""
    size = ELEMENT_SIZES[call.dtype]
    return all(tma_eligible(size, 0 if call.views[n].aligned else 1, call.views[n].strides) for n in names)


def _strides(call: Call, prefix: str, tensor: str, packed: bool) -> Dict[str, int]:
    strides = call.views[tensor].strides
    if packed:
        strides = (0,) + tuple(strides[1:])
    return {f"stride_{prefix}{axis}": value for axis, value in zip("bshd", strides)}


def _with_tensor_slots(values: dict, call: Call) -> dict:
    """``values`` plus the strides and buffer slot of each of the call's tensors (q, k, v, out, d_out and the
    gradients), under the kernels' argument names (``Q``, ``stride_qz``, ...)."""
    for tensor, prefix in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"), ("d_out", "do"), ("dq", "dq"),
                           ("dk", "dk"), ("dv", "dv")):
        if tensor in call.views:
            values.update(_strides(call, prefix, tensor, call.packed))
            values[prefix.upper()] = Slot(tensor)
    return values


_SEQ_SLOTS = ("SEQ_START_Q", "SEQ_START_K", "SEQ_LEN_Q", "SEQ_LEN_K")
_PLACEHOLDER = Slot("lse")


def _values(call: Call, key: PlanKey, plan: Union[ForwardPlan, BackwardPlan]) -> Dict[str, object]:
    """What every block-loop kernel takes, by parameter name (each launch picks its kernel's), with the
    head-dim tiles of ``plan`` (a ForwardPlan or BackwardPlan)."""
    flags, left, right = mask_flags(key)
    scale, dropout_p = call.params.scaling_factor, key.kernel_dropout
    has_bias, has_alibi, dropout = call.bias is not None, call.alibi_batch_stride is not None, dropout_p > 0
    zs = call.bias.kernel_strides if has_bias else (0, 0, 0, 0)
    values = dict(
        BIAS=Slot("bias") if has_bias else _PLACEHOLDER,
        ALIBI_SLOPES=Slot("alibi_slopes") if has_alibi else _PLACEHOLDER,
        RNG_STATE=Slot("rng_state") if dropout else _PLACEHOLDER,
        SEQ_START_Q=Slot("seq_start_q") if call.packed else _PLACEHOLDER,
        SEQ_START_K=Slot("seq_start_k") if call.packed else _PLACEHOLDER,
        SEQ_LEN_Q=Slot("seq_len_q") if call.has_seqlens else _PLACEHOLDER,
        SEQ_LEN_K=Slot("seq_len_k") if call.has_seqlens else _PLACEHOLDER,
        stride_lb=call.lse_strides[0], stride_lh=call.lse_strides[1],
        stride_zb=zs[0], stride_zh=zs[1], stride_zm=zs[2], stride_zn=zs[3],
        stride_alibi_b=call.alibi_batch_stride or 0,
        num_heads_q=call.num_heads_q, num_heads_kv=call.num_heads_kv,
        gqa_group=call.num_heads_q // call.num_heads_kv, seqlen_q=call.max_q, seqlen_k=call.max_k,
        sm_scale=scale, qk_scale=scale * LOG2E, window_left=left, window_right=right, dropout_p=dropout_p,
        HEAD_DIM_QK=call.head_dim_qk, HEAD_DIM_V=call.head_dim_v, BLOCK_DQK=plan.block_dqk,
        BLOCK_DQK2=plan.block_dqk2, BLOCK_DV=plan.block_dv,
        IS_THD=call.packed, HAS_SEQLENS=call.has_seqlens, SEGMENTS=call.segments_per_row,
        HAS_BIAS=has_bias, HAS_ALIBI=has_alibi, DROPOUT=dropout, **flags,
    )
    return _with_tensor_slots(values, call)


def _launch(kernel, grid: Tuple[int, int, int], values: Dict[str, object], options: Dict[str, int]) -> Launch:
    """A launch of ``kernel`` with its parameters taken from ``values`` by name; a kernel with a
    ``length_generic`` twin (kernels/masking.py) takes it when a sequence length is 1."""
    if 1 in (values.get("seqlen_q"), values.get("seqlen_k")):
        kernel = getattr(kernel, "length_generic", kernel)
    missing = [name for name in kernel.arg_names if name not in values]
    if missing:
        raise NotImplementedError(
            f"{kernel.__name__} has parameters {missing} that common.attention.launch_description does not "
            "describe: "
            "update the launch description along with the kernel")
    # Floating-point contraction (a * b + c as one FMA) is part of the kernels' arithmetic, so of their bits:
    # pinned on, as every supported Triton release compiles by default (later releases turn the default off).
    return Launch(kernel, tuple(int(g) for g in grid), {name: values[name] for name in kernel.arg_names},
                  dict(options, enable_fp_fusion=True))


def _block_launch(triton_kernel, gluon_kernel, tiles: Tiles, ws: Optional[Tiles], tma_tensors: Tuple[str, ...],
                  call: Call, values: Dict[str, object], rows_of, extra: Dict[str, object], chunks: int = 1) -> Launch:
    """A block-loop pass: the Gluon kernel with ``ws`` tiles where the plan has them and the tensors allow
    TMA, else the Triton kernel with ``tiles``. ``rows_of(tiles)``: the grid's (blocks, sequences * heads);
    ``chunks``: its third axis (split-KV's key chunks)."""
    if ws is not None and _tma_ok(call, *tma_tensors):
        kernel, t, constexprs, options = gluon_kernel, ws, ws.ws_constexprs, ws.ws_launch_options
    else:
        kernel, t, constexprs, options = triton_kernel, tiles, tiles.loop_constexprs, tiles.launch_options
    grid = block_grid(*rows_of(t))[:2] + (chunks,)
    return _launch(kernel, grid, dict(values, **extra, **constexprs), options)


# Split-KV: a forward whose grid has fewer programs than this (a decode step, a short prefill chunk, a small
# batch) and whose keys span two chunks or more runs one program per chunk and a combine. Which launches run
# changes no bit (kernels/forward.py), so this is a speed choice only: about two programs per SM of the largest
# supported GPU.
SPLIT_KV_PROGRAMS = 264


@dataclass(frozen=True)
class SplitKV:
    """A split-KV forward's workspace: ``chunks`` states per row of ``rows`` (sequences * heads * max_q) rows,
    fp32: slot ``part_o`` holds ``chunks * rows * head_dim_v`` values (unnormalised outputs), slot ``part_ml``
    ``2 * chunks * rows`` (each row's max, then its sum)."""

    chunks: int
    rows: int
    head_dim_v: int

    @property
    def part_o_size(self) -> int:
        return self.chunks * self.rows * self.head_dim_v

    @property
    def part_ml_size(self) -> int:
        return 2 * self.chunks * self.rows


def split_kv(call: Call, plan: Optional[ForwardPlan] = None, force: Optional[bool] = None) -> Optional[SplitKV]:
    """The workspace of ``call``'s split-KV forward, or None where the forward runs one program per row block
    (SPLIT_KV_PROGRAMS; ``force`` True or False overrides the choice where the plan has chunks)."""
    plan = plan or forward_plan(call.plan_key)
    if not plan.kv_chunk or call.max_k <= plan.kv_chunk:
        return None
    blocks, seq_heads = call.grid_rows(call.max_q, plan.tiles.block_m, call.num_heads_q)
    use = blocks * seq_heads < SPLIT_KV_PROGRAMS if force is None else force
    if not use:
        return None
    return SplitKV(_cdiv(call.max_k, plan.kv_chunk), call.num_seqs * call.num_heads_q * call.max_q,
                   call.head_dim_v)


def forward_launches(call: Call, plan: Optional[ForwardPlan] = None,
                     split: Optional[bool] = None) -> Tuple[Launch, ...]:
    """The forward: one launch writing ``out`` and ``lse`` (slots q, k, v, out, lse and the call's
    modifiers: bias, alibi_slopes, rng_state, softmax_offset, seq_start_q/k, seq_len_q/k), and with
    ``params.return_max_logit`` each row's max logit (slot ``row_max``, fp32 laid out as lse). A paged call
    (:attr:`Call.paged`) reads K and V through slot ``page_table`` (int32): the Triton forward row by row, the Gluon
    forward by its loader's TMA loads of whole blocks or pages (only page sizes that fit its key blocks:
    plan.gluon_page_reason; its plan says which runs), each with the bits of the same kernel on the gathered rows.

    Where :func:`split_kv` gives a workspace (``split`` forces the choice), two launches: the forward
    with one program per key chunk writing slots ``part_o`` and ``part_ml``, then the combine writing
    ``out``, ``lse`` and ``row_max``: the same bits as the one launch."""
    from transformer_engine.common.attention.kernels.forward import attn_fwd_combine_kernel, attn_fwd_kernel
    from transformer_engine.common.attention.kernels.hopper_ws import attn_fwd_ws_kernel

    key = call.plan_key
    if plan is None:
        log_plan(key)  # NVTE_DEBUG: what runs and why, once per distinct plan
        plan = forward_plan(key)
    values = _values(call, key, plan)
    has_sink = key.softmax_type.has_sink
    row_max = key.return_max_logit
    workspace = split_kv(call, plan, split)
    # KV_CHUNK 0 where the keys fit one chunk: the same sum (folding one chunk into nothing returns it).
    chunk = plan.kv_chunk if call.max_k > plan.kv_chunk else 0
    values.update(LSE=Slot("lse"), SINK=Slot("softmax_offset") if has_sink else _PLACEHOLDER, HAS_SINK=has_sink,
                  ROW_MAX=Slot("row_max") if row_max else _PLACEHOLDER, HAS_ROW_MAX=row_max,
                  PART_O=Slot("part_o") if workspace else _PLACEHOLDER,
                  PART_ML=Slot("part_ml") if workspace else _PLACEHOLDER,
                  split_rows=workspace.rows if workspace else 0, KV_CHUNK=chunk, SPLIT_KV=workspace is not None,
                  PAGE_TABLE=Slot("page_table") if call.paged else _PLACEHOLDER,
                  stride_pt=call.page_table_stride if call.paged else 0, PAGE_SIZE=call.page_size,
                  page_rows=call.page_rows if call.paged else 0)
    rows = lambda t: call.grid_rows(call.max_q, t.block_m, call.num_heads_q)  # noqa: E731
    ws = plan.warp_specialized
    if ws is not None and call.paged:
        # The Gluon loader follows only page tables whose pages fit its key blocks (a plan given explicitly is held
        # to that too), and addresses the pools' rows with 32-bit TMA coordinates.
        if gluon_page_reason(call.page_size, ws.block_n) is not None:
            ws = None
        elif call.page_rows >= 2 ** 31:
            raise NotImplementedError(f"the Gluon forward on a paged KV cache addresses at most 2**31 - 1 rows of "
                                      f"the pools, got page_rows={call.page_rows}")
    if workspace is None:
        tiles = plan.tiles
        if chunk and plan.kv_chunk_registers is not None:  # the one-program chunked sum holds two states
            tiles = replace(tiles, max_registers=plan.kv_chunk_registers)  # no bits change
        return (_block_launch(attn_fwd_kernel, attn_fwd_ws_kernel, tiles, ws, ("q", "k", "v"), call, values,
                              rows, {}),)
    split_launch = _block_launch(attn_fwd_kernel, attn_fwd_ws_kernel, plan.tiles, ws, ("q", "k", "v"), call, values,
                                 rows, {}, workspace.chunks)
    # The combine is elementwise over rows (no bits depend on its tiles): 16 rows keep its two states in registers.
    combine = _launch(attn_fwd_combine_kernel, block_grid(_cdiv(call.max_q, 16), call.num_seqs * call.num_heads_q),
                      dict(values, num_chunks=workspace.chunks, BLOCK_M=16), dict(num_warps=4))
    return split_launch, combine


def backward_launches(call: Call, plan: Optional[BackwardPlan] = None, bias_grad: bool = False,
                      sink_grad: bool = False, grads: BackwardGrads = BackwardGrads.DQ_DKDV,
                      preprocess: bool = True) -> Tuple[Launch, ...]:
    """The backward, in order: preprocess (delta), the sink-gradient parts (``sink_grad``: slot ``dsink``,
    fp32 [num_seqs, h_q]), dK/dV, dBias (``bias_grad``: slot ``dbias``, contiguous in the bias's shape)
    and dQ. Slots: q, k, v, out, d_out, lse, delta (fp32 like lse), dq, dk, dv and the modifiers'.

    ``grads`` (:class:`BackwardGrads`) drops a gradient pass: ``DQ`` launches no dK/dV pass (slots dk, dv
    unused, ``call.views`` need not have them), ``DKDV`` no dQ pass (slot dq unused). The launches kept
    are those of the whole backward, unchanged: their gradients are the same bits. ``preprocess=False``
    leaves out the preprocess: the ``delta`` slot then holds what it writes (rowsum(dO * O) of each query
    row, a row-local sum: the same bits whichever call computed it)."""
    grads = BackwardGrads(grads)
    if call.paged:
        raise NotImplementedError("a paged KV cache call (`page_size` > 0) is inference only: it has no backward "
                                  "launches (gather the pages into rows for a call that needs gradients)")
    from transformer_engine.common.attention.kernels.backward import (
        attn_bwd_dbias_kernel,
        attn_bwd_dkdv_kernel,
        attn_bwd_dq_kernel,
        attn_bwd_dsink_kernel,
        attn_bwd_preprocess_kernel,
    )
    from transformer_engine.common.attention.kernels.hopper_ws import attn_bwd_dkdv_ws_kernel, attn_bwd_dq_ws_kernel

    key = call.plan_key
    if plan is None:
        plan = backward_plan(key)
    values = _values(call, key, plan)
    values.update(LSE=Slot("lse"), DELTA=Slot("delta"))
    q_rows = lambda t: call.grid_rows(call.max_q, t.block_m, call.num_heads_q)  # noqa: E731
    k_rows = lambda t: call.grid_rows(call.max_k, t.block_n, call.num_heads_kv)  # noqa: E731
    pre = plan.preprocess
    out = [_launch(attn_bwd_preprocess_kernel, block_grid(*q_rows(pre)), dict(values, BLOCK_M=pre.block_m),
                   dict(num_warps=pre.num_warps))] if preprocess else []
    if sink_grad:
        t = plan.dsink
        out.append(_launch(attn_bwd_dsink_kernel, plan.dsink_grid(call.num_seqs, call.num_heads_q),
                           dict(values, SINK=Slot("softmax_offset"), DSINK=Slot("dsink"),
                                stride_dsb=call.num_heads_q, BLOCK_M=t.block_m), dict(num_warps=t.num_warps)))
    tensors = ("q", "k", "v", "d_out")
    if grads.has_dkdv:  # one pass, or dK then dV (BackwardPlan.dv)
        passes = [(plan.dkdv, plan.dkdv_warp_specialized, True, plan.dv is None)]
        if plan.dv is not None:
            passes.append((plan.dv, plan.dv_warp_specialized, False, True))
        for tiles, ws, with_dk, with_dv in passes:
            out.append(_block_launch(attn_bwd_dkdv_kernel, attn_bwd_dkdv_ws_kernel, tiles, ws, tensors, call, values,
                                     k_rows, dict(WITH_DK=with_dk, WITH_DV=with_dv)))
    if bias_grad:
        out.append(_dbias_launch(call, plan, values, attn_bwd_dbias_kernel))
    if grads.has_dq:
        out.append(_block_launch(attn_bwd_dq_kernel, attn_bwd_dq_ws_kernel, plan.dq, plan.dq_warp_specialized,
                                 tensors, call, values, q_rows, {}))
    return tuple(out)


def _dbias_launch(call: Call, plan: BackwardPlan, values: Dict[str, object], kernel) -> Launch:
    """dBias in the bias's shape, summed over its broadcast dims in a fixed order. The kernel has no
    packed mode: it reads rows with the views' own strides and the sequences' lengths, which is where
    packed sequences are when each row holds one from token 0."""
    bias = call.bias
    t = plan.dbias
    dbias = dict(values)
    for tensor, prefix in (("q", "q"), ("k", "k"), ("v", "v"), ("d_out", "do")):
        dbias.update(_strides(call, prefix, tensor, False))
    dbias.update(
        DBIAS=Slot("dbias"),
        **{f"stride_dz{axis}": value for axis, value in zip("bhmn", bias.grad_strides)},
        batch_size=call.num_seqs, bias_batch=bias.shape[0], bias_heads=bias.shape[1],
        BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        # The dBias kernel keeps one Q/K tile: the padded head dim, whether or not the other passes split it.
        BLOCK_DQK=padded_head_dim(call.head_dim_qk),
        # A bias broadcast over the query rows ([.., .., 1, s_kv]) gets one dBias row: the kernel sums them.
        SUM_ROWS=bias.shape[2] == 1,
    )
    return _launch(kernel, plan.dbias_grid(bias.shape[2], call.max_k, bias.shape[0], bias.shape[1]), dbias,
                   t.launch_options)


# --- FP8 attention (kernels/fp8.py) -----------------------------------------------------------------------------

def _fp8_values(call: Call, plan) -> Dict[str, object]:
    """What the FP8 kernels take, by parameter name, with the head-dim tiles of ``plan``
    (``common.attention.fp8.Fp8Plan``): the block-loop kernels' sequence slots, strides and mask values, plus
    slot ``descale`` and its strides, P's fixed scale and the plan's cast mode."""
    from transformer_engine.common.attention.fp8 import P_SCALE

    p = call.params
    flags, left, right = window_mask_flags(p.attn_mask_type, p.window_size, p.bottom_right_diagonal)
    values = dict(
        SEQ_START_Q=Slot("seq_start_q") if call.packed else _PLACEHOLDER,
        SEQ_START_K=Slot("seq_start_k") if call.packed else _PLACEHOLDER,
        SEQ_LEN_Q=Slot("seq_len_q") if call.has_seqlens else _PLACEHOLDER,
        SEQ_LEN_K=Slot("seq_len_k") if call.has_seqlens else _PLACEHOLDER,
        DESCALE=Slot("descale"), LSE=Slot("lse"), DELTA=Slot("delta"),
        stride_lb=call.lse_strides[0], stride_lh=call.lse_strides[1],
        stride_db=call.descale_strides[0], stride_dh=call.descale_strides[1],
        num_heads_q=call.num_heads_q, num_heads_kv=call.num_heads_kv,
        gqa_group=call.num_heads_q // call.num_heads_kv, seqlen_q=call.max_q, seqlen_k=call.max_k,
        sm_scale=p.scaling_factor, window_left=left, window_right=right,
        HEAD_DIM_QK=call.head_dim_qk, HEAD_DIM_V=call.head_dim_v, BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        IS_THD=call.packed, HAS_SEQLENS=call.has_seqlens, P_SCALE=P_SCALE, EXACT_CAST=plan.exact_cast, **flags,
    )
    return _with_tensor_slots(values, call)


def _fp8_options(t) -> Dict[str, int]:
    return dict(num_warps=t.num_warps, num_stages=t.num_stages)


def fp8_forward_launches(call: Call, plan) -> Tuple[Launch, ...]:
    """FP8 attention's forward on E4M3 slots q, k, v (``call.dtype`` their FP8 dtype): one launch writing
    ``out`` and ``lse`` and raising slot ``fwd_amax`` (fp32 [3]: max |O|, the softmax's largest probability),
    with descale factors from slot ``descale`` (:attr:`Call.descale_strides`). ``plan``: the FP8 plan
    (``common.attention.fp8.fp8_plan``); the grid, visibility rule and block bounds are the bf16 forward's."""
    from transformer_engine.common.attention.kernels.fp8 import attn_fp8_fwd_kernel

    t = plan.forward
    values = dict(_fp8_values(call, plan), AMAX=Slot("fwd_amax"), BLOCK_M=t.block_m, BLOCK_N=t.block_n)
    grid = block_grid(*call.grid_rows(call.max_q, t.block_m, call.num_heads_q))
    return (_launch(attn_fp8_fwd_kernel, grid, values, _fp8_options(t)),)


def fp8_backward_launches(call: Call, plan) -> Tuple[Launch, ...]:
    """FP8 attention's backward, in order: preprocess (slot ``delta`` from ``out`` and the FP8 ``d_out``), dK/dV
    (raising slot ``bwd_amax``'s [2] to max |dS|) and dQ, in the gradients' dtype (slots dq, dk, dv)."""
    from transformer_engine.common.attention.kernels.fp8 import (
        attn_fp8_bwd_dkdv_kernel, attn_fp8_bwd_dq_kernel, attn_fp8_bwd_preprocess_kernel,
    )

    values = _fp8_values(call, plan)
    q_rows = lambda t: call.grid_rows(call.max_q, t.block_m, call.num_heads_q)  # noqa: E731
    k_rows = lambda t: call.grid_rows(call.max_k, t.block_n, call.num_heads_kv)  # noqa: E731
    pre, dkdv, dq = plan.preprocess, plan.dkdv, plan.dq
    return (
        _launch(attn_fp8_bwd_preprocess_kernel, block_grid(*q_rows(pre)), dict(values, BLOCK_M=pre.block_m),
                _fp8_options(pre)),
        _launch(attn_fp8_bwd_dkdv_kernel, block_grid(*k_rows(dkdv)),
                dict(values, AMAX=Slot("bwd_amax"), BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n), _fp8_options(dkdv)),
        _launch(attn_fp8_bwd_dq_kernel, block_grid(*q_rows(dq)), dict(values, BLOCK_M=dq.block_m, BLOCK_N=dq.block_n),
                _fp8_options(dq)),
    )
