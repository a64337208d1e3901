"""PyTorch attention test helpers (tests, and the development scripts by path): not part of the package.

- :func:`attn_config`: the AttnConfig of tensors and TransformerEngine-style string arguments, checked.
- :func:`plan_key`: the PlanKey the fused launches plan with (``call.fused_call``'s arguments).
- :func:`recorded_launches`: the launch lists the kernel runner runs, recorded (and optionally not run);
  :func:`no_launches`: nothing launched (the host time of our Python alone).
- :func:`counted_host_reads`: how often tensor values were read on the host (each a device-to-host copy, so
  a sync, on a GPU).
- :func:`dropout_keep_mask`: the kernels' dropout mask of an RNG state; :func:`zero_outside_sequences_reference`.
- Context parallelism: every rank of a CP call in one process (:func:`run_ranks_in_one_process`).
"""

from __future__ import annotations

import collections
import math
import contextlib
from typing import Counter, Iterator, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from transformer_engine.common.attention import (AttnBiasType, AttnConfig, AttnMaskType, AttnSoftmaxType, QKVFormat,
                                                 launch_description)
from transformer_engine.common.attention.context_parallel import LoadBalance
from transformer_engine.common.attention.config import PlanKey, normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.kernels.scores import dropout_keep
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.buffers import host_values
from transformer_engine.pytorch.attention.call import fused_call
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.pytorch.attention.config import build_attn_config, check_qkv, deterministic_requested
from transformer_engine.pytorch.attention.context_parallel import (FusedSpec, SeqSplit, _seq_dim, assemble,
                                                                   fused_backward_step, fused_forward_step,
                                                                   local_tokens, tile_alignment)

__all__ = ["attn_config", "fused_call", "plan_key", "recorded_launches", "no_launches", "counted_host_reads",
           "dropout_keep_mask", "zero_outside_sequences_reference",
           "run_ranks_in_one_process", "split_of_globals"]


def attn_config(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format="bshd",
    attn_mask_type="no_mask",
    window_size: Optional[Tuple[int, int]] = None,
    attn_bias_type="no_bias",
    bias_shape: Optional[str] = None,
    dropout: float = 0.0,
    is_training: bool = True,
    deterministic: Optional[bool] = None,
    batch_size: Optional[int] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    packing: str = "separate",
    distinct_kv_lengths: bool = False,
    bottom_right_diagonal: Optional[bool] = None,
    return_max_logit: bool = False,
    softmax_type="vanilla",
) -> AttnConfig:
    """The AttnConfig of one call (enums or their strings): shapes, dtypes and devices checked, the window
    normalized, then ``config.build_attn_config`` (its arguments' meaning)."""
    fmt = QKVFormat(qkv_format)
    mask = AttnMaskType(attn_mask_type)
    check_qkv(q, k, v, fmt)
    params = AttnParams(
        attn_mask_type=mask, attn_bias_type=AttnBiasType(attn_bias_type), qkv_format=fmt,
        window_size=normalize_window(window_size, mask), scaling_factor=1.0 / math.sqrt(q.shape[-1]),
        dropout_probability=float(dropout), is_training=bool(is_training),
        deterministic=deterministic_requested() if deterministic is None else bool(deterministic),
        bottom_right_diagonal=bottom_right_diagonal, softmax_type=AttnSoftmaxType(softmax_type),
        return_max_logit=bool(return_max_logit))
    return build_attn_config(q, k, v, params, bias_shape=bias_shape, batch_size=batch_size,
                             max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, packing=packing,
                             distinct_kv_lengths=distinct_kv_lengths)


def plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> PlanKey:
    """The PlanKey the fused launches plan with for q, k, v and ``call.fused_call``'s arguments."""
    return kernel_runner.plan_key(q, k, v, fused_call(*args, **kwargs))


@contextlib.contextmanager
def recorded_launches(run: bool = True) -> Iterator[List[Tuple[launch_description.Launch, ...]]]:
    """While open, each list of launches the kernel runner runs (a forward, a backward) is appended to the
    yielded list; ``run=False`` launches nothing (the host time of our Python alone, or the launches of a
    call on meta tensors)."""
    recorded: List[Tuple[launch_description.Launch, ...]] = []
    real_run = kernel_runner._run

    def record(prepared, buffers):  # launch_cache.PreparedLaunch, each from one described Launch
        recorded.append(tuple(p.described for p in prepared))
        if run:
            real_run(prepared, buffers)

    kernel_runner._run = record
    try:
        yield recorded
    finally:
        kernel_runner._run = real_run


@contextlib.contextmanager
def no_launches() -> Iterator[None]:
    """While open, the kernel runner launches nothing (outputs stay unfilled): the host time of our Python
    alone, on any device."""
    real_run = kernel_runner._run
    kernel_runner._run = lambda prepared, buffers: None
    try:
        yield
    finally:
        kernel_runner._run = real_run


# The aten ops that hand a tensor's value to Python (``.item()``, ``int()``, ``bool()``, ``torch.equal``), and the
# copies to the host: on a GPU each waits for every kernel queued before it.
_VALUE_OPS = ("_local_scalar_dense", "equal", "is_nonzero")
_COPY_OPS = ("_to_copy", "copy_")


class _HostReads(TorchDispatchMode):
    """Counts, by op, the host reads of tensors on one device type (every tensor op passes through here)."""

    def __init__(self, counts: Counter, device_type: str):
        super().__init__()
        self.counts, self.device_type = counts, device_type
        self.in_tolist = 0  # a .tolist() copies to the host itself: counted once, as "tolist"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _VALUE_OPS and any(isinstance(a, torch.Tensor) and a.device.type == self.device_type
                                      for a in args):
            self.counts[name] += 1
        out = func(*args, **kwargs)
        if name in _COPY_OPS and self.device_type != "cpu" and not self.in_tolist:
            source, target = (args[1], args[0]) if name == "copy_" else (args[0], out)
            if (isinstance(source, torch.Tensor) and source.device.type == self.device_type
                    and target.device.type == "cpu"):
                self.counts["device-to-host copy"] += 1
        return out


@contextlib.contextmanager
def rope_kernel_launches() -> Iterator[List[bool]]:
    """The RoPE kernel's launches while inside (its launcher, common/attention/kernels/rope.py): one entry per
    launch, True for a backward."""
    from transformer_engine.common.attention.kernels import rope as rope_kernels

    calls: List[bool] = []
    original = rope_kernels.rope

    def counted(*args, backward=False, **kwargs):
        calls.append(bool(backward))
        return original(*args, backward=backward, **kwargs)

    rope_kernels.rope = counted
    try:
        yield calls
    finally:
        rope_kernels.rope = original


@contextlib.contextmanager
def counted_host_reads(device_type: Optional[str] = None) -> Iterator[Counter]:
    """While open, counts (by op, in the yielded Counter) the reads of tensor values into Python or onto the
    host (``.item()``, ``bool()``, ``torch.equal``, ``.tolist()``, copies to the CPU) of tensors on
    ``device_type`` (default: "cuda" where available, else "cpu", where every read counts, as a GPU's would).
    Every tensor op goes through a Python dispatch mode meanwhile: count, do not time, in it."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    counts: Counter = collections.Counter()
    tolist = torch.Tensor.tolist
    mode = _HostReads(counts, device_type)

    def counted_tolist(self):
        if self.device.type != device_type:
            return tolist(self)
        counts["tolist"] += 1
        mode.in_tolist += 1
        try:
            return tolist(self)
        finally:
            mode.in_tolist -= 1

    torch.Tensor.tolist = counted_tolist
    try:
        with mode:
            yield counts
    finally:
        torch.Tensor.tolist = tolist


@triton.jit
def dropout_mask_kernel(KEEP, RNG_STATE, num_heads, seqlen_q, seqlen_k, dropout_p,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keep mask [b, h, s_q, s_kv] (int8) the attention kernels draw (kernels/scores.py dropout_keep)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq_head = tl.program_id(2)
    keep = dropout_keep(tl.load(RNG_STATE), tl.load(RNG_STATE + 1), seq_head, offs_m[:, None], offs_n[None, :],
                        dropout_p)
    base = KEEP + seq_head.to(tl.int64) * seqlen_q * seqlen_k
    tl.store(base + offs_m[:, None] * seqlen_k + offs_n[None, :], keep.to(tl.int8),
             mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


def dropout_keep_mask(rng_state: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                      dropout_p: float) -> torch.Tensor:
    """The boolean keep mask [b, h, s_q, s_kv] the kernels use for ``rng_state``."""
    keep = torch.empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.int8, device=rng_state.device)
    block = 16 if rng_state.device.type == "cpu" else 64
    grid = (triton.cdiv(seqlen_q, block), triton.cdiv(seqlen_k, block), batch * heads)
    dropout_mask_kernel[grid](keep, rng_state, heads, seqlen_q, seqlen_k, dropout_p, BLOCK_M=block, BLOCK_N=block)
    return keep.bool()


def split_of_globals(q, fmt: QKVFormat, cp: int, cu_seqlens=None, cu_seqlens_padded=None,
                     stripe: Optional[int] = None) -> SeqSplit:
    """Rank 0's :class:`SeqSplit` of global (whole-sequence) tensors; ``with_rank`` gives the others. ``stripe``:
    the Striped order of such stripes (thd: over the packed row) instead of the dual-chunk one."""
    total = q.shape[0 if fmt == QKVFormat.THD else _seq_dim(fmt)]
    striped = {} if stripe is None else dict(balance=LoadBalance.STRIPED, rounds=total // (cp * stripe))
    if fmt == QKVFormat.THD:
        padded = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        bounds = [int(x) for x in host_values(padded)]
        lengths = [int(x) for x in host_values(cu_seqlens[1:] - cu_seqlens[:-1])]
        return SeqSplit(fmt, cp, 0, starts=tuple(bounds[:-1]),
                        padded=tuple(e - s for s, e in zip(bounds[:-1], bounds[1:])), lengths=tuple(lengths),
                        **striped)
    return SeqSplit(fmt, cp, 0, seqlen=total, **striped)


def run_ranks_in_one_process(q, k, v, d_out, fmt: str, cp: int, causal: bool, softmax_scale: float,
                             deterministic: bool = True, cu_seqlens=None, cu_seqlens_padded=None,
                             stripe: Optional[int] = None):
    """Every rank's "all_gather"/"p2p" steps on one device, the exchanges as tensor copies: from the global
    q, k, v, d_out (global order) to the global (out, dq, dk, dv) assembled from the ranks' tokens (``stripe``:
    the ranks hold the Striped order's stripes)."""
    qkv_format = QKVFormat(fmt)
    sd = _seq_dim(qkv_format)
    base = split_of_globals(q, qkv_format, cp, cu_seqlens, cu_seqlens_padded, stripe)
    spec = FusedSpec(softmax_scale, causal, deterministic, tile_alignment(q, k, v, qkv_format, causal, deterministic))
    splits = [base.with_rank(r) for r in range(cp)]
    lse_dim = 1 if base.is_thd else 2
    outs, lses = zip(*(fused_forward_step(local_tokens(q, sd, s), k, v, s, spec) for s in splits))
    out_g, lse_g = assemble(outs, sd, base), assemble(lses, lse_dim, base)
    grads = [fused_backward_step(q, k, v, out_g, d_out, lse_g, s, spec) for s in splits]
    dq, dk, dv = (assemble([g[j] for g in grads], sd, base) for j in range(3))
    return out_g, dq, dk, dv


def zero_outside_sequences_reference(x: torch.Tensor, starts: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``kernels.fill.zero_outside_sequences`` in torch (any device, no Triton): the stand-in flash-attn-4
    backends' tests run it on CPU tensors without the interpreter."""
    t = x.shape[0]
    n = used.shape[0]
    edges = torch.zeros(t + 1, dtype=torch.int64, device=x.device)
    begin = starts[:n].to(torch.int64).clamp(0, t)
    edges.index_add_(0, begin, torch.ones(n, dtype=torch.int64, device=x.device))
    edges.index_add_(0, (begin + used.to(torch.int64)).clamp(0, t),
                     torch.full((n,), -1, dtype=torch.int64, device=x.device))
    inside = edges.cumsum(0)[:t] > 0
    x.data.masked_fill_(~inside.view(-1, 1, 1), 0)
    return x
