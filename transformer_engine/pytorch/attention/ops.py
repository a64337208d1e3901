"""torch.library custom ops for the fused attention forward and backward.

Opaque to torch.compile (with fake implementations for shapes), so a compiled model traces
the attention call without graph breaks. Eager calls on plain tensors skip the op's dispatch
(:func:`forward` / :func:`backward`): it costs more host time than the launches themselves, and a
small step's kernels wait for it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.attention import AttnMaskType, AttnSoftmaxType, BackwardGrads, QKVFormat
from transformer_engine.pytorch.attention import launch
from transformer_engine.pytorch.attention.config import qkv_dims

__all__ = ["fused_attn_fwd", "fused_attn_bwd", "forward", "backward"]


def _batch_and_seqlen(q: torch.Tensor, fmt: QKVFormat, cu_seqlens_q: Optional[torch.Tensor], max_seqlen_q: int):
    if fmt == QKVFormat.THD:
        return cu_seqlens_q.shape[0] - 1, max_seqlen_q
    return qkv_dims(q, fmt)[:2]


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_kv: Optional[torch.Tensor],
    seq_offsets_q: Optional[torch.Tensor], seq_offsets_kv: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_kv: int, softmax_scale: float, attn_mask_type: str,
    window_left: int, window_right: int, bottom_right_diagonal: bool,
    bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    rng_state: Optional[torch.Tensor], dropout_p: float,
    softmax_type: str = "vanilla", softmax_offset: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse). ``softmax_offset``: the sink logits (fp32 [h_q]) for sink softmax types."""
    fmt = QKVFormat(qkv_format)
    seqs = launch.sequences(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
                            max_seqlen_q, max_seqlen_kv)
    mods = launch.ScoreMods(bias, alibi_slopes, dropout_p, rng_state, AttnSoftmaxType(softmax_type), softmax_offset)
    return launch.forward(q, k, v, fmt, seqs, softmax_scale, AttnMaskType(attn_mask_type),
                          (window_left, window_right), mods=mods, bottom_right_diagonal=bottom_right_diagonal)


fused_attn_fwd = torch.library.custom_op("transformer_engine::fused_attn_fwd", _forward, mutates_args=())


@fused_attn_fwd.register_fake
def _(q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
      max_seqlen_q, max_seqlen_kv, softmax_scale, attn_mask_type, window_left, window_right, bottom_right_diagonal,
      bias, alibi_slopes, rng_state, dropout_p, softmax_type="vanilla", softmax_offset=None):
    fmt = QKVFormat(qkv_format)
    batch, sq = _batch_and_seqlen(q, fmt, cu_seqlens_q, max_seqlen_q)
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    lse = q.new_empty((batch, q.shape[-2], sq), dtype=torch.float32)
    return out, lse


def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, d_out: torch.Tensor,
    lse: torch.Tensor, qkv_format: str,
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_kv: Optional[torch.Tensor],
    seq_offsets_q: Optional[torch.Tensor], seq_offsets_kv: Optional[torch.Tensor],
    max_seqlen_q: int, max_seqlen_kv: int, softmax_scale: float, attn_mask_type: str,
    window_left: int, window_right: int, bottom_right_diagonal: bool,
    bias: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
    rng_state: Optional[torch.Tensor], dropout_p: float, bias_grad: bool,
    softmax_type: str = "vanilla", softmax_offset: Optional[torch.Tensor] = None,
    softmax_offset_grad: bool = False, grads: str = BackwardGrads.DQ_DKDV.value,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, d_softmax_offset); dbias is an empty tensor unless ``bias_grad``,
    d_softmax_offset (fp32 [h_q]) unless ``softmax_offset_grad``. ``grads`` (a :class:`BackwardGrads`
    value): ``"dq+dkdv"`` the whole backward; ``"dq"`` runs no dK/dV pass and returns dk, dv as empty
    tensors (numel 0); ``"dkdv"`` no dQ pass, dq empty. A requested gradient is bitwise the whole
    backward's (the same launches, fewer of them). The same kernels in both determinism modes (each sum
    in a fixed order, no atomics), so the op takes no determinism flag."""
    which = _grads(grads)
    fmt = QKVFormat(qkv_format)
    seqs = launch.sequences(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
                            max_seqlen_q, max_seqlen_kv)
    mods = launch.ScoreMods(bias, alibi_slopes, dropout_p, rng_state, AttnSoftmaxType(softmax_type), softmax_offset)
    dq, dk, dv, dbias, d_offset = launch.backward(q, k, v, out, d_out, lse, fmt, seqs, softmax_scale,
                                                  AttnMaskType(attn_mask_type), (window_left, window_right),
                                                  mods=mods, bias_grad=bias_grad,
                                                  bottom_right_diagonal=bottom_right_diagonal,
                                                  softmax_offset_grad=softmax_offset_grad, grads=which)
    return (dq if dq is not None else q.new_empty(0), dk if dk is not None else k.new_empty(0),
            dv if dv is not None else v.new_empty(0), dbias if dbias is not None else q.new_empty(0),
            d_offset if d_offset is not None else lse.new_empty(0))


fused_attn_bwd = torch.library.custom_op("transformer_engine::fused_attn_bwd", _backward, mutates_args=())


@fused_attn_bwd.register_fake
def _(q, k, v, out, d_out, lse, qkv_format, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
      max_seqlen_q, max_seqlen_kv, softmax_scale, attn_mask_type, window_left, window_right, bottom_right_diagonal,
      bias, alibi_slopes, rng_state, dropout_p, bias_grad, softmax_type="vanilla", softmax_offset=None,
      softmax_offset_grad=False, grads=BackwardGrads.DQ_DKDV.value):
    which = _grads(grads)
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    d_offset = lse.new_empty((q.shape[-2],)) if softmax_offset_grad else lse.new_empty(0)
    dq = q.new_empty(q.shape if which.has_dq else (0,))
    dk, dv = (t.new_empty(t.shape if which.has_dkdv else (0,)) for t in (k, v))
    return (dq, dk, dv, dbias, d_offset)


def _grads(grads: str) -> BackwardGrads:
    try:
        return BackwardGrads(grads)
    except ValueError:
        choices = ", ".join(repr(g.value) for g in BackwardGrads)
        raise ValueError(f"`grads` must be one of {choices}, got {grads!r}") from None


def _eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call may skip the op: not traced (torch.compile, export) and only plain tensors (no fake,
    functional or other subclass tensors, which need the op's dispatch)."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def forward(q, k, v, *args):
    """``fused_attn_fwd(q, k, v, *args)``: the op's implementation directly when :func:`_eager`."""
    return (_forward if _eager(q, k, v) else fused_attn_fwd)(q, k, v, *args)


def backward(q, k, v, out, d_out, lse, *args):
    """``fused_attn_bwd(q, k, v, out, d_out, lse, *args)``: the implementation directly when :func:`_eager`."""
    return (_backward if _eager(q, k, v, out, d_out, lse) else fused_attn_bwd)(q, k, v, out, d_out, lse, *args)
