"""Unfused attention in PyTorch math: every feature, always deterministic, the reference path.

``unfused_attention`` computes ``softmax(scale * Q K^T + bias) V`` with explicit masks, in fp32
(fp64 for fp64 inputs) and returns the inputs' dtype. It covers what the fused kernels do not:
the ``arbitrary`` mask, ``pre_scale_bias``/``post_scale_bias``, ALiBi and dropout.

Mask semantics (TransformerEngine's, see :func:`normalize_window`): query ``i`` of a sequence
with ``len_q`` queries and ``len_kv`` keys sees key ``j`` when ``j < len_kv``, ``i < len_q`` and
``i + d - left <= j <= i + d + right`` (a bound of -1 is unbounded), where ``d`` is 0 for a
top-left diagonal and ``len_kv - len_q`` for a bottom-right one: ``causal``/``padding_causal`` are
top-left, the ``*_bottom_right`` masks bottom-right, and the other masks follow
``bottom_right_diagonal`` (default bottom-right; ``resolve_bottom_right_diagonal``). ALiBi uses the
same ``d``. Causal masks have ``right = 0``. ``arbitrary`` additionally hides every
position where ``attention_mask`` is True. Rows that see no key give zero output and zero
gradient (never NaN); padded positions of the output are zero. Sink softmax (``off-by-one``,
``learnable``) appends one always-visible logit per row to the softmax and drops its column after.

Determinism: every reduction is a plain PyTorch reduction or matmul; the only index
operations (THD packing) map each real token to exactly one place, so their backward adds
each gradient once and stays bitwise reproducible even where PyTorch uses atomics.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional, Tuple

import torch
import torch.nn.functional as F

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.validation import check_input_dtype, check_softmax_scale
from transformer_engine.pytorch.attention.config import (
    check_cu_seqlens, check_qkv, check_sequence_values, dtype_name, qkv_dims,
)

__all__ = [
    "unfused_attention",
    "unfused_math",
    "UnfusedDotProductAttention",
    "default_alibi_slopes",
    "bias_shape_name",
    "visible_mask",
]

_BIAS_SHAPES = ("1hss", "b1ss", "bhss", "11ss", "111s")  # TransformerEngine's bias shapes


def default_alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The ALiBi paper's geometric slopes for ``num_heads`` heads, fp32 ``[h]``.

    For a power of two ``n`` the slopes are ``2^(-8k/n)``, k = 1..n; other head counts take the
    slopes of the largest power of two below, then every other slope of the next power of two.
    """
    if num_heads < 1:
        raise ValueError(f"`num_heads` must be >= 1, got {num_heads}")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    if n < num_heads:
        slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def bias_shape_name(bias: torch.Tensor, batch: int, heads: int, sq: int, skv: int) -> str:
    """'1hss', 'b1ss', 'bhss', '11ss' or '111s' (one row of s_kv, broadcast over batch, heads and
    queries) for a post/pre-scale bias; ValueError otherwise."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4:
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(
            f"`core_attention_bias` must be a 4-D tensor of shape [1|b, 1|h, s_q, s_kv] or [1, 1, 1, s_kv] "
            f"(1hss, b1ss, bhss, 11ss or 111s), got {got}"
        )
    bb, bh, bq, bk = bias.shape
    if (bb, bh, bq, bk) == (1, 1, 1, skv):
        return "111s"
    if (bq, bk) != (sq, skv) or bb not in (1, batch) or bh not in (1, heads):
        raise ValueError(
            f"`core_attention_bias` must have shape [1|{batch}, 1|{heads}, {sq}, {skv}] or [1, 1, 1, {skv}] "
            f"(1hss, b1ss, bhss, 11ss or 111s), got {tuple(bias.shape)}"
        )
    if bb == 1:
        return "11ss" if bh == 1 else "1hss"
    return "b1ss" if bh == 1 else "bhss"


def _to_bhsd(x: torch.Tensor, fmt: QKVFormat) -> torch.Tensor:
    if fmt == QKVFormat.BSHD:
        return x.permute(0, 2, 1, 3)
    return x.permute(1, 2, 0, 3)  # sbhd


def _from_bhsd(x: torch.Tensor, fmt: QKVFormat) -> torch.Tensor:
    if fmt == QKVFormat.BSHD:
        return x.permute(0, 2, 1, 3)
    return x.permute(2, 0, 1, 3)


def _lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def _max_len(cu_seqlens: torch.Tensor, max_seqlen: Optional[int]) -> int:
    if max_seqlen is not None:
        return int(max_seqlen)
    return int(_lengths(cu_seqlens).max().item())  # one host sync; pass max_seqlen_* to avoid it


def _pack_index(starts: torch.Tensor, lengths: torch.Tensor, max_len: int, dummy: int) -> torch.Tensor:
    """[b, max_len] token indices of each padded slot; slots past a sequence's end point at ``dummy``."""
    pos = torch.arange(max_len, device=starts.device)
    idx = starts[:-1].long()[:, None] + pos[None, :]
    return torch.where(pos[None, :] < lengths[:, None], idx, torch.full_like(idx, dummy))


def _unpack_index(starts: torch.Tensor, lengths: torch.Tensor, max_len: int, total: int) -> torch.Tensor:
    """[total] padded-slot index (``b * max_len + pos``) of each packed token; gap tokens -> b*max_len."""
    b = lengths.shape[0]
    tok = torch.arange(total, device=starts.device)
    starts = starts.long()
    seq = torch.searchsorted(starts[:b].contiguous(), tok, right=True) - 1
    seq_c = seq.clamp(0, max(b - 1, 0))
    pos = tok - starts[seq_c]
    valid = (seq >= 0) & (pos < lengths[seq_c])
    return torch.where(valid, seq_c * max_len + pos, torch.full_like(tok, b * max_len))


def _pad_thd(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[t, h, d] -> [b, h, max_len, d] through ``index`` (dummy slots read an appended zero row)."""
    ext = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], dim=0)
    return ext[index].permute(0, 2, 1, 3)


def _unpad_thd(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[b, h, max_len, d] -> [t, h, d]; tokens in gaps between sequences read an appended zero row."""
    flat = x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])
    ext = torch.cat([flat, flat.new_zeros((1,) + tuple(flat.shape[1:]))], dim=0)
    return ext[index]


def visible_mask(
    sq: int,
    skv: int,
    attn_mask_type: AttnMaskType,
    window_size: Tuple[int, int],
    lengths_q: Optional[torch.Tensor] = None,
    lengths_kv: Optional[torch.Tensor] = None,
    device=None,
    bottom_right_diagonal: Optional[bool] = None,
) -> torch.Tensor:
    """Bool ``[b|1, 1, sq, skv]``: True where query ``i`` may see key ``j`` (before any arbitrary mask)."""
    mask = AttnMaskType(attn_mask_type)
    left, right = window_size
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    if lengths_q is not None:
        len_q = lengths_q.view(-1, 1, 1, 1)
        len_kv = lengths_kv.view(-1, 1, 1, 1)
        keep = (i < len_q) & (j < len_kv)
    else:
        len_q, len_kv = sq, skv
        keep = torch.ones(1, 1, sq, skv, dtype=torch.bool, device=device)
    bottom_right = resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "pytorch")
    diag = i + (len_kv - len_q) if bottom_right else i
    if left >= 0:
        keep = keep & (j >= diag - left)
    if right >= 0:
        keep = keep & (j <= diag + right)
    return keep


def _alibi_bias(slopes: torch.Tensor, sq: int, skv: int, bottom_right: bool, lengths_q, lengths_kv,
                dtype: torch.dtype) -> torch.Tensor:
    """``-slope * |j - (i + d)|`` with the diagonal ``d`` (0 unless ``bottom_right``); ``[b|1, h, sq, skv]``."""
    device = slopes.device
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(skv, device=device).view(1, 1, 1, skv)
    if not bottom_right:
        diag = i
    elif lengths_q is not None:
        diag = i + (lengths_kv - lengths_q).view(-1, 1, 1, 1)
    else:
        diag = i + (skv - sq)
    dist = (j - diag).abs().to(dtype)
    s = slopes.to(dtype)
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], s.shape[1], 1, 1)
    return -s * dist


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax over the last dim of visible entries; rows with nothing visible are all zero.

    No NaN in values or gradients: hidden entries become exp(-inf) = 0 with zero derivative, and a
    row's normaliser is replaced by 1 when the row is empty. ``sink`` ([h] logits, sink softmax):
    one more always-visible logit per row of head h, in the normaliser only (no value vector).
    """
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    scores = torch.where(keep, scores, neg_inf)
    if scores.shape[-1] == 0:  # no keys at all (s_kv = 0): every row is empty
        return scores
    if sink is not None:
        b, h, sq, _ = scores.shape
        column = sink.to(scores.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        scores = torch.cat([scores, column], dim=-1)
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return p[..., :-1] if sink is not None else p


def unfused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format: str,
    attn_mask_type: str,
    window_size: Optional[Tuple[int, int]],
    softmax_scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    attention_mask: Optional[torch.Tensor] = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_context: Optional[Callable[[], ContextManager]] = None,
    bottom_right_diagonal: Optional[bool] = None,
    return_max_logit: bool = False,
    softmax_type: str = "vanilla",
    softmax_offset: Optional[torch.Tensor] = None,
):
    """Scaled dot-product attention in PyTorch math; returns q's format with head dim d_v.

    Shapes as :func:`fused_attn_func`: ``bshd`` [b, s, h, d], ``sbhd`` [s, b, h, d], ``thd``
    [t, h, d] with ``cu_seqlens_*`` (int32 [b+1]) and optional ``cu_seqlens_*_padded`` (the packed
    start of each sequence when there are gaps). For padding masks in bshd/sbhd, ``cu_seqlens_*``
    give each sequence's real length (no cu_seqlens: no padding). Query head ``i`` uses key/value
    head ``i // (h_q // h_kv)``.

    ``attention_mask`` (``arbitrary`` only): bool, broadcastable to [b, h, s_q, s_kv], True = hidden.
    ``core_attention_bias``: [1|b, 1|h, s_q, s_kv], added after (``post_scale_bias``) or before
    (``pre_scale_bias``) the softmax scale. ``alibi_slopes``: fp32 [h] or [b, h] (default: the ALiBi
    paper's). ``dropout_p`` applies to the probabilities, under ``rng_context()`` when given.
    ``bottom_right_diagonal`` aligns sliding windows and ALiBi (module docstring).

    ``return_max_logit=True`` returns ``(out, max_logit)``: ``max_logit`` [h_q] (q's dtype, no
    gradient) is the largest score ``scale * q k^T + bias`` (ALiBi included) any visible
    (query, key) pair of head ``h`` has in the batch, before dropout; ``-inf`` for a head with
    no visible pair.

    ``softmax_type`` ``"off-by-one"`` / ``"learnable"`` add a sink logit (0 / ``softmax_offset``,
    [h] or [1, h, 1, 1], not scaled) to every row's normaliser, as :func:`fused_attn_func`;
    dropout then applies to the probabilities of the real keys.
    """
    fmt = QKVFormat(qkv_format)
    mask = AttnMaskType(attn_mask_type)
    bias_type = AttnBiasType(core_attention_bias_type)
    window = normalize_window(window_size, mask)
    bottom_right = resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "pytorch")
    check_qkv(q, k, v, fmt)
    check_input_dtype([("query_layer", dtype_name(q.dtype))], ("float16", "bfloat16", "float32", "float64"),
                      "the unfused path")
    softmax_scale = check_softmax_scale(softmax_scale)
    if fmt == QKVFormat.THD:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format='thd'")
        _check_cu_args(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, None, q.device)
    elif mask.is_padding and cu_seqlens_q is not None:
        if cu_seqlens_kv is None:
            raise ValueError(f"`cu_seqlens_kv` must be given with `cu_seqlens_q` for attn_mask_type={mask.value!r}")
        _check_cu_args(cu_seqlens_q, cu_seqlens_kv, None, None, qkv_dims(q, fmt)[0], q.device)
    return unfused_math(
        q, k, v, fmt, mask, window, softmax_scale, bottom_right, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
        cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv, attention_mask, bias_type, core_attention_bias,
        alibi_slopes, dropout_p, rng_context, AttnSoftmaxType(softmax_type), softmax_offset, return_max_logit)


def unfused_math(q, k, v, fmt: QKVFormat, mask: AttnMaskType, window: Tuple[int, int], softmax_scale: float,
                 bottom_right: bool, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                 max_seqlen_q, max_seqlen_kv, attention_mask, bias_type: AttnBiasType, core_attention_bias,
                 alibi_slopes, dropout_p: float, rng_context, softmax_type: AttnSoftmaxType, softmax_offset,
                 return_max_logit: bool = False):
    """:func:`unfused_attention` on arguments already converted and checked (DotProductAttention's
    backend runner calls this): ``window`` normalized, ``bottom_right`` resolved, ``softmax_scale``
    checked, q, k, v and the cu_seqlens' types and shapes checked (their values are checked here)."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    hq, hk = q.shape[-2], k.shape[-2]
    group = hq // hk

    lengths_q = lengths_kv = None
    if fmt == QKVFormat.THD:
        check_sequence_values(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                              max_seqlen_q, max_seqlen_kv)
        lengths_q, lengths_kv = _lengths(cu_seqlens_q), _lengths(cu_seqlens_kv)
        sq, skv = _max_len(cu_seqlens_q, max_seqlen_q), _max_len(cu_seqlens_kv, max_seqlen_kv)
        starts_q = cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q
        starts_kv = cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv
        idx_q = _pack_index(starts_q, lengths_q, sq, q.shape[0])
        idx_kv = _pack_index(starts_kv, lengths_kv, skv, k.shape[0])
        qb, kb, vb = _pad_thd(q, idx_q), _pad_thd(k, idx_kv), _pad_thd(v, idx_kv)
    else:
        qb, kb, vb = _to_bhsd(q, fmt), _to_bhsd(k, fmt), _to_bhsd(v, fmt)
        sq, skv = qb.shape[2], kb.shape[2]
        if mask.is_padding and cu_seqlens_q is not None:
            check_sequence_values(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, None, None, sq, skv)
            lengths_q, lengths_kv = _lengths(cu_seqlens_q), _lengths(cu_seqlens_kv)
            # Padded positions are often uninitialised memory: they must contribute exactly nothing
            # (0 * NaN in P @ V or in the gradients' products would not), so they become zeros.
            valid_q = (torch.arange(sq, device=q.device)[None, :] < lengths_q[:, None]).view(-1, 1, sq, 1)
            valid_kv = (torch.arange(skv, device=q.device)[None, :] < lengths_kv[:, None]).view(-1, 1, skv, 1)
            qb = torch.where(valid_q, qb, qb.new_zeros(()))
            kb = torch.where(valid_kv, kb, kb.new_zeros(()))
            vb = torch.where(valid_kv, vb, vb.new_zeros(()))
    b = qb.shape[0]

    keep = visible_mask(sq, skv, mask, window, lengths_q, lengths_kv, device=q.device,
                        bottom_right_diagonal=bottom_right)
    if mask == AttnMaskType.ARBITRARY_MASK:
        if attention_mask is None:
            raise ValueError("`attention_mask` must be given for attn_mask_type='arbitrary'")
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"`attention_mask` must be a bool tensor (True = masked out), got {attention_mask.dtype}")
        try:
            torch.broadcast_shapes(attention_mask.shape, (b, hq, sq, skv))
        except RuntimeError:
            raise ValueError(
                f"`attention_mask` must broadcast to [b, h, s_q, s_kv] = {[b, hq, sq, skv]}, "
                f"got {tuple(attention_mask.shape)}"
            ) from None
        keep = keep & ~attention_mask.to(q.device)

    # GQA: expand (a view; its backward is a fixed-order sum over the group) instead of indexing.
    def expand(x: torch.Tensor) -> torch.Tensor:
        if group == 1:
            return x
        bx, hx, sx, dx = x.shape
        return x.unsqueeze(2).expand(bx, hx, group, sx, dx).reshape(bx, hx * group, sx, dx)

    if bias_type in (AttnBiasType.PRE_SCALE_BIAS, AttnBiasType.POST_SCALE_BIAS):
        if core_attention_bias is None:
            raise ValueError(f"`core_attention_bias` must be given for core_attention_bias_type={bias_type.value!r}")
        bias_shape_name(core_attention_bias, b, hq, sq, skv)
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
        raise ValueError(f"`alibi_slopes` must have shape [{hq}] or [{b}, {hq}], got {tuple(alibi_slopes.shape)}")

    qc, kc, vc = qb.to(compute_dtype), expand(kb).to(compute_dtype), expand(vb).to(compute_dtype)
    scores = torch.matmul(qc, kc.transpose(-1, -2))
    if bias_type == AttnBiasType.PRE_SCALE_BIAS:
        scores = (scores + core_attention_bias.to(compute_dtype)) * softmax_scale
    else:
        scores = scores * softmax_scale
        if bias_type == AttnBiasType.POST_SCALE_BIAS:
            scores = scores + core_attention_bias.to(compute_dtype)
        elif bias_type == AttnBiasType.ALIBI:
            slopes = alibi_slopes if alibi_slopes is not None else default_alibi_slopes(hq, q.device)
            scores = scores + _alibi_bias(slopes.to(q.device), sq, skv, bottom_right, lengths_q, lengths_kv,
                                          compute_dtype)
    max_logit = None
    if return_max_logit:
        hidden = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
        max_logit = torch.where(keep, scores.detach(), hidden).amax(dim=(0, 2, 3)).to(q.dtype)
    stype = softmax_type
    sink = None
    if stype.is_learnable:
        if softmax_offset is None or softmax_offset.numel() != hq:
            got = None if softmax_offset is None else tuple(softmax_offset.shape)
            raise ValueError(f"`softmax_offset` must have shape [{hq}] or [1, {hq}, 1, 1] with "
                             f"softmax_type='learnable', got {got}")
        sink = softmax_offset.reshape(hq).to(device=q.device)
    elif stype.has_sink and softmax_offset is not None:  # off-by-one's zero tensor (it may want a gradient)
        sink = softmax_offset.reshape(hq).to(device=q.device)
    elif stype.has_sink:
        sink = torch.zeros(hq, dtype=compute_dtype, device=q.device)
    probs = _masked_softmax(scores, keep, sink)
    if dropout_p > 0.0:
        with (rng_context() if rng_context is not None else contextlib.nullcontext()):
            probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs, vc).to(q.dtype)  # [b, hq, sq, dv]

    if fmt == QKVFormat.THD:
        out = _unpad_thd(out, _unpack_index(starts_q, lengths_q, sq, q.shape[0]))
    else:
        if lengths_q is not None:  # padded rows are zero, and pass no gradient (dO there may be NaN too)
            out = torch.where(valid_q, out, out.new_zeros(()))
        out = _from_bhsd(out, fmt)
    return (out, max_logit) if return_max_logit else out


def _check_cu_args(cu_q, cu_kv, pad_q, pad_kv, batch: Optional[int], device) -> None:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_kv", cu_kv), ("cu_seqlens_q_padded", pad_q),
                     ("cu_seqlens_kv_padded", pad_kv)):
        check_cu_seqlens(name, cu, batch, device)
    if cu_q.shape != cu_kv.shape:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must have the same length, got {cu_q.shape[0]} "
                         f"and {cu_kv.shape[0]}")


class UnfusedDotProductAttention(torch.nn.Module):
    """Module form of :func:`unfused_attention` with dropout and an RNG tracker, like TransformerEngine's."""

    def __init__(self, softmax_scale: float, attention_dropout: float = 0.0,
                 get_rng_state_tracker: Optional[Callable] = None) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.get_rng_state_tracker = get_rng_state_tracker

    def _rng_context(self) -> Optional[Callable[[], ContextManager]]:
        if self.get_rng_state_tracker is None:
            return None
        return lambda: self.get_rng_state_tracker().fork()

    def forward(self, q, k, v, qkv_format: str, attn_mask_type: str,
                window_size: Optional[Tuple[int, int]] = None, **kwargs) -> torch.Tensor:
        dropout = self.attention_dropout if self.training else 0.0
        return unfused_attention(q, k, v, qkv_format, attn_mask_type, window_size, self.softmax_scale,
                                 dropout_p=dropout, rng_context=self._rng_context(), **kwargs)
