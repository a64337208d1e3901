"""The fused attention function: one autograd.Function over the custom ops."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.pytorch.attention import ops  # noqa: F401  (registers the custom ops)

__all__ = ["fused_attn_func", "FusedAttnFunc"]


class FusedAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
                max_seqlen_q, max_seqlen_kv, softmax_scale, attn_mask_type, window_left, window_right,
                deterministic):
        out, lse = torch.ops.transformer_engine.fused_attn_fwd(
            q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv,
            max_seqlen_q, max_seqlen_kv, softmax_scale, attn_mask_type, window_left, window_right)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv, seq_offsets_q, seq_offsets_kv)
        ctx.static = (qkv_format, max_seqlen_q, max_seqlen_kv, softmax_scale, attn_mask_type,
                      window_left, window_right, deterministic)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, cu_q, cu_kv, off_q, off_kv = ctx.saved_tensors
        fmt, max_q, max_kv, scale, mask, left, right, deterministic = ctx.static
        dq, dk, dv = torch.ops.transformer_engine.fused_attn_bwd(
            q, k, v, out, d_out.contiguous(), lse, fmt, cu_q, cu_kv, off_q, off_kv,
            max_q, max_kv, scale, mask, left, right, deterministic)
        return (dq, dk, dv) + (None,) * 12


def _check_cu_seqlens(name: str, cu: Optional[torch.Tensor], batch: Optional[int]) -> None:
    if cu is None:
        return
    if cu.dtype != torch.int32:
        raise ValueError(f"`{name}` must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"`{name}` must be 1-D of length batch + 1 >= 2, got shape {tuple(cu.shape)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"`{name}` must have length batch + 1 = {batch + 1}, got {cu.shape[0]}")


def fused_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format: str,
    attn_mask_type: str,
    window_size: Tuple[int, int],
    softmax_scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Fused scaled-dot-product attention on the project's Triton kernels.

    Shapes: ``bshd`` [b, s, h, d], ``sbhd`` [s, b, h, d], ``thd`` [t, h, d] (tokens of all
    sequences packed, delimited by ``cu_seqlens_*``; ``cu_seqlens_*_padded`` give the packed
    starts when sequences are separated by gaps). Any strides. Query head ``i`` uses key/value
    head ``i // (h_q // h_kv)`` (GQA/MQA). For padding masks in bshd/sbhd, ``cu_seqlens_*`` give
    each sequence's real length; outputs and gradients at padded positions are zero. Rows that
    see no key output zeros. The output has q's format and head dim d_v.

    Determinism: the forward is always deterministic; with ``deterministic=True`` the backward
    uses no atomics, sums in a fixed order and fixed tiles, so gradients are bitwise
    reproducible and independent of batch composition and of packing (thd vs padded).
    """
    fmt = QKVFormat(qkv_format)
    mask = AttnMaskType(attn_mask_type)
    if fmt == QKVFormat.THD:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format='thd'")
        if max_seqlen_q is None or max_seqlen_kv is None:
            # One host sync; pass max_seqlen_* to avoid it (and to trace under torch.compile).
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
            max_seqlen_kv = int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max().item())
        batch = None
    else:
        batch = q.shape[0] if fmt == QKVFormat.BSHD else q.shape[1]
        if not mask.is_padding:
            cu_seqlens_q = cu_seqlens_kv = None
        elif cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must be given for attn_mask_type={mask.value!r}")
        cu_seqlens_q_padded = cu_seqlens_kv_padded = None
        sq = q.shape[1] if fmt == QKVFormat.BSHD else q.shape[0]
        sk = k.shape[1] if fmt == QKVFormat.BSHD else k.shape[0]
        max_seqlen_q, max_seqlen_kv = sq, sk
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                     ("cu_seqlens_q_padded", cu_seqlens_q_padded), ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
        _check_cu_seqlens(name, cu, batch)
    if cu_seqlens_q is not None and cu_seqlens_kv is not None and cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(
            f"`cu_seqlens_q` and `cu_seqlens_kv` must have the same length, got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_kv.shape[0]}"
        )
    if (cu_seqlens_q_padded is None) != (cu_seqlens_kv_padded is None):
        # One side padded: the other side's sequences start where its cu_seqlens say.
        cu_seqlens_q_padded = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        cu_seqlens_kv_padded = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
    # Self-attention usually passes one tensor for q and kv; autograd.Function.apply under
    # dynamo breaks the graph on duplicate tensor inputs, so "same as q" travels as None.
    if cu_seqlens_kv is cu_seqlens_q:
        cu_seqlens_kv = None
    if cu_seqlens_kv_padded is cu_seqlens_q_padded:
        cu_seqlens_kv_padded = None
    return FusedAttnFunc.apply(
        q, k, v, fmt.value, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
        int(max_seqlen_q), int(max_seqlen_kv), float(softmax_scale), mask.value,
        int(window_size[0]), int(window_size[1]), bool(deterministic))
