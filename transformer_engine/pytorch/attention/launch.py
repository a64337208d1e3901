"""Launch the common Triton attention kernels on torch tensors (the frontend's half of a launch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton

from transformer_engine.common.attention import AttnBiasType, AttnConfig, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.kernels.backward import (
    attn_bwd_dbias_kernel,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_dsink_kernel,
    attn_bwd_preprocess_kernel,
)
from transformer_engine.common.attention.kernels.fill import zero_outside_sequences_kernel
from transformer_engine.common.attention.kernels.forward import attn_fwd_kernel
from transformer_engine.common.attention.kernels.hopper_ws import (
    attn_bwd_dkdv_ws_kernel,
    attn_bwd_dq_ws_kernel,
    attn_fwd_ws_kernel,
)
from transformer_engine.common.attention.kernels.scores import dropout_mask_kernel
from transformer_engine.common.attention.plan import (
    BackwardPlan, ForwardPlan, backward_plan, block_grid, forward_plan, mask_flags, tma_eligible,
)
from transformer_engine.pytorch.attention.config import dtype_name, triton_interpreting
from transformer_engine.pytorch.attention.device import device_facts

LOG2E = 1.4426950408889634


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

    @property
    def is_thd(self) -> bool:
        return self.start_q is not None

    @property
    def has_seqlens(self) -> bool:
        return self.len_q is not None

    def args(self, like: torch.Tensor):
        dummy = like  # never read when the matching constexpr flag is off
        return (
            self.start_q if self.start_q is not None else dummy,
            self.start_k if self.start_k is not None else dummy,
            self.len_q if self.len_q is not None else dummy,
            self.len_k if self.len_k is not None else dummy,
        )


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


def sequences(fmt: QKVFormat, q: torch.Tensor, k: torch.Tensor, cu_seqlens_q, cu_seqlens_kv,
              seq_offsets_q, seq_offsets_kv, max_seqlen_q: int, max_seqlen_kv: int) -> Sequences:
    qv, _ = canonical(q, fmt)
    kv, _ = canonical(k, fmt)
    # A None kv-side tensor next to a given q-side one means "the same as q" (fused_attn_func
    # passes it so when the caller gave one tensor for both).
    if cu_seqlens_kv is None:
        cu_seqlens_kv = cu_seqlens_q
    if seq_offsets_kv is None:
        seq_offsets_kv = seq_offsets_q
    if fmt == QKVFormat.THD:
        batch = cu_seqlens_q.shape[0] - 1
        offs_q = seq_offsets_q if seq_offsets_q is not None else cu_seqlens_q
        offs_k = seq_offsets_kv if seq_offsets_kv is not None else cu_seqlens_kv
        return Sequences(batch, max_seqlen_q, max_seqlen_kv,
                         (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32).contiguous(),
                         (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).to(torch.int32).contiguous(),
                         offs_q[:-1].to(torch.int32).contiguous(), offs_k[:-1].to(torch.int32).contiguous())
    batch, sq = qv.shape[0], qv.shape[1]
    sk = kv.shape[1]
    if cu_seqlens_q is None:
        return Sequences(batch, sq, sk, None, None, None, None)
    return Sequences(batch, sq, sk,
                     (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int32).contiguous(),
                     (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).to(torch.int32).contiguous(), None, None)


def plan_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: QKVFormat, mask: AttnMaskType,
                window: Tuple[int, int], deterministic: bool, mods: "ScoreMods" = None,
                bottom_right_diagonal: Optional[bool] = None) -> AttnConfig:
    """The planning-relevant AttnConfig of a launch (head dims, dtype, mask kind and diagonal alignment,
    score modifiers (``ScoreMods``), device)."""
    device_type = q.device.type
    bias_type = AttnBiasType.NO_BIAS
    if mods is not None and mods.bias is not None:
        bias_type = AttnBiasType.POST_SCALE_BIAS
    elif mods is not None and mods.alibi_slopes is not None:
        bias_type = AttnBiasType.ALIBI
    return AttnConfig(
        batch_size=1, num_heads_q=q.shape[-2], num_heads_kv=k.shape[-2],
        head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=0, max_seqlen_kv=0,
        dtype=dtype_name(q.dtype), attn_mask_type=mask, window_size=window,
        bottom_right_diagonal=bottom_right_diagonal, attn_bias_type=bias_type,
        dropout=mods.dropout_p if mods is not None else 0.0, deterministic=deterministic,
        softmax_type=mods.softmax_type if mods is not None else AttnSoftmaxType.VANILLA_SOFTMAX,
        device_type=device_type, **device_facts(q.device),
    )


@dataclass(frozen=True)
class ScoreMods:
    """What modifies the scores: post-scale bias [b|1, h|1, s_q|1, s_kv], ALiBi slopes [h] or
    [b, h] (fp32), dropout probability and its RNG state (int64 [seed, offset], on the device), and
    the softmax: its type and, for sink softmax, the sink logits ``softmax_offset`` (fp32 [h_q]:
    zeros for off-by-one)."""

    bias: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    rng_state: Optional[torch.Tensor] = None
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    softmax_offset: Optional[torch.Tensor] = None

    def sink_args(self, like: torch.Tensor):
        """The Triton forward's sink arguments (the Gluon forward has none: the plan keeps sink
        configs off it)."""
        has_sink = self.softmax_type.has_sink
        return dict(SINK=self.softmax_offset if has_sink else like, HAS_SINK=has_sink)

    def pointer_args(self, like: torch.Tensor):
        return (self.bias if self.bias is not None else like,
                self.alibi_slopes if self.alibi_slopes is not None else like,
                self.rng_state if self.dropout_p > 0 else like)

    def stride_args(self, batch: int, heads: int):
        if self.bias is None:
            zs = (0, 0, 0, 0)
        else:
            b = self.bias
            # A broadcast axis (size 1: batch, heads, or the query rows of a [1, 1, 1, s_kv] bias) is stride 0.
            zs = tuple(b.stride(i) if b.shape[i] > 1 else 0 for i in range(4))
        alibi_b = 0
        if self.alibi_slopes is not None and self.alibi_slopes.dim() == 2:
            alibi_b = self.alibi_slopes.stride(0)
        return zs + (alibi_b,)

    def flags(self):
        return dict(HAS_BIAS=self.bias is not None, HAS_ALIBI=self.alibi_slopes is not None,
                    DROPOUT=self.dropout_p > 0)


NO_MODS = ScoreMods()


def _tma_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Global memory for the tensor descriptors kernels build on the device (Triton asks per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _use_tma(wanted: bool, *views) -> bool:
    """Whether a launch may read these (tensor, (b, s, h, d) strides) views through TMA descriptors:
    the plan asks for it, the head dim is contiguous, every other stride and the base are 16-byte
    aligned. Sets Triton's allocator for this thread when none is set (autograd's backward runs
    on its own thread, so this runs at each launch)."""
    if not wanted:
        return False
    if not all(tma_eligible(t.element_size(), t.data_ptr(), strides) for t, strides in views):
        return False
    from triton.runtime import _allocation  # the allocator Triton reads is a private context var

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
    return True


def forward(q, k, v, fmt: QKVFormat, seqs: Sequences, softmax_scale: float, mask: AttnMaskType,
            window: Tuple[int, int], plan: Optional[ForwardPlan] = None, mods: ScoreMods = NO_MODS,
            bottom_right_diagonal: Optional[bool] = None):
    """Run the forward kernel. Returns (out in q's format with head dim d_v, lse [b, h, max_s_q] fp32).
    ``bottom_right_diagonal`` aligns windows and ALiBi (``resolve_bottom_right_diagonal``)."""
    config = plan_config(q, k, v, fmt, mask, window, False, mods, bottom_right_diagonal)
    if plan is None:
        plan = forward_plan(config)
    hq, dqk = q.shape[-2], q.shape[-1]
    hk, dv = k.shape[-2], v.shape[-1]
    out_shape = tuple(q.shape[:-1]) + (dv,)
    out = torch.zeros(out_shape, dtype=q.dtype, device=q.device) if seqs.is_thd else \
        torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((seqs.batch, hq, seqs.max_q), dtype=torch.float32, device=q.device)
    _, sq_ = canonical(q, fmt)
    _, sk_ = canonical(k, fmt)
    _, sv_ = canonical(v, fmt)
    _, so_ = canonical(out, fmt)
    flags, left, right = mask_flags(config)
    t = plan.tiles
    kernel, constexprs = attn_fwd_kernel, dict(t.loop_constexprs, **mods.sink_args(lse))
    if plan.warp_specialized is not None and _use_tma(True, (q, sq_), (k, sk_), (v, sv_)):
        t = plan.warp_specialized
        kernel, constexprs = attn_fwd_ws_kernel, t.ws_constexprs
    kernel[block_grid(triton.cdiv(seqs.max_q, t.block_m), seqs.batch * hq)](
        q, k, v, out, lse, *mods.pointer_args(lse), *seqs.args(lse),
        *sq_, *sk_, *sv_, *so_, lse.stride(0), lse.stride(1), *mods.stride_args(seqs.batch, hq),
        hq, hq // hk, seqs.max_q, seqs.max_k,
        softmax_scale * LOG2E, left, right, mods.dropout_p,
        HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        IS_THD=seqs.is_thd, HAS_SEQLENS=seqs.has_seqlens, DOT_PRECISION=plan.dot_precision,
        TMA=_use_tma(t.tma, (k, sk_), (v, sv_)), **constexprs, **t.launch_options, **flags, **mods.flags(),
    )
    return out, lse


def backward(q, k, v, out, d_out, lse, fmt: QKVFormat, seqs: Sequences, softmax_scale: float,
             mask: AttnMaskType, window: Tuple[int, int], deterministic: bool,
             plan: Optional[BackwardPlan] = None, mods: ScoreMods = NO_MODS, bias_grad: bool = False,
             bottom_right_diagonal: Optional[bool] = None, softmax_offset_grad: bool = False):
    """Run preprocess, dK/dV and dQ (or atomic dQ), and dBias and d softmax_offset when asked.

    Returns (dq, dk, dv, dbias, d_softmax_offset) with the gradients in the inputs' format; dbias
    (the bias's shape, summed over its broadcast dimensions in a fixed order) is None unless
    ``bias_grad``; d_softmax_offset (fp32 [h_q], :func:`sink_grad`) is None unless
    ``softmax_offset_grad``.
    """
    config = plan_config(q, k, v, fmt, mask, window, deterministic, mods, bottom_right_diagonal)
    if plan is None:
        plan = backward_plan(config)
    if deterministic and plan.atomic_dq:
        raise RuntimeError("deterministic backward planned with atomic dQ; this is a planning bug")
    hq, dqk = q.shape[-2], q.shape[-1]
    hk, dv = k.shape[-2], v.shape[-1]
    alloc = torch.zeros if seqs.is_thd else torch.empty
    dk = alloc(k.shape, dtype=k.dtype, device=k.device)
    dvt = alloc(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty_like(lse)
    _, sq_ = canonical(q, fmt)
    _, sk_ = canonical(k, fmt)
    _, sv_ = canonical(v, fmt)
    _, so_ = canonical(out, fmt)
    _, sdo_ = canonical(d_out, fmt)
    _, sdk_ = canonical(dk, fmt)
    _, sdv_ = canonical(dvt, fmt)
    flags, left, right = mask_flags(config)
    seq_args = seqs.args(lse)

    pre = plan.preprocess
    attn_bwd_preprocess_kernel[block_grid(triton.cdiv(seqs.max_q, pre.block_m), seqs.batch * hq)](
        out, d_out, delta, seq_args[0], seq_args[2], *so_, *sdo_, lse.stride(0), lse.stride(1),
        hq, seqs.max_q, HEAD_DIM_V=dv, BLOCK_DV=plan.block_dv, BLOCK_M=pre.block_m,
        IS_THD=seqs.is_thd, HAS_SEQLENS=seqs.has_seqlens, num_warps=pre.num_warps,
    )
    d_offset = sink_grad(lse, delta, seqs, plan, mods.softmax_offset) if softmax_offset_grad else None
    if plan.atomic_dq:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq_acc = lse  # unused by the kernel when ATOMIC_DQ is off
    _, sdqa_ = canonical(dq_acc, fmt) if plan.atomic_dq else (None, (0, 0, 0, 0))
    t = plan.dkdv
    mod_ptrs, mod_strides = mods.pointer_args(lse), mods.stride_args(seqs.batch, hq)
    kernel, constexprs = attn_bwd_dkdv_kernel, t.loop_constexprs
    if plan.dkdv_warp_specialized is not None and _use_tma(True, (q, sq_), (k, sk_), (v, sv_), (d_out, sdo_)):
        t = plan.dkdv_warp_specialized
        kernel, constexprs = attn_bwd_dkdv_ws_kernel, t.ws_constexprs
    kernel[block_grid(triton.cdiv(seqs.max_k, t.block_n), seqs.batch * hk)](
        q, k, v, d_out, dk, dvt, dq_acc, lse, delta, *mod_ptrs, *seq_args,
        *sq_, *sk_, *sv_, *sdo_, *sdk_, *sdv_, *sdqa_, lse.stride(0), lse.stride(1), *mod_strides,
        hk, hq // hk, seqs.max_q, seqs.max_k, softmax_scale, softmax_scale * LOG2E, left, right, mods.dropout_p,
        HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        IS_THD=seqs.is_thd, HAS_SEQLENS=seqs.has_seqlens, ATOMIC_DQ=plan.atomic_dq, DOT_PRECISION=plan.dot_precision,
        TMA=_use_tma(t.tma, (q, sq_), (d_out, sdo_)), **constexprs, **t.launch_options, **flags,
        **mods.flags(),
    )
    dbias = _dbias(q, k, v, d_out, lse, delta, fmt, seqs, softmax_scale, window, flags, left, right, plan, mods) \
        if bias_grad else None
    if plan.atomic_dq:
        return dq_acc.to(q.dtype), dk, dvt, dbias, d_offset
    dq = alloc(q.shape, dtype=q.dtype, device=q.device)
    _, sdq_ = canonical(dq, fmt)
    t = plan.dq
    kernel, constexprs = attn_bwd_dq_kernel, t.loop_constexprs
    if plan.dq_warp_specialized is not None and _use_tma(True, (q, sq_), (k, sk_), (v, sv_), (d_out, sdo_)):
        t = plan.dq_warp_specialized
        kernel, constexprs = attn_bwd_dq_ws_kernel, t.ws_constexprs
    kernel[block_grid(triton.cdiv(seqs.max_q, t.block_m), seqs.batch * hq)](
        q, k, v, d_out, dq, lse, delta, *mod_ptrs, *seq_args,
        *sq_, *sk_, *sv_, *sdo_, *sdq_, lse.stride(0), lse.stride(1), *mod_strides,
        hq, hq // hk, seqs.max_q, seqs.max_k, softmax_scale, softmax_scale * LOG2E, left, right, mods.dropout_p,
        HEAD_DIM_QK=dqk, HEAD_DIM_V=dv, BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        IS_THD=seqs.is_thd, HAS_SEQLENS=seqs.has_seqlens, DOT_PRECISION=plan.dot_precision,
        TMA=_use_tma(t.tma, (k, sk_), (v, sv_)), **constexprs, **t.launch_options, **flags, **mods.flags(),
    )
    return dq, dk, dvt, dbias, d_offset


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, seqs: Sequences, plan: BackwardPlan,
              softmax_offset: torch.Tensor) -> torch.Tensor:
    """d softmax_offset (fp32 [h_q]) of the learnable sink, without atomics: each sequence's part
    from attn_bwd_dsink_kernel (its rows in a fixed order), then :func:`fixed_order_sum` over the
    sequences. A sequence's part is bitwise the same in any batch and packed or padded."""
    hq = lse.shape[1]
    parts = torch.empty((seqs.batch, hq), dtype=torch.float32, device=lse.device)
    t = plan.dsink
    attn_bwd_dsink_kernel[plan.dsink_grid(seqs.batch, hq)](
        lse, delta, softmax_offset, parts, seqs.args(lse)[2], lse.stride(0), lse.stride(1), parts.stride(0),
        seqs.max_q, BLOCK_M=t.block_m, HAS_SEQLENS=seqs.has_seqlens, num_warps=t.num_warps,
    )
    return fixed_order_sum(parts)


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


def _dbias(q, k, v, d_out, lse, delta, fmt, seqs: Sequences, softmax_scale, window, flags, left, right,
           plan: BackwardPlan, mods: ScoreMods):
    """dBias in the bias's shape (padded formats only), summed over broadcast dims in order."""
    bias = mods.bias
    hq, hk = q.shape[-2], k.shape[-2]
    dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
    _, sq_ = canonical(q, fmt)
    _, sk_ = canonical(k, fmt)
    _, sv_ = canonical(v, fmt)
    _, sdo_ = canonical(d_out, fmt)
    t = plan.dbias
    seq_args = seqs.args(lse)
    # A bias broadcast over the query rows ([.., .., 1, s_kv]) gets one dBias row: its kernel sums them.
    sum_rows = bias.shape[2] == 1
    attn_bwd_dbias_kernel[plan.dbias_grid(bias.shape[2], seqs.max_k, bias.shape[0], bias.shape[1])](
        q, k, v, d_out, lse, delta, bias, dbias, mods.rng_state if mods.dropout_p > 0 else lse,
        seq_args[2], seq_args[3], *sq_, *sk_, *sv_, *sdo_, lse.stride(0), lse.stride(1),
        *mods.stride_args(seqs.batch, hq)[:4], *dbias.stride(),
        seqs.batch, hq, hq // hk, bias.shape[0], bias.shape[1], seqs.max_q, seqs.max_k,
        softmax_scale * LOG2E, left, right, mods.dropout_p,
        HEAD_DIM_QK=q.shape[-1], HEAD_DIM_V=v.shape[-1], BLOCK_DQK=plan.block_dqk, BLOCK_DV=plan.block_dv,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_SEQLENS=seqs.has_seqlens,
        HAS_LEFT=flags["HAS_LEFT"], HAS_RIGHT=flags["HAS_RIGHT"], BOTTOM_RIGHT=flags["BOTTOM_RIGHT"],
        DROPOUT=mods.dropout_p > 0, DOT_PRECISION=plan.dot_precision, SUM_ROWS=sum_rows, **t.launch_options,
    )
    return dbias


def dropout_keep_mask(rng_state: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float) -> torch.Tensor:
    """The boolean keep mask [b, h, s_q, s_kv] the kernels use for ``rng_state`` (for tests)."""
    keep = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=rng_state.device)
    block = 16 if rng_state.device.type == "cpu" else 64
    grid = (triton.cdiv(seqlen_q, block), triton.cdiv(seqlen_k, block), batch * heads)
    dropout_mask_kernel[grid](keep, rng_state, heads, seqlen_q, seqlen_k, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()


def zero_outside_sequences(x: torch.Tensor, starts: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """In place: rows of ``x`` [t, h, d] outside every ``[starts[n], starts[n] + used[n])`` set to
    zero (sequences in order, not overlapping; ``starts`` has at least ``len(used)`` entries).
    Returns ``x``. Like the CUDA kernel, the CPU path writes through ``.data``: no autograd version
    bump (the caller clears rows no saved-tensor reader looks at)."""
    t, h, d = x.shape
    if x.device.type == "cpu" and not triton_interpreting():
        # CPU tensors without Triton's interpreter (stand-in backends in tests): same rows, in torch.
        n = used.shape[0]
        edges = torch.zeros(t + 1, dtype=torch.int64)
        begin = starts[:n].to(torch.int64).clamp(0, t)
        edges.index_add_(0, begin, torch.ones(n, dtype=torch.int64))
        edges.index_add_(0, (begin + used.to(torch.int64)).clamp(0, t), torch.full((n,), -1, dtype=torch.int64))
        inside = edges.cumsum(0)[:t] > 0
        x.data.masked_fill_(~inside.view(-1, 1, 1), 0)
        return x
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_t = max(1, min(16, 8192 // (block_h * block_d)))
    # Gap programs on axis 0; axis 1 splits a long gap (usually only the tail after the last sequence).
    chunks = 2 if x.device.type == "cpu" else 16
    zero_outside_sequences_kernel[(used.shape[0] + 1, chunks)](
        x, starts, used, used.shape[0], t, *x.stride(),
        NUM_HEADS=h, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_T=block_t,
    )
    return x
