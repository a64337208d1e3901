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

Determinism and invariance: every sum over keys (softmax normaliser, ``P V``, ``dQ``) or queries
(``dK``, ``dV``) has one fixed structure (``common/attention/reduction.py``): fixed-shape block
products, combined by an adjacent-pair tree in which trailing zeros change no bit. So a sequence's
outputs and q/k/v gradients are bitwise the same alone, in any batch, padded to any length or
packed (THD), run after run. (A bias's or sink's gradient summed over a batch depends on the batch.)
The only index operations (THD packing) map each real token to exactly one place, so their backward
adds each gradient once and stays bitwise reproducible even where PyTorch uses atomics.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional, Tuple

import torch
import torch.nn.functional as F

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.reduction import KEY_BLOCK, QUERY_BLOCK, num_blocks
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


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Adjacent-pair tree sum over ``dim`` (removed), zero-padding odd levels (common/attention/reduction.py):
    trailing zeros along ``dim`` change no bit of the result. Only elementwise adds, so the order is
    the same for every shape and every thread count."""
    dim = dim % x.dim()
    if x.shape[dim] == 0:
        return x.new_zeros(x.shape[:dim] + x.shape[dim + 1:])
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            x = torch.cat([x, x.new_zeros(x.shape[:dim] + (1,) + x.shape[dim + 1:])], dim)
        x = x.unflatten(dim, (-1, 2))
        x = x.select(dim + 1, 0) + x.select(dim + 1, 1)
    return x.squeeze(dim)


def _pad_dim(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    pad = num_blocks(x.shape[dim], block) * block - x.shape[dim]
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[:dim] + (pad,) + x.shape[dim + 1:])], dim)


def _rows_to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, h, n, block, d] (zero-padded)."""
    return _pad_dim(x, 2, block).unflatten(2, (-1, block))


def _blocks_to_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """[b, h, n, block, d] -> [b, h, length, d]."""
    return x.flatten(2, 3)[:, :, :length]


def _matrix_to_blocks(x: torch.Tensor) -> torch.Tensor:
    """[b, h, sq, skv] -> [b, h, nq, nk, QUERY_BLOCK, KEY_BLOCK] (zero-padded)."""
    x = _pad_dim(_pad_dim(x, 2, QUERY_BLOCK), 3, KEY_BLOCK)
    return x.unflatten(3, (-1, KEY_BLOCK)).unflatten(2, (-1, QUERY_BLOCK)).permute(0, 1, 2, 4, 3, 5)


def _blocks_to_matrix(x: torch.Tensor, sq: int, skv: int) -> torch.Tensor:
    """Inverse of :func:`_matrix_to_blocks`."""
    b, h, nq, nk, bq, bk = x.shape
    return x.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nq * bq, nk * bk)[:, :, :sq, :skv]


def _block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over broadcast leading dims, as one bmm of row-major matrices of one fixed block shape:
    each product's contraction is then computed the same way whatever the batch, the sequence lengths
    and the number of blocks (a bigger matmul lets the BLAS library choose its blocking by size)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = math.prod(lead)
    a3 = a.expand(lead + a.shape[-2:]).reshape((n,) + a.shape[-2:]).contiguous()
    b3 = b.expand(lead + b.shape[-2:]).reshape((n,) + b.shape[-2:]).contiguous()
    return torch.bmm(a3, b3).view(lead + (a.shape[-2], b.shape[-1]))


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """GQA: key/value head ``i`` serves query heads ``i * group .. (i + 1) * group - 1``."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x.unsqueeze(2).expand(b, h, group, s, d).reshape(b, h * group, s, d)


def _sum_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """Backward of :func:`_expand_heads`: the group's gradients summed in the tree order."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return _tree_sum(x.view(b, h // group, group, s, d), 2)


class _BlockedScores(torch.autograd.Function):
    """``q k^T`` ([b, h, sq, d] x [b, h_kv, skv, d] -> [b, h, sq, skv]) in fixed block products;
    dq sums over key blocks and dk over query blocks (and the GQA group) in the tree order. The
    backward recomputes the blocks from the saved inputs, so that it is differentiable again."""

    @staticmethod
    def forward(ctx, q, k, group: int):
        qb = _rows_to_blocks(q, QUERY_BLOCK)  # [b, h, nq, BQ, d]
        kb = _rows_to_blocks(_expand_heads(k, group), KEY_BLOCK)  # [b, h, nk, BK, d]
        ctx.save_for_backward(q, k)
        ctx.group, ctx.sq, ctx.skv = group, q.shape[2], k.shape[2]
        s = _block_matmul(qb.unsqueeze(3), kb.transpose(-1, -2).unsqueeze(2))  # [b, h, nq, nk, BQ, BK]
        return _blocks_to_matrix(s, ctx.sq, ctx.skv)

    @staticmethod
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        qb = _rows_to_blocks(q, QUERY_BLOCK)
        kb = _rows_to_blocks(_expand_heads(k, ctx.group), KEY_BLOCK)
        dsb = _matrix_to_blocks(ds)
        dq = dk = None
        if ctx.needs_input_grad[0]:
            dq = _tree_sum(_block_matmul(dsb, kb.unsqueeze(2)), 3)  # [b, h, nq, BQ, d]
            dq = _blocks_to_rows(dq, ctx.sq)
        if ctx.needs_input_grad[1]:
            dk = _tree_sum(_block_matmul(dsb.transpose(-1, -2), qb.unsqueeze(3)), 2)  # [b, h, nk, BK, d]
            dk = _sum_heads(_blocks_to_rows(dk, ctx.skv), ctx.group)
        return dq, dk, None


class _BlockedProbsV(torch.autograd.Function):
    """``p v`` ([b, h, sq, skv] x [b, h_kv, skv, d_v]) summed over key blocks in the tree order;
    dp in the same block products, dv summed over query blocks (and the GQA group) in the tree order."""

    @staticmethod
    def forward(ctx, p, v, group: int):
        pb = _matrix_to_blocks(p)  # [b, h, nq, nk, BQ, BK]
        vb = _rows_to_blocks(_expand_heads(v, group), KEY_BLOCK)  # [b, h, nk, BK, dv]
        ctx.save_for_backward(p, v)
        ctx.group, ctx.sq, ctx.skv = group, p.shape[2], p.shape[3]
        out = _tree_sum(_block_matmul(pb, vb.unsqueeze(2)), 3)  # [b, h, nq, BQ, dv]
        return _blocks_to_rows(out, ctx.sq)

    @staticmethod
    def backward(ctx, dout):
        p, v = ctx.saved_tensors
        pb = _matrix_to_blocks(p)
        vb = _rows_to_blocks(_expand_heads(v, ctx.group), KEY_BLOCK)
        dob = _rows_to_blocks(dout, QUERY_BLOCK)  # [b, h, nq, BQ, dv]
        dp = dv = None
        if ctx.needs_input_grad[0]:
            dp = _block_matmul(dob.unsqueeze(3), vb.transpose(-1, -2).unsqueeze(2))  # [b, h, nq, nk, BQ, BK]
            dp = _blocks_to_matrix(dp, ctx.sq, ctx.skv)
        if ctx.needs_input_grad[1]:
            dv = _tree_sum(_block_matmul(pb.transpose(-1, -2), dob.unsqueeze(3)), 2)  # [b, h, nk, BK, dv]
            dv = _sum_heads(_blocks_to_rows(dv, ctx.skv), ctx.group)
        return dp, dv, None


def _softmax_parts(scores, keep, sink):
    """(p, p_sink): probabilities of the visible keys and of the sink logit (None without one)."""
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    s = torch.where(keep, scores, neg_inf)
    row_max = s.detach().amax(dim=-1, keepdim=True)
    if sink is not None:
        sink_col = sink.view(1, -1, 1, 1)
        row_max = torch.maximum(row_max, sink_col.detach())
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(s - row_max)
    denom = _tree_sum(e, -1).unsqueeze(-1)
    if sink is not None:
        e_sink = torch.exp(sink_col - row_max)
        denom = denom + e_sink
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    return e / denom, (e_sink / denom if sink is not None else None)


class _MaskedSoftmax(torch.autograd.Function):
    """Softmax over keys of the visible scores; sums over keys in the tree order (the row max is
    exact in any order). The backward recomputes the probabilities from the saved inputs, so that it
    is differentiable again."""

    @staticmethod
    def forward(ctx, scores, keep, sink):
        ctx.save_for_backward(scores, keep, sink)
        return _softmax_parts(scores, keep, sink)[0]

    @staticmethod
    def backward(ctx, dp):
        scores, keep, sink = ctx.saved_tensors
        p, p_sink = _softmax_parts(scores, keep, sink)
        delta = _tree_sum(dp * p, -1).unsqueeze(-1)
        ds = p * (dp - delta)
        dsink = None
        if p_sink is not None and ctx.needs_input_grad[2]:
            dsink = -(p_sink * delta).sum(dim=(0, 2, 3))  # a per-head parameter: summed over the batch
        return ds, None, dsink


def _masked_softmax(scores: torch.Tensor, keep: torch.Tensor, sink: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax over the last dim of visible entries; rows with nothing visible are all zero.

    No NaN in values or gradients: hidden entries become exp(-inf) = 0 with zero derivative, and a
    row's normaliser is replaced by 1 when the row is empty. ``sink`` ([h] logits, sink softmax):
    one more always-visible logit per row of head h, in the normaliser only (no value vector).
    """
    if scores.shape[-1] == 0:  # no keys at all (s_kv = 0): every row is empty
        return scores
    if sink is not None:
        sink = sink.to(scores.dtype)
    return _MaskedSoftmax.apply(scores, keep.expand(scores.shape), sink)


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
    elif mask.is_padding() and cu_seqlens_q is not None:
        if cu_seqlens_kv is None:
            raise ValueError(f"`cu_seqlens_kv` must be given with `cu_seqlens_q` for attn_mask_type={mask.value!r}")
        _check_cu_args(cu_seqlens_q, cu_seqlens_kv, None, None, qkv_dims(q, fmt)[0], q.device)
    return unfused_math(
        q, k, v, fmt=fmt, mask=mask, window=window, softmax_scale=softmax_scale, bottom_right=bottom_right,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
        attention_mask=attention_mask, bias_type=bias_type, core_attention_bias=core_attention_bias,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_context=rng_context,
        softmax_type=AttnSoftmaxType(softmax_type), softmax_offset=softmax_offset, return_max_logit=return_max_logit)


def unfused_math(q, k, v, *, fmt: QKVFormat, mask: AttnMaskType, window: Tuple[int, int], softmax_scale: float,
                 bottom_right: bool, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                 cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None, attention_mask=None,
                 bias_type: AttnBiasType = AttnBiasType.NO_BIAS, core_attention_bias=None, alibi_slopes=None,
                 dropout_p: float = 0.0, rng_context=None,
                 softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX, softmax_offset=None,
                 return_max_logit: bool = False):
    """:func:`unfused_attention` on arguments already converted and checked (DotProductAttention's
    backend runner calls this), by keyword after q, k, v: ``window`` normalized, ``bottom_right``
    resolved, ``softmax_scale`` checked, q, k, v and the cu_seqlens' types and shapes checked (their
    values are checked here)."""
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
        if mask.is_padding() and cu_seqlens_q is not None:
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

    if bias_type in (AttnBiasType.PRE_SCALE_BIAS, AttnBiasType.POST_SCALE_BIAS):
        if core_attention_bias is None:
            raise ValueError(f"`core_attention_bias` must be given for core_attention_bias_type={bias_type.value!r}")
        bias_shape_name(core_attention_bias, b, hq, sq, skv)
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
        raise ValueError(f"`alibi_slopes` must have shape [{hq}] or [{b}, {hq}], got {tuple(alibi_slopes.shape)}")

    # Fixed reduction structure (common/attention/reduction.py): a row's bits do not depend on the
    # batch, on the padded lengths or on packing. GQA heads are expanded inside the blocked products.
    qc, kc, vc = qb.to(compute_dtype), kb.to(compute_dtype), vb.to(compute_dtype)
    scores = _BlockedScores.apply(qc, kc, group)
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
    out = _BlockedProbsV.apply(probs, vc, group).to(q.dtype)  # [b, hq, sq, dv]

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
