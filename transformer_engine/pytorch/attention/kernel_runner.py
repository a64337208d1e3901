"""Run the common Triton attention kernels on torch tensors: the PyTorch frontend's half of a launch.

What is launched (kernels, grids, arguments, tiles) is the framework-free launch description
(``common.attention.launch_description``). This module describes a call's tensors to it (an
:class:`~transformer_engine.pytorch.attention.call.AttnCall` and q, k, v), allocates the outputs, binds the
description's slots to tensors and launches each kernel through the compiled-launcher cache
(``launch_cache``). What depends only on the call's signature (``signature_cache``: the call's parameters,
the tensors' shapes, strides, dtypes, devices and alignment, the settings) is prepared once per signature:
the description, the plan, the grids and each kernel's compiled launcher with its scalar arguments bound
(``launch_cache.PreparedLaunch``); a later call of that signature allocates its outputs and launches on its
tensors. Calls with their own ``plan`` or ``seqs`` are described each time. The fused custom ops (``ops.py``)
run :func:`forward` and :func:`backward`; context parallelism runs them on views of its tensors.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import triton

from transformer_engine.common.attention import AttnBiasType, BackwardGrads, QKVFormat
from transformer_engine.common.attention import launch_description
from transformer_engine.common.attention.config import PlanKey
from transformer_engine.common.attention.kernels import triton_compat
from transformer_engine.common.attention.plan import BackwardPlan, ForwardPlan, forward_plan
from transformer_engine.pytorch.attention import launch_cache
from transformer_engine.pytorch.attention.buffers import unfilled
from transformer_engine.pytorch.attention.call import AttnCall
from transformer_engine.pytorch.attention.config import dtype_name
from transformer_engine.pytorch.attention.device import device_facts
from transformer_engine.pytorch.attention.signature_cache import (
    SignatureCache, environment_signature, tensor_signature,
)

__all__ = ["Sequences", "canonical", "sequences", "plan_key", "describe", "forward", "backward", "fixed_order_sum",
           "max_seqlen_kv_bound"]


@dataclass(frozen=True)
class Sequences:
    """Per-sequence extents of one call: lengths (padding or packing) and packed starts (thd)."""

    batch: int
    max_q: int
    max_k: int
    len_q: Optional[torch.Tensor]
    len_k: Optional[torch.Tensor]
    start_q: Optional[torch.Tensor]
    start_k: Optional[torch.Tensor]
    # thd sequences in rows of this many, max_q/max_k the rows' lengths (launch_description.Call.segments_per_row)
    segments_per_row: int = 1

    @property
    def is_thd(self) -> bool:
        return self.start_q is not None

    @property
    def has_seqlens(self) -> bool:
        return self.len_q is not None


def canonical(t: torch.Tensor, fmt: QKVFormat) -> Tuple[torch.Tensor, Tuple[int, int, int, int]]:
    """A (b, s, h, d) view of ``t`` and its strides (batch stride 0 for packed thd)."""
    if fmt == QKVFormat.BSHD:
        return t, tuple(t.stride())
    if fmt == QKVFormat.SBHD:
        v = t.transpose(0, 1)
        return v, tuple(v.stride())
    v = t.unsqueeze(0)
    s = t.stride()
    return v, (0, s[0], s[1], s[2])


def sequences(q: torch.Tensor, k: torch.Tensor, call: AttnCall) -> Sequences:
    """Where the sequences of ``call`` are for the kernels: thd from its cu_seqlens (packed starts from the
    padded ones where given) and ``params.max_seqlen_*``; bshd/sbhd from the shapes, with lengths where the
    call has cu_seqlens (padding masks). A None kv-side tensor next to a given q-side one means "the same as
    q's" (AttnCall's convention at the kernels)."""
    fmt = call.params.qkv_format
    cu_seqlens_q, cu_seqlens_kv = call.cu_seqlens_q, call.cu_seqlens_kv
    seq_offsets_q, seq_offsets_kv = call.cu_seqlens_q_padded, call.cu_seqlens_kv_padded
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    if seq_offsets_kv is None:
        seq_offsets_kv = seq_offsets_q
    if fmt == QKVFormat.THD:
        batch = cu_seqlens_q.shape[0] - 1
        offs_q = seq_offsets_q if seq_offsets_q is not None else cu_seqlens_q
        offs_k = seq_offsets_kv if seq_offsets_kv is not None else cu_seqlens_kv
        return Sequences(batch, call.params.max_seqlen_q, call.params.max_seqlen_kv,
                         (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32).contiguous(),
                         (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).to(torch.int32).contiguous(),
                         offs_q[:-1].to(torch.int32).contiguous(), offs_k[:-1].to(torch.int32).contiguous())
    qv, _ = canonical(q, fmt)
    kv, _ = canonical(k, fmt)
    batch, sq = qv.shape[0], qv.shape[1]
    sk = kv.shape[1]
    if cu_seqlens_q is None:
        return Sequences(batch, sq, sk, None, None, None, None)
    return Sequences(batch, sq, sk,
                     (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32).contiguous(),
                     (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).to(torch.int32).contiguous(), None, None)


def _bias_type(call: AttnCall):
    if call.bias is not None:
        return AttnBiasType.POST_SCALE_BIAS
    if call.alibi_slopes is not None:
        return AttnBiasType.ALIBI
    return AttnBiasType.NO_BIAS


def plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> PlanKey:
    """The PlanKey the launches of ``call`` on these tensors plan with (``launch_description.plan_key``)."""
    page_size = call.params.kv_page_size if call.page_table is not None else 0
    return launch_description.plan_key(call.params, q.shape[-1], v.shape[-1], dtype_name(q.dtype),
                                       _bias_type(call), _device(q.device), page_size)


def _view(t: torch.Tensor, fmt: QKVFormat) -> launch_description.View:
    _, strides = canonical(t, fmt)
    return launch_description.View(strides, t.data_ptr() % 16 == 0)


def describe(q, k, v, call: AttnCall, seqs: Sequences, views: Dict[str, torch.Tensor],
             lse_strides: Tuple[int, int]) -> launch_description.Call:
    """The launch description's view of ``call`` on these tensors (``views``: the tensors by slot name)."""
    bias = None
    if call.bias is not None:
        bias = launch_description.Bias(tuple(call.bias.shape), tuple(call.bias.stride()))
    alibi = None
    if call.alibi_slopes is not None:
        alibi = call.alibi_slopes.stride(0) if call.alibi_slopes.dim() == 2 else 0
    fmt = call.params.qkv_format
    return launch_description.Call(
        params=call.params, num_heads_q=q.shape[-2], num_heads_kv=k.shape[-2], head_dim_qk=q.shape[-1],
        head_dim_v=v.shape[-1], dtype=dtype_name(q.dtype), num_seqs=seqs.batch, max_q=seqs.max_q, max_k=seqs.max_k,
        packed=seqs.is_thd, has_seqlens=seqs.has_seqlens, views={name: _view(t, fmt) for name, t in views.items()},
        lse_strides=lse_strides, device=_device(q.device), bias=bias, alibi_batch_stride=alibi,
        segments_per_row=seqs.segments_per_row, **_paging(call, k),
    )


def _paging(call: AttnCall, k: torch.Tensor) -> Dict[str, int]:
    """The launch description's paged-cache fields of ``call`` on the pool ``k`` (the cache's rows; none without a
    page table)."""
    if call.page_table is None:
        return {}
    return dict(page_size=call.params.kv_page_size, page_table_stride=call.page_table.stride(0),
                page_rows=k.shape[0])


def _device(device: torch.device) -> Dict[str, object]:
    """AttnConfig's device facts of a launch on ``device`` (device_type, vendor, architecture)."""
    return dict(device_type=device.type, **device_facts(device))


def _tma_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Global memory for the tensor descriptors kernels build on the device (Triton asks per launch)."""
    return unfilled((size,), torch.int8, "cuda")


def _ensure_allocator() -> None:
    """Set Triton's allocator for this thread when none is set (the Gluon kernels build TMA descriptors in
    global scratch; autograd's backward runs on its own thread, so this runs at each such launch)."""
    if not triton_compat.allocator_is_set():  # Triton's allocator is a private context variable
        triton.set_allocator(_tma_scratch)


_FORWARDS = SignatureCache("kernel_runner.forward")
# While set (``recording_forwards``): a list that each forward appends its (prepared entry, buffers) to, before it
# launches (a KV-cache decode step keeps them to launch its later steps again, inference._DecodePlan).
_RECORD: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("kernel_runner_record", default=None)
_BACKWARDS = SignatureCache("kernel_runner.backward")


@dataclass(frozen=True)
class _Prepared:
    """A call signature's launches, prepared (``launch_cache.PreparedLaunch``), and its :class:`Sequences` where
    they hold no tensors (extents from the shapes alone: the same for every call of the signature)."""

    launches: Tuple[launch_cache.PreparedLaunch, ...]
    seqs: Optional[Sequences]
    workspace: Optional[launch_description.SplitKV] = None  # a split-KV forward's (fp32 chunk states)


def _static(seqs: Sequences) -> Optional[Sequences]:
    return None if seqs.has_seqlens or seqs.is_thd else seqs


def _call_signature(call: AttnCall) -> tuple:
    return (call.params,) + tuple([tensor_signature(t) for t in call.tensors])


def _prepare(described) -> Tuple[launch_cache.PreparedLaunch, ...]:
    """The described launches (``launch_description.Launch``) prepared for launching on the buffers of any
    call of their signature (``launch_cache.prepare``)."""
    return tuple(launch_cache.prepare(launch, [(i, value.name) for i, value in enumerate(launch.args.values())
                                               if isinstance(value, launch_description.Slot)])
                 for launch in described)


def _run(prepared: Tuple[launch_cache.PreparedLaunch, ...], buffers: Dict[str, torch.Tensor]) -> None:
    """Launch the prepared kernels in order on ``buffers`` (the slots' tensors)."""
    for launch in prepared:
        if launch.is_gluon:
            _ensure_allocator()
        launch.run(buffers)


def _sequence_buffers(seqs: Sequences) -> Dict[str, torch.Tensor]:
    named = dict(seq_start_q=seqs.start_q, seq_start_k=seqs.start_k, seq_len_q=seqs.len_q, seq_len_k=seqs.len_k)
    return {name: t for name, t in named.items() if t is not None}


def _modifier_buffers(call: AttnCall) -> Dict[str, torch.Tensor]:
    """The tensors of the launches' modifier slots (those the call has; rng_state only with dropout)."""
    named = dict(bias=call.bias, alibi_slopes=call.alibi_slopes, softmax_offset=call.softmax_offset,
                 rng_state=call.rng_state if call.params.kernel_dropout > 0 else None, page_table=call.page_table)
    return {name: t for name, t in named.items() if t is not None}


def _given(name: str, t: torch.Tensor, shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A caller's buffer for an output, checked against what would be allocated."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != like.device or t.stride(-1) != 1:
        raise ValueError(f"`{name}` must be a {dtype} tensor of shape {tuple(shape)} on {like.device} with a "
                         f"contiguous last dim, got {t.dtype} {tuple(t.shape)} strides {tuple(t.stride())} "
                         f"on {t.device}")
    return t


def forward(q, k, v, call: AttnCall, plan: Optional[ForwardPlan] = None, *, seqs: Optional[Sequences] = None,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, split_kv: Optional[bool] = None):
    """Run the forward kernel of ``call`` (AttnCall's conventions at the kernels) on q, k, v in
    ``call.params.qkv_format``. Returns (out in q's format with head dim d_v, lse [b, h, max_s_q] fp32), and
    with ``call.params.return_max_logit`` a third tensor: each row's max logit, fp32 shaped as lse (-inf
    where a row sees no key; :func:`max_logit` reduces it per head).
    ``plan``: these tiles instead of the planned ones; ``seqs``: these sequence extents instead of the
    call's (:func:`sequences`); ``out`` and ``lse``: buffers (views of larger tensors allowed) to write
    instead of new ones (thd writes only the rows inside sequences); ``split_kv``: force split-KV on or off
    where the plan sums keys in chunks (``launch_description.split_kv``; the same bits either way)."""
    key = entry = None
    if plan is None and seqs is None:
        key = ("forward", tensor_signature(q), tensor_signature(k), tensor_signature(v), tensor_signature(out),
               tensor_signature(lse), environment_signature(), split_kv) + _call_signature(call)
        entry = _FORWARDS.get(key)
    if seqs is None:
        seqs = entry.seqs if entry is not None and entry.seqs is not None else sequences(q, k, call)
    hq, dv = q.shape[-2], v.shape[-1]
    out_shape = tuple(q.shape[:-1]) + (dv,)
    if out is not None:
        out = _given("out", out, out_shape, q.dtype, q)
    elif seqs.is_thd:
        out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
    else:
        out = unfilled(out_shape, q.dtype, q.device)  # padded rows are written as zeros
    lse_shape = (seqs.batch, hq, seqs.max_q)
    lse = _given("lse", lse, lse_shape, torch.float32, q) if lse is not None else \
        unfilled(lse_shape, torch.float32, q.device)
    tensors = dict(q=q, k=k, v=v, out=out)
    extra = {}
    if call.params.return_max_logit:  # lse's layout; thd writes only rows inside sequences: -inf elsewhere
        extra["row_max"] = torch.empty_strided(lse_shape, lse.stride(), dtype=torch.float32,
                                               device=q.device).fill_(float("-inf"))
        if extra["row_max"].stride() != lse.stride():
            raise NotImplementedError("`return_max_logit` with a given `lse` view is not supported")
    if entry is None:
        described = describe(q, k, v, call, seqs, tensors, (lse.stride(0), lse.stride(1)))
        entry = _Prepared(_prepare(launch_description.forward_launches(described, plan, split_kv)), _static(seqs),
                          launch_description.split_kv(described, plan, split_kv))
        if key is not None:
            _FORWARDS.put(key, entry)
    buffers = dict(tensors, lse=lse, **extra, **_sequence_buffers(seqs), **_modifier_buffers(call))
    if entry.workspace is not None:  # split-KV: the chunks' states, fp32, in one allocation
        buffers["part_o"], buffers["part_ml"] = _split_kv_workspace(entry.workspace, q.device)
    record = _RECORD.get()
    if record is not None:
        record.append((entry, buffers))
    _run(entry.launches, buffers)
    return (out, lse, extra["row_max"]) if extra else (out, lse)


def _split_kv_workspace(workspace: launch_description.SplitKV, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slots part_o and part_ml of a split-KV forward: two views of one new fp32 buffer (one allocation a call),
    part_ml at a 16-byte boundary as a buffer of its own would be (the prepared launches' alignment)."""
    offset = -(-workspace.part_o_size // 4) * 4
    buffer = unfilled((offset + workspace.part_ml_size,), torch.float32, device)
    return buffer[:workspace.part_o_size], buffer[offset:]


@functools.lru_cache(maxsize=256)
def _key_chunk(key: PlanKey) -> int:
    return forward_plan(key).kv_chunk


def key_chunk(params, q: torch.Tensor, v: torch.Tensor, bias_type: AttnBiasType, page_size: int) -> int:
    """The forward's key chunk (``ForwardPlan.kv_chunk``; 0: the keys in one chunk) of a call with ``params``
    (an AttnParams) on q's and v's head dims, dtype and device, score modifier ``bias_type``, reading K and V
    through a page table of ``page_size`` keys per page (0: rows in place)."""
    return _key_chunk(launch_description.plan_key(params, q.shape[-1], v.shape[-1], dtype_name(q.dtype), bias_type,
                                                  _device(q.device), page_size))


def max_seqlen_kv_bound(longest: int, chunk: int, limit: int) -> int:
    """A ``max_seqlen_kv`` for a thd call whose sequences' keys (counted by its cu_seqlens_kv) number at most
    ``longest``, all at most ``limit``, with which the forward launches the same kernels on the same grids as
    with ``longest`` and which changes less often as the sequences grow: ``longest`` rounded up to the forward's
    key chunk ``chunk`` (:func:`key_chunk`), at most ``limit``; ``limit`` where the forward sums the keys in one
    chunk (``chunk`` 0). The launches read max_seqlen_kv through the number of key chunks (split-KV's grid and
    workspace, KV_CHUNK), which the rounding keeps, and as the kernels' ``seqlen_k``, which no kernel reads
    where the lengths come from cu_seqlens (a length of 1, which picks the length-generic kernels, is kept). A
    decode step's call thus keeps its signature, so its prepared launches, while its longest sequence grows
    within a chunk."""
    if longest <= 1:
        return longest
    if not chunk:
        return max(longest, limit)
    return max(longest, min(-(-longest // chunk) * chunk, limit))


def max_logit(row_max: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-head max logit [h] of :func:`forward`'s row maxima [b, h, s] (a max: order-free, so the same
    bits whatever the reduction's order), in ``dtype``."""
    return row_max.amax(dim=(0, 2)).to(dtype)


def backward(q, k, v, out, d_out, lse, call: AttnCall, plan: Optional[BackwardPlan] = None, *,
             seqs: Optional[Sequences] = None, bias_grad: bool = False, softmax_offset_grad: bool = False,
             grads: BackwardGrads = BackwardGrads.DQ_DKDV, dq: Optional[torch.Tensor] = None,
             dk: Optional[torch.Tensor] = None, dv: Optional[torch.Tensor] = None,
             delta: Optional[torch.Tensor] = None, preprocess: bool = True):
    """Run preprocess, dK/dV and dQ of ``call``, and dBias and d softmax_offset when asked
    (launch_description.backward_launches).

    Returns (dq, dk, dv, dbias, d_softmax_offset) with the gradients in the inputs' format; dbias
    (the bias's shape, summed over its broadcast dimensions in a fixed order) is None unless
    ``bias_grad``; d_softmax_offset (fp32 [h_q], per-sequence parts summed by :func:`fixed_order_sum`:
    bitwise the same for a sequence in any batch, packed or padded) is None unless ``softmax_offset_grad``.
    ``grads`` (:class:`BackwardGrads`): ``DQ`` runs no dK/dV pass and returns dk, dv as None, ``DKDV`` no
    dQ pass and dq None; the gradients it returns are bitwise those of the whole backward.

    ``plan`` and ``seqs`` as :func:`forward`'s. ``dq``, ``dk``, ``dv``: buffers (views allowed) for the
    gradients instead of new ones; ``delta``: the buffer of rowsum(dO * O) per query row, with lse's shape and
    strides (new when None), which ``preprocess=False`` expects filled already (by an earlier call over these
    rows) instead of computing it.
    """
    grads = BackwardGrads(grads)
    key = entry = None
    if plan is None and seqs is None:
        key = ("backward", tensor_signature(q), tensor_signature(k), tensor_signature(v), tensor_signature(out),
               tensor_signature(d_out), tensor_signature(lse), tensor_signature(dq), tensor_signature(dk),
               tensor_signature(dv), tensor_signature(delta), bias_grad, softmax_offset_grad, grads, preprocess,
               environment_signature()) + _call_signature(call)
        entry = _BACKWARDS.get(key)
    if seqs is None:
        seqs = entry.seqs if entry is not None and entry.seqs is not None else sequences(q, k, call)
    # thd leaves the rows between sequences unwritten; padded formats write every row.
    alloc = torch.zeros if seqs.is_thd else unfilled
    tensors = dict(q=q, k=k, v=v, out=out, d_out=d_out)
    given = dict(dq=dq, dk=dk, dv=dv)
    for name, like, on in (("dq", q, grads.has_dq), ("dk", k, grads.has_dkdv), ("dv", v, grads.has_dkdv)):
        if on:
            buf = given[name]
            tensors[name] = _given(name, buf, like.shape, like.dtype, like) if buf is not None else \
                alloc(like.shape, dtype=like.dtype, device=like.device)
    dq, dk, dvt = tensors.get("dq"), tensors.get("dk"), tensors.get("dv")
    if delta is None:
        if not preprocess:
            raise ValueError("`delta` must be given with preprocess=False (the rows' rowsum(dO * O)), got None")
        # lse's strides (the kernels address both alike); rows past a sequence are never read.
        delta = unfilled(lse.shape, lse.dtype, lse.device, lse.stride())
    elif tuple(delta.shape) != tuple(lse.shape) or delta.stride() != lse.stride() or delta.dtype != torch.float32:
        raise ValueError(f"`delta` must be float32 with lse's shape {tuple(lse.shape)} and strides {lse.stride()}, "
                         f"got {delta.dtype} {tuple(delta.shape)} strides {delta.stride()}")
    buffers = dict(tensors, lse=lse, delta=delta, **_sequence_buffers(seqs), **_modifier_buffers(call))
    dbias = parts = None
    if bias_grad:
        # The dBias kernel writes every element of its tiles.
        dbias = buffers["dbias"] = unfilled(call.bias.shape, call.bias.dtype, call.bias.device)
    if softmax_offset_grad:
        parts = buffers["dsink"] = unfilled((seqs.batch, q.shape[-2]), torch.float32, lse.device)
    if entry is None:
        described = describe(q, k, v, call, seqs, tensors, (lse.stride(0), lse.stride(1)))
        entry = _Prepared(_prepare(launch_description.backward_launches(
            described, plan, bias_grad=bias_grad, sink_grad=softmax_offset_grad, grads=grads, preprocess=preprocess)),
            _static(seqs))
        if key is not None:
            _BACKWARDS.put(key, entry)
    _run(entry.launches, buffers)
    d_offset = fixed_order_sum(parts) if softmax_offset_grad else None
    return dq, dk, dvt, dbias, d_offset


def fixed_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 as a pairwise tree of elementwise adds: zero-padded to a power of two, then
    the second half added to the first until one row is left. The same adds as the JAX frontend's
    ``attention_math.fixed_order_sum``, so both give the same bits for the same parts."""
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros((width - n,) + tuple(x.shape[1:]))], dim=0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]
