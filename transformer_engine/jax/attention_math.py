"""Attention in jnp: masks, the dropout RNG, the unfused path and the fused primitives' CPU math.

Everything here works on the canonical tensors the primitives see:

- ``q`` ``[b, s_q, h_q, d_qk]``, ``k`` ``[b, s_kv, h_kv, d_qk]``, ``v`` ``[b, s_kv, h_kv, d_v]``
  (BSHD; SBHD and packed layouts are converted by the frontend, THD rows hold several segments);
  query head ``i`` reads key/value head ``i // (h_q // h_kv)`` (GQA/MQA).
- Sequence info: ``seqlens`` ``[b, m]`` and ``offsets`` ``[b, m + 1]`` per side (``m`` =
  max segments per row). Segment ``k`` of row ``r`` is tokens ``offsets[r, k] <= t <
  offsets[r, k] + seqlens[r, k]``; a token in no segment is padding.
- ``bias`` ``[1 | b, 1 | h_q, s_q, s_kv]`` or ``None``.
- ``seeds`` ``[b, h_q, 2]`` uint32: one dropout key per (row, head), so that a shard of the batch
  or of the heads draws the same mask as the whole array.

Visibility (TransformerEngine's semantics, see ``common.attention.config.normalize_window``):
query ``i`` sees key ``j`` when both lie in the same segment and, with positions counted from
the segment start, ``i + diag - left <= j <= i + diag + right`` (``-1`` = unbounded), where
``diag`` is ``len_kv - len_q`` of the segment when the diagonal is aligned bottom-right and 0 when
top-left: TransformerEngine-JAX aligns it bottom-right for the bottom-right causal masks only,
and ``bottom_right_diagonal`` moves it for the non-causal masks (``resolve_bottom_right_diagonal``).
Causal masks have ``right = 0``. A query that sees no key gets a zero output and
zero gradients.

The fused primitives' CPU lowering computes ``fused_fwd_math`` / ``fused_bwd_math`` (fp32
throughout, flash-attention's forward/backward equations with a saved log-sum-exp). The unfused
backend computes ``unfused_attention`` in fp32 with the PyTorch unfused path's fixed reduction
structure (``common/attention/reduction.py``; see "the fixed reduction structure" below), its
gradients from custom VJPs that keep that structure: a sequence's bits do not depend on the batch,
the padding or its place in a packed row.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.common.attention.config import resolve_bottom_right_diagonal
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType
from transformer_engine.common.attention.reduction import KEY_BLOCK, QUERY_BLOCK, num_blocks

__all__ = [
    "SeqInfo",
    "full_seq_info",
    "token_segments",
    "visibility_mask",
    "dropout_keep_mask",
    "head_seeds",
    "seed_words",
    "unfused_attention",
    "fused_fwd_math",
    "fused_row_max",
    "fused_bwd_math",
    "softmax_aux_shape",
    "lse_to_segments",
    "lse_to_tokens",
    "fixed_order_sum",
    "zero_padding",
    "sink_logits",
    "tree_sum",
    "blocked_scores",
    "blocked_probs_v",
]


class SeqInfo(NamedTuple):
    """Per-row segments of queries and keys/values (int32)."""

    q_seqlens: jax.Array  # [b, m]
    kv_seqlens: jax.Array  # [b, m]
    q_offsets: jax.Array  # [b, m + 1]
    kv_offsets: jax.Array  # [b, m + 1]


def full_seq_info(batch: int, s_q: int, s_kv: int) -> SeqInfo:
    """One segment per row covering every token (masks without padding)."""
    ones = jnp.ones((batch, 1), jnp.int32)
    return SeqInfo(
        ones * s_q,
        ones * s_kv,
        jnp.concatenate([0 * ones, ones * s_q], axis=1),
        jnp.concatenate([0 * ones, ones * s_kv], axis=1),
    )


def token_segments(seqlens: jax.Array, offsets: jax.Array, seqlen: int) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of a ``[b, seqlen]`` row: (segment number, 0 for padding; position in its
    segment; length of its segment)."""
    m = seqlens.shape[-1]
    starts = offsets[:, :m].astype(jnp.int32)
    lens = seqlens.astype(jnp.int32)
    t = jnp.arange(seqlen, dtype=jnp.int32)
    inside = (t[None, None, :] >= starts[:, :, None]) & (t[None, None, :] < (starts + lens)[:, :, None])
    inside_i = inside.astype(jnp.int32)  # [b, m, s]; segments do not overlap
    number = jnp.arange(1, m + 1, dtype=jnp.int32)
    segment = jnp.sum(inside_i * number[None, :, None], axis=1)
    pos = t[None, :] - jnp.sum(inside_i * starts[:, :, None], axis=1)
    length = jnp.sum(inside_i * lens[:, :, None], axis=1)
    return segment, pos, length


def visibility_mask(
    seq: SeqInfo,
    s_q: int,
    s_kv: int,
    attn_mask_type: AttnMaskType,
    window_size: Tuple[int, int],
    bottom_right_diagonal: Optional[bool] = None,
) -> jax.Array:
    """``[b, 1, s_q, s_kv]`` bool: which keys each query sees (``window_size`` normalized; the diagonal
    as ``resolve_bottom_right_diagonal(attn_mask_type, bottom_right_diagonal, "jax")``)."""
    seg_q, pos_q, len_q = token_segments(seq.q_seqlens, seq.q_offsets, s_q)
    seg_kv, pos_kv, len_kv = token_segments(seq.kv_seqlens, seq.kv_offsets, s_kv)
    visible = (seg_q[:, :, None] == seg_kv[:, None, :]) & (seg_q[:, :, None] > 0)
    mask = AttnMaskType(attn_mask_type)
    bottom_right = resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "jax")
    left, right = window_size
    if left >= 0 or right >= 0:
        diag = (len_kv[:, None, :] - len_q[:, :, None]) if bottom_right else 0
        rel = pos_kv[:, None, :] - pos_q[:, :, None] - diag  # j - (i + diag)
        if left >= 0:
            visible &= rel >= -left
        if right >= 0:
            visible &= rel <= right
    return visible[:, None, :, :]


# --- dropout: a counter-based hash of (per-head seed, query index, key index) -------------------

_GOLDEN = np.uint32(0x9E3779B9)
_KEY_MUL = np.uint32(0x85EBCA77)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that mixes every input bit into every output bit."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def seed_words(seed) -> jax.Array:
    """Two uint32 words from a PRNG key (typed or raw ``uint32[2]``) or an integer seed."""
    seed = jnp.asarray(seed) if not isinstance(seed, jax.Array) else seed
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    seed = seed.reshape(-1)
    if seed.dtype != jnp.uint32:
        seed = seed.astype(jnp.uint32)
    if seed.shape[0] == 1:
        seed = jnp.concatenate([seed, jnp.zeros((1,), jnp.uint32)])
    return seed[:2]


def head_seeds(words: jax.Array, batch: int, heads: int) -> jax.Array:
    """``[batch, heads, 2]`` uint32 dropout keys from two seed words, one per (row, head)."""
    r = jnp.arange(batch, dtype=jnp.uint32)[:, None]
    h = jnp.arange(heads, dtype=jnp.uint32)[None, :]
    counter = r * np.uint32(heads) + h
    k0 = _fmix32(words[0] ^ _fmix32(counter * _GOLDEN + np.uint32(1)))
    k1 = _fmix32(words[1] ^ _fmix32(counter * _KEY_MUL + np.uint32(2)))
    return jnp.stack([k0, k1], axis=-1)


def _dropout_keep(seeds: jax.Array, index_q: jax.Array, index_kv: jax.Array, rate: float) -> jax.Array:
    """``[b, h, s_q, s_kv]`` bool from ``[b, h, 2]`` keys and the row positions ``index_q`` ``[b|1, s_q]``
    and ``index_kv`` ``[b|1, s_kv]`` of each query and key: True where a probability is kept."""
    i = index_q.astype(jnp.uint32)[:, None, :, None]
    j = index_kv.astype(jnp.uint32)[:, None, None, :]
    k0 = seeds[..., 0][:, :, None, None]
    k1 = seeds[..., 1][:, :, None, None]
    x = _fmix32(k0 ^ (i * _GOLDEN))
    x = _fmix32(x ^ k1 ^ (j * _KEY_MUL))
    x = _fmix32(x + _GOLDEN)
    threshold = np.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))
    return x >= threshold


def dropout_keep_mask(seeds: jax.Array, s_q: int, s_kv: int, rate: float) -> jax.Array:
    """``[b, h, s_q, s_kv]`` bool: True where an attention probability is kept."""
    return _dropout_keep(seeds, jnp.arange(s_q, dtype=jnp.uint32)[None], jnp.arange(s_kv, dtype=jnp.uint32)[None],
                         rate)


# --- shared pieces ---------------------------------------------------------------------------------


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[b, s, h_q, d]`` -> ``[b, s, h_kv, g, d]``."""
    b, s, h, d = q.shape
    return q.reshape(b, s, num_kv_heads, h // num_kv_heads, d)


def _precision(dtype):
    """fp32 operands get true fp32 products, as the kernels' "ieee" dots (XLA's default on GPU is
    TF32, ~1e-3 off); lower-precision operands are exact in any mode."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# --- contractions that do not depend on the other rows (the deterministic CPU path) ---------------
#
# XLA's CPU dots pick their blocking and vector paths from the whole operand shapes, so a row of
# Q K^T (or of P V, dS K, dS^T Q) can change in its last bits with the number of rows or keys
# around it (measured: a 16-row chunk of queries against the same keys differs from the same rows
# of a 64-row call). In deterministic mode the fused primitives' CPU lowering contracts instead by
# elementwise products and ``fixed_order_sum``: each result element is then a function of its own
# operand rows and of the length of the summed axis only, like the GPU kernels' per-tile loops.
# That is what makes the context-parallel steps (row chunks of the same full-length key or query
# axis) bitwise equal to the single-device call. It costs memory (``d`` times the score matrix),
# which only the CPU tests pay.


def _positive_zero(x):
    """``x`` with -0.0 as +0.0: a sum of zero terms has the sign of its zeros, which depend on
    operands that the mask hides (a hidden key of the whole sequence is a padded zero in a chunk)."""
    return jnp.where(x == 0, jnp.zeros((), x.dtype), x)


def _grouped_rows(x, h_kv):
    """``[b, s, h, d]`` -> ``[b, h_kv, g, s, 1, d]`` (rows as the score matrix's first axis)."""
    return jnp.transpose(_group(x, h_kv), (0, 2, 3, 1, 4))[:, :, :, :, None, :]


def _kv_cols(x):
    """``[b, s_kv, h_kv, d]`` -> ``[b, h_kv, 1, 1, s_kv, d]`` (keys as the score matrix's second axis)."""
    return jnp.transpose(x, (0, 2, 1, 3))[:, :, None, None, :, :]


def _rows_dot_keys(x, k):
    """``sum_d x[b, i, h, d] k[b, j, h_kv, d]`` -> ``[b, h_kv, g, s_x, s_kv]``, row-independent."""
    return fixed_order_sum(_grouped_rows(x, k.shape[2]) * _kv_cols(k), axis=-1)


def _scores_times_keys(scores_g, k):
    """``sum_j scores[b, h, i, j] k[b, j, h_kv, d]`` (scores ``[b, h_kv, g, s_q, s_kv]``) -> ``[b, s_q, h_q, d]``."""
    b, h_kv, g, s_q, _ = scores_g.shape
    out = _positive_zero(fixed_order_sum(scores_g[..., None] * _kv_cols(k), axis=-2))  # [b, h_kv, g, s_q, d]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s_q, h_kv * g, k.shape[-1])


def _scores_times_rows(scores_g, x):
    """``sum_{g, i} scores[b, h, i, j] x[b, i, h, d]`` -> ``[b, s_kv, h_kv, d]``: queries in order, then
    the heads of each GQA group in order."""
    h_kv = scores_g.shape[1]
    prod = scores_g[..., None] * _grouped_rows(x, h_kv)  # [b, h_kv, g, s_q, s_kv, d]
    out = _positive_zero(fixed_order_sum(fixed_order_sum(prod, axis=3), axis=2))  # [b, h_kv, s_kv, d]
    return jnp.transpose(out, (0, 2, 1, 3))


def _logits(q, k, bias, scale, attn_bias_type, accum_dtype, invariant=False):
    """``[b, h_q, s_q, s_kv]`` scaled logits (plus bias), accumulated in ``accum_dtype``
    (``invariant``: row-independent contraction, see above)."""
    b, s_q, h_q, _ = q.shape
    h_kv = k.shape[2]
    if invariant:
        raw = _rows_dot_keys(q.astype(accum_dtype), k.astype(accum_dtype))
    else:
        raw = jnp.einsum("bqkgd,bskd->bkgqs", _group(q, h_kv), k, preferred_element_type=accum_dtype,
                         precision=_precision(q.dtype))
    raw = raw.reshape(b, h_q, s_q, k.shape[1])
    if bias is None or attn_bias_type == AttnBiasType.NO_BIAS:
        return raw * scale
    bias = bias.astype(accum_dtype)
    if attn_bias_type == AttnBiasType.PRE_SCALE_BIAS:
        return (raw + bias) * scale
    return raw * scale + bias


def fixed_order_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over ``axis`` as a pairwise tree of elementwise adds (zero-padded to a power of two).

    XLA's CPU reductions pick their vectorization from the whole array's shape, so one row's sum
    can change with the batch size; elementwise adds cannot. This keeps the CPU path bitwise
    invariant to batch size, head count and sharding, like the GPU kernels.
    """
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], width - n), x.dtype)], axis=-1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    x = x[..., 0]
    return jnp.expand_dims(x, axis) if keepdims else x


def sink_logits(softmax_type: AttnSoftmaxType, softmax_offset, num_heads: int) -> Optional[jax.Array]:
    """The sink logit of each query head (fp32 ``[h]``) for a softmax type: None for vanilla, zeros
    for off-by-one, ``softmax_offset`` (``[h]`` or ``[1, h, 1, 1]``) for learnable."""
    softmax_type = AttnSoftmaxType(softmax_type)
    if not softmax_type.has_sink:
        return None
    if not softmax_type.is_learnable:
        return jnp.zeros((num_heads,), jnp.float32)
    return jnp.reshape(softmax_offset, (num_heads,)).astype(jnp.float32)


def _masked_softmax(logits, visible, sink=None):
    """Softmax over keys restricted to ``visible``; (probabilities, log-sum-exp). Rows that see no
    key get zero probabilities and a log-sum-exp of +inf. ``sink`` (``[h]``, sink softmax): one more
    always-visible logit per row of head h, in the normaliser and the log-sum-exp only."""
    neg_inf = jnp.asarray(-jnp.inf, logits.dtype)
    # initial: a row of no keys at all (s_kv = 0) has max -inf like a fully masked one.
    row_max = jnp.max(jnp.where(visible, logits, neg_inf), axis=-1, keepdims=True, initial=-jnp.inf)
    any_visible = jnp.any(visible, axis=-1, keepdims=True)
    if sink is not None:
        column = jnp.broadcast_to(sink.astype(logits.dtype)[None, :, None, None], (*logits.shape[:-1], 1))
        row_max = jnp.maximum(row_max, column)
        any_visible = jnp.ones_like(any_visible)
    row_max = jax.lax.stop_gradient(jnp.where(any_visible, row_max, 0.0))
    # Mask before exp: exp(-inf) = 0 has a zero derivative, so hidden logits get no NaN gradient.
    exp = jnp.exp(jnp.where(visible, logits - row_max, neg_inf))
    denom = fixed_order_sum(exp, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(column - row_max)
    denom = jnp.where(any_visible, denom, 1.0)
    probs = exp / denom
    lse = jnp.where(any_visible, row_max + jnp.log(denom), jnp.inf)
    return probs, lse[..., 0]


def _apply_dropout(probs, seeds, rate):
    keep = dropout_keep_mask(seeds, probs.shape[-2], probs.shape[-1], rate)
    return jnp.where(keep, probs / (1.0 - rate), 0.0).astype(probs.dtype), keep


def _pv(probs, v, accum_dtype, invariant=False):
    """``[b, h_q, s_q, s_kv] x [b, s_kv, h_kv, d_v] -> [b, s_q, h_q, d_v]``."""
    b, h_q, s_q, s_kv = probs.shape
    h_kv = v.shape[2]
    p = probs.reshape(b, h_kv, h_q // h_kv, s_q, s_kv)
    if invariant:
        return _scores_times_keys(p.astype(accum_dtype), v.astype(accum_dtype))
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v, preferred_element_type=accum_dtype, precision=_precision(v.dtype))
    return out.reshape(b, s_q, h_q, v.shape[-1])


def softmax_aux_shape(batch: int, segments: int, num_heads: int, s_q: int) -> Tuple[int, ...]:
    """Shape of the saved log-sum-exp (fp32): ``[b, m, h_q, s_q]``, one row per sequence (segment
    ``k`` of row ``r``) indexed by position within that sequence, as the kernels store it; +inf
    past the sequence's end and for queries that see no key."""
    return (batch, segments, num_heads, s_q)


def lse_to_segments(lse_tokens: jax.Array, seq: SeqInfo, fill: float = float("inf")) -> jax.Array:
    """Per-token log-sum-exp ``[b, h, s_q]`` -> per-sequence layout ``[b, m, h, s_q]`` (``fill`` past each
    sequence's end; the row maxima use the same layout with ``-inf``)."""
    b, h, s_q = lse_tokens.shape
    m = seq.q_seqlens.shape[1]
    i = jnp.arange(s_q, dtype=jnp.int32)
    token = seq.q_offsets[:, :m, None].astype(jnp.int32) + i  # [b, m, s_q]
    inside = i < seq.q_seqlens[:, :, None]
    index = jnp.broadcast_to(jnp.clip(token, 0, s_q - 1)[:, :, None, :], (b, m, h, s_q))
    gathered = jnp.take_along_axis(jnp.broadcast_to(lse_tokens[:, None], (b, m, h, s_q)), index, axis=-1)
    return jnp.where(inside[:, :, None, :], gathered, jnp.asarray(fill, lse_tokens.dtype))


def lse_to_tokens(lse_segments: jax.Array, seq: SeqInfo) -> jax.Array:
    """Per-sequence log-sum-exp ``[b, m, h, s_q]`` -> per token ``[b, h, s_q]`` (+inf for padding)."""
    b, m, h, s_q = lse_segments.shape
    segment, pos, _ = token_segments(seq.q_seqlens, seq.q_offsets, s_q)  # [b, s_q]
    seg_index = jnp.clip(segment - 1, 0, m - 1)
    flat = lse_segments.transpose(0, 2, 1, 3).reshape(b, h, m * s_q)
    index = jnp.broadcast_to((seg_index * s_q + pos)[:, None, :], (b, h, s_q))
    gathered = jnp.take_along_axis(flat, index, axis=-1)
    return jnp.where((segment > 0)[:, None, :], gathered, jnp.inf)


def zero_padding(q, k, v, seq: SeqInfo):
    """q, k, v with every token outside all segments set to 0, and ``[b, s_q, 1, 1]`` True for the
    query tokens inside one. Padding is often uninitialised memory: it must contribute exactly
    nothing, and ``0 * NaN`` in P @ V or in the gradients' products would not (the kernels never
    load it)."""
    seg_q, _, _ = token_segments(seq.q_seqlens, seq.q_offsets, q.shape[1])
    seg_kv, _, _ = token_segments(seq.kv_seqlens, seq.kv_offsets, k.shape[1])
    in_q = (seg_q > 0)[:, :, None, None]
    in_kv = (seg_kv > 0)[:, :, None, None]
    zero = jnp.zeros((), q.dtype)
    return jnp.where(in_q, q, zero), jnp.where(in_kv, k, zero), jnp.where(in_kv, v, zero), in_q


# --- the fixed reduction structure of the unfused path (common/attention/reduction.py) --------------
#
# The unfused backend follows the PyTorch unfused path's structure: each sequence is laid out from
# position 0 in a slot of its own (a THD row's segments each get one), the products along the
# sequence axes are 64 x 64 block matmuls of one fixed shape, and every sum over keys or queries
# (softmax normaliser, P V, dQ, dK, dV, rowsum(dP * P)) and over the heads of a GQA group is an
# adjacent-pair tree whose trailing zeros change no bit. A sequence's bits then depend neither on
# the batch, nor on the padded length, nor on where it sits in a packed row. Gradients come from
# custom VJPs that keep the same structure (JAX's own transposes would reduce with XLA's
# shape-dependent reductions).


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Adjacent-pair tree sum over ``axis`` (removed), odd levels zero-padded: the order of
    ``common/attention/reduction.py``. Only elementwise adds, so a result element
    depends on its own operands and their positions only, and trailing zeros change no bit."""
    x = jnp.moveaxis(x, axis, -1)
    if x.shape[-1] == 0:
        return jnp.zeros(x.shape[:-1], x.dtype)
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = jnp.concatenate([x, jnp.zeros((*x.shape[:-1], 1), x.dtype)], axis=-1)
        x = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        x = x[..., 0] + x[..., 1]
    return x[..., 0]


def _pad_to_blocks(x, axis, block):
    pad = num_blocks(x.shape[axis], block) * block - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _rows_to_blocks(x, block):
    """``[B, h, s, d]`` -> ``[B, h, n, block, d]`` (zero-padded)."""
    x = _pad_to_blocks(x, 2, block)
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] // block, block, x.shape[3])


def _blocks_to_rows(x, length):
    """``[B, h, n, block, d]`` -> ``[B, h, length, d]``."""
    return x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])[:, :, :length]


def _matrix_to_blocks(x):
    """``[B, h, s_q, s_kv]`` -> ``[B, h, n_q, n_kv, QUERY_BLOCK, KEY_BLOCK]`` (zero-padded)."""
    x = _pad_to_blocks(_pad_to_blocks(x, 2, QUERY_BLOCK), 3, KEY_BLOCK)
    b, h, sq, skv = x.shape
    x = x.reshape(b, h, sq // QUERY_BLOCK, QUERY_BLOCK, skv // KEY_BLOCK, KEY_BLOCK)
    return jnp.transpose(x, (0, 1, 2, 4, 3, 5))


def _blocks_to_matrix(x, s_q, s_kv):
    b, h, nq, nk, bq, bk = x.shape
    return jnp.transpose(x, (0, 1, 2, 4, 3, 5)).reshape(b, h, nq * bq, nk * bk)[:, :, :s_q, :s_kv]


# Each block product's contraction is cut into runs of this many terms, summed by the pair tree:
# XLA's CPU dot of one small matrix pair accumulates its contraction in one sequential chain, which
# over 64 terms loses about twice the accuracy of XLA's whole-matrix dots (measured against fp64).
CONTRACTION_RUN = 16


def _block_matmul(a, b):
    """``a @ b`` over broadcast leading dims as batched dots of fixed-shape matrices (one block pair,
    one run of ``CONTRACTION_RUN`` contraction terms each, the runs summed by the pair tree): every
    product's contraction is then computed the same way whatever the batch, the lengths and the
    number of blocks (a larger dot lets XLA choose its blocking by size)."""
    k = a.shape[-1]
    if k > CONTRACTION_RUN:
        runs = num_blocks(k, CONTRACTION_RUN)
        a = _pad_to_blocks(a, a.ndim - 1, CONTRACTION_RUN)
        b = _pad_to_blocks(b, b.ndim - 2, CONTRACTION_RUN)
        a = jnp.moveaxis(a.reshape(a.shape[:-1] + (runs, CONTRACTION_RUN)), -2, -3)  # [..., runs, M, C]
        b = b.reshape(b.shape[:-2] + (runs, CONTRACTION_RUN, b.shape[-1]))  # [..., runs, C, N]
        return tree_sum(_block_dot(a, b), axis=-3)
    return _block_dot(a, b)


def _block_dot(a, b):
    """Batched dot over the broadcast leading dims (kept as batch dims, so that a sharded head
    axis stays sharded: no reshape merges it with the others)."""
    lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, lead + a.shape[-2:])
    b = jnp.broadcast_to(b, lead + b.shape[-2:])
    n = len(lead)
    batch = tuple(range(n))
    return jax.lax.dot_general(a, b, (((n + 1,), (n,)), (batch, batch)), precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=a.dtype)


def _expand_heads(x, group):
    """GQA ``[B, h_kv, s, d]`` -> ``[B, h_kv * group, s, d]``: key/value head ``i`` serves query heads
    ``i * group .. (i + 1) * group - 1``."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return jnp.broadcast_to(x[:, :, None], (b, h, group, s, d)).reshape(b, h * group, s, d)


def _sum_heads(x, group):
    """Backward of :func:`_expand_heads`: a group's gradients summed in the tree order."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return tree_sum(x.reshape(b, h // group, group, s, d), axis=2)


def _transpose_last(x):
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def blocked_scores(q, k, group: int):
    """``q k^T``: ``[B, h, s_q, d] x [B, h_kv, s_kv, d] -> [B, h, s_q, s_kv]`` in fixed block products;
    dq sums over key blocks and dk over query blocks (and the GQA group) in the tree order."""
    qb = _rows_to_blocks(q, QUERY_BLOCK)  # [B, h, nq, BQ, d]
    kb = _rows_to_blocks(_expand_heads(k, group), KEY_BLOCK)  # [B, h, nk, BK, d]
    s = _block_matmul(qb[:, :, :, None], _transpose_last(kb)[:, :, None])  # [B, h, nq, nk, BQ, BK]
    return _blocks_to_matrix(s, q.shape[2], k.shape[2])


def _blocked_scores_fwd(q, k, group):
    return blocked_scores(q, k, group), (q, k)


def _blocked_scores_bwd(group, res, ds):
    q, k = res
    qb = _rows_to_blocks(q, QUERY_BLOCK)
    kb = _rows_to_blocks(_expand_heads(k, group), KEY_BLOCK)
    dsb = _matrix_to_blocks(ds)
    dq = _blocks_to_rows(tree_sum(_block_matmul(dsb, kb[:, :, None]), axis=3), q.shape[2])
    dk = _blocks_to_rows(tree_sum(_block_matmul(_transpose_last(dsb), qb[:, :, :, None]), axis=2), k.shape[2])
    return dq, _sum_heads(dk, group)


blocked_scores.defvjp(_blocked_scores_fwd, _blocked_scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def blocked_probs_v(p, v, group: int):
    """``p v``: ``[B, h, s_q, s_kv] x [B, h_kv, s_kv, d_v] -> [B, h, s_q, d_v]`` summed over key blocks
    in the tree order; dp in the same block products, dv summed over query blocks (and the GQA group)
    in the tree order."""
    pb = _matrix_to_blocks(p)
    vb = _rows_to_blocks(_expand_heads(v, group), KEY_BLOCK)
    return _blocks_to_rows(tree_sum(_block_matmul(pb, vb[:, :, None]), axis=3), p.shape[2])


def _blocked_probs_v_fwd(p, v, group):
    return blocked_probs_v(p, v, group), (p, v)


def _blocked_probs_v_bwd(group, res, dout):
    p, v = res
    pb = _matrix_to_blocks(p)
    vb = _rows_to_blocks(_expand_heads(v, group), KEY_BLOCK)
    dob = _rows_to_blocks(dout, QUERY_BLOCK)  # [B, h, nq, BQ, dv]
    dp = _blocks_to_matrix(_block_matmul(dob[:, :, :, None], _transpose_last(vb)[:, :, None]), p.shape[2], p.shape[3])
    dv = _blocks_to_rows(tree_sum(_block_matmul(_transpose_last(pb), dob[:, :, :, None]), axis=2), v.shape[2])
    return dp, _sum_heads(dv, group)


blocked_probs_v.defvjp(_blocked_probs_v_fwd, _blocked_probs_v_bwd)


def _softmax_parts(scores, keep, sink):
    """(p, p_sink) of the visible scores; sink ``[h]`` or None. Rows that see nothing are zero."""
    neg_inf = jnp.asarray(-jnp.inf, scores.dtype)
    s = jnp.where(keep, scores, neg_inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)  # exact in any order
    if sink is not None:
        sink_col = sink.astype(scores.dtype)[None, :, None, None]
        row_max = jnp.maximum(row_max, sink_col)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.exp(s - row_max)
    denom = tree_sum(e, axis=-1)[..., None]
    e_sink = None
    if sink is not None:
        e_sink = jnp.exp(sink_col - row_max)
        denom = denom + e_sink
    denom = jnp.where(denom > 0, denom, 1.0)
    return e / denom, (None if sink is None else e_sink / denom)


@jax.custom_vjp
def _masked_softmax_blocked(scores, keep, sink):
    return _softmax_parts(scores, keep, sink)[0]


def _masked_softmax_blocked_fwd(scores, keep, sink):
    return _softmax_parts(scores, keep, sink)[0], (scores, keep, sink)


def _masked_softmax_blocked_bwd(res, dp):
    scores, keep, sink = res
    p, p_sink = _softmax_parts(scores, keep, sink)
    delta = tree_sum(dp * p, axis=-1)[..., None]
    ds = p * (dp - delta)
    dsink = None
    if sink is not None:  # a per-head parameter: summed over the batch (fixed order, batch-dependent)
        per_row = jnp.broadcast_to(-(p_sink * delta), delta.shape)[..., 0]  # [B, h, s_q]
        dsink = tree_sum(tree_sum(per_row, axis=2), axis=0).astype(sink.dtype)
    return ds, np.zeros(keep.shape, jax.dtypes.float0), dsink


_masked_softmax_blocked.defvjp(_masked_softmax_blocked_fwd, _masked_softmax_blocked_bwd)


# --- sequences in slots of their own (THD rows unpacked, offsets removed) -----------------------------


class _Slots(NamedTuple):
    """Where each sequence's tokens lie in the canonical rows: slot ``(r, k)`` holds segment ``k`` of
    row ``r`` from position 0."""

    index_q: jax.Array  # [b, m, s_q] row token of each slot position (clipped)
    index_kv: jax.Array  # [b, m, s_kv]
    valid_q: jax.Array  # [b, m, s_q] bool
    valid_kv: jax.Array  # [b, m, s_kv]
    len_q: jax.Array  # [b, m]
    len_kv: jax.Array  # [b, m]


def _slots(seq: SeqInfo, s_q: int, s_kv: int) -> _Slots:
    m = seq.q_seqlens.shape[1]

    def side(lens, offsets, s):
        lens = lens.astype(jnp.int32)
        pos = jnp.arange(s, dtype=jnp.int32)
        token = offsets[:, :m, None].astype(jnp.int32) + pos
        valid = (pos < lens[:, :, None]) & (token < s)
        return jnp.clip(token, 0, s - 1), valid, lens

    iq, vq, lq = side(seq.q_seqlens, seq.q_offsets, s_q)
    ik, vk, lk = side(seq.kv_seqlens, seq.kv_offsets, s_kv)
    return _Slots(iq, ik, vq, vk, lq, lk)


def _to_slots(x, index, valid):
    """``[b, s, h, d]`` -> ``[b * m, h, s, d]`` (each slot from position 0, zeros past its length)."""
    b, s, h, d = x.shape
    m = index.shape[1]
    g = jnp.take_along_axis(x[:, None], index[:, :, :, None, None], axis=2)  # [b, m, s, h, d]
    g = jnp.where(valid[:, :, :, None, None], g, jnp.zeros((), x.dtype))
    return jnp.transpose(g, (0, 1, 3, 2, 4)).reshape(b * m, h, s, d)


def _from_slots(x, seq: SeqInfo, s: int):
    """``[b * m, h, s, d]`` -> ``[b, s, h, d]`` rows (tokens in no segment are zero)."""
    m = seq.q_seqlens.shape[1]
    bm, h, _, d = x.shape
    b = bm // m
    segment, pos, _ = token_segments(seq.q_seqlens, seq.q_offsets, s)  # [b, s]
    flat = jnp.transpose(x.reshape(b, m, h, s, d), (0, 1, 3, 2, 4)).reshape(b, m * s, h, d)
    index = jnp.clip((segment - 1) * s + pos, 0, m * s - 1)
    rows = jnp.take_along_axis(flat, index[:, :, None, None], axis=1)
    return jnp.where((segment > 0)[:, :, None, None], rows, jnp.zeros((), x.dtype))


def _bias_to_slots(bias, slots: _Slots, batch: int):
    """``[1|b, 1|h, s_q, s_kv]`` -> ``[b * m, 1|h, s_q, s_kv]``: each sequence's block from (0, 0)."""
    _, hb, s_q, s_kv = bias.shape
    m = slots.index_q.shape[1]
    full = jnp.broadcast_to(bias, (batch, hb, s_q, s_kv))[:, None]  # [b, 1, hb, s_q, s_kv]
    rows = jnp.take_along_axis(full, slots.index_q[:, :, None, :, None], axis=3)
    blk = jnp.take_along_axis(rows, slots.index_kv[:, :, None, None, :], axis=4)  # [b, m, hb, s_q, s_kv]
    inside = slots.valid_q[:, :, None, :, None] & slots.valid_kv[:, :, None, None, :]
    return jnp.where(inside, blk, jnp.zeros((), bias.dtype)).reshape(batch * m, hb, s_q, s_kv)


def _slot_visibility(valid_q, valid_kv, len_q, len_kv, window_size, bottom_right):
    """``[B, 1, s_q, s_kv]`` bool for sequences laid out from position 0 (``valid_*``: ``[B, s]``
    real positions; ``len_*``: ``[B]`` their declared lengths, which place a bottom-right diagonal):
    the same rule as :func:`visibility_mask`, in sequence positions."""
    i = jnp.arange(valid_q.shape[1], dtype=jnp.int32)[None, :, None]
    j = jnp.arange(valid_kv.shape[1], dtype=jnp.int32)[None, None, :]
    lq, lk = len_q[:, None, None], len_kv[:, None, None]
    keep = valid_q[:, :, None] & valid_kv[:, None, :]
    left, right = window_size
    diag = i + (lk - lq) if bottom_right else i
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep[:, None]


# --- unfused backend (differentiated by JAX) --------------------------------------------------------


def unfused_attention(
    q, k, v, bias, seq: SeqInfo, seeds: Optional[jax.Array], *,
    attn_mask_type: AttnMaskType,
    attn_bias_type: AttnBiasType,
    window_size: Tuple[int, int],
    scaling_factor: float,
    dropout_probability: float,
    is_training: bool,
    bottom_right_diagonal: Optional[bool] = None,
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX,
    softmax_offset=None,
    return_max_logit: bool = False,
):
    """softmax(QK^T * scale + bias) V in fp32 (the inputs converted), returned in q's dtype,
    ``[b, s_q, h_q, d_v]``. Sink softmax (``softmax_type``) adds one logit per row (0, or
    ``softmax_offset[h]``, not scaled) to the normaliser; dropout applies to the keys' probabilities.
    ``return_max_logit``: returns ``(out, max_logit)``, ``max_logit`` ``[h_q]`` in q's dtype (no gradient):
    each head's largest ``scale * q k^T + bias`` over the visible (query, key) pairs of the batch, before
    dropout and without the sink (-inf for a head with none).

    Invariance (the fixed reduction structure above): a sequence's output rows and its q/k/v
    gradients are bitwise the same alone, in any batch, padded to any length or packed in a THD
    row at any offset, run after run, with any mask, window, bias, softmax type and GQA grouping.
    With dropout the mask is a function of (seed, row, head, query and key token positions in the
    row), so it holds when the sequence keeps its row and its offset. (A bias or sink gradient
    summed over the batch depends on the batch.) Each sequence occupies a slot of its own of the
    row's length: THD rows with ``m`` segments cost ``m`` times the work of one row.
    """
    # The common enums (or their string values); a frontend's own enum members are refused here.
    attn_mask_type, attn_bias_type = AttnMaskType(attn_mask_type), AttnBiasType(attn_bias_type)
    softmax_type = AttnSoftmaxType(softmax_type)
    b, s_q, h_q, _ = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    if s_kv == 0 or s_q == 0:
        out = jnp.zeros((b, s_q, h_q, v.shape[-1]), q.dtype)
        return (out, jnp.full((h_q,), -jnp.inf, q.dtype)) if return_max_logit else out
    compute = jnp.promote_types(q.dtype, jnp.float32)
    group = h_q // h_kv
    slots = _slots(seq, s_q, s_kv)
    m = slots.index_q.shape[1]
    flat = lambda x: x.reshape((b * m,) + x.shape[2:])  # noqa: E731
    qs = _to_slots(q.astype(compute), slots.index_q, slots.valid_q)
    ks = _to_slots(k.astype(compute), slots.index_kv, slots.valid_kv)
    vs = _to_slots(v.astype(compute), slots.index_kv, slots.valid_kv)
    bottom_right = resolve_bottom_right_diagonal(attn_mask_type, bottom_right_diagonal, "jax")
    keep = _slot_visibility(flat(slots.valid_q), flat(slots.valid_kv), flat(slots.len_q), flat(slots.len_kv),
                            window_size, bottom_right)
    scores = blocked_scores(qs, ks, group)
    if bias is not None and attn_bias_type != AttnBiasType.NO_BIAS:
        bias_s = _bias_to_slots(bias.astype(compute), slots, b)
        if attn_bias_type == AttnBiasType.PRE_SCALE_BIAS:
            scores = (scores + bias_s) * scaling_factor
        else:
            scores = scores * scaling_factor + bias_s
    else:
        scores = scores * scaling_factor
    max_logit = None
    if return_max_logit:  # a max: order-free, so the same bits whatever the batch and packing
        hidden = jnp.where(keep, jax.lax.stop_gradient(scores), -jnp.inf)
        max_logit = jnp.max(hidden, axis=(0, 2, 3), initial=-jnp.inf).astype(q.dtype)
    probs = _masked_softmax_blocked(scores, keep, sink_logits(softmax_type, softmax_offset, h_q))
    if is_training and dropout_probability > 0.0:
        seeds_s = jnp.broadcast_to(seeds[:, None], (b, m) + seeds.shape[1:]).reshape((b * m,) + seeds.shape[1:])
        kept = _dropout_keep(seeds_s, flat(slots.index_q), flat(slots.index_kv), dropout_probability)
        probs = jnp.where(kept, probs / (1.0 - dropout_probability), 0.0).astype(probs.dtype)
    out = blocked_probs_v(probs, vs, group)  # [b * m, h_q, s_q, d_v]
    out = _from_slots(out, seq, s_q).astype(q.dtype)
    return (out, max_logit) if return_max_logit else out


# --- the fused primitives' CPU math (fp32) ----------------------------------------------------------


def fused_fwd_math(q, k, v, bias, seq: SeqInfo, seeds, *, static, softmax_offset=None):
    """Forward of the fused primitive in fp32: (output in q's dtype, per-token log-sum-exp fp32
    ``[b, h, s_q]``, including the sink with sink softmax)."""
    f32 = jnp.float32
    visible = visibility_mask(seq, q.shape[1], k.shape[1], static.attn_mask_type, static.window_size,
                              static.bottom_right)
    q, k, v, in_q = zero_padding(q, k, v, seq)
    invariant = static.deterministic
    logits = _logits(q.astype(f32), k.astype(f32), bias, static.scaling_factor, static.attn_bias_type, f32,
                     invariant=invariant)
    probs, lse = _masked_softmax(logits, visible, sink_logits(static.softmax_type, softmax_offset, q.shape[2]))
    if static.has_dropout:
        probs, _ = _apply_dropout(probs, seeds, static.dropout_probability)
    out = _pv(probs, v.astype(f32), f32, invariant=invariant)
    return jnp.where(in_q, out, 0.0).astype(q.dtype), lse


# The forward kernel's constants (kernels/forward.py): its scores are in base 2, scaled by
# ``qk_scale = softmax_scale * log2(e)`` (an fp32 argument), and it stores ``max * ln(2)``.
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def fused_row_max(q, k, bias, seq: SeqInfo, *, static) -> jax.Array:
    """Each query token's max logit over the keys it sees, fp32 ``[b, h_q, s_q]`` (-inf where it sees
    none, padding included), as the forward kernel computes it: the max of the base-2 scores
    ``qk * qk_scale (+ bias * log2 e)`` times ``ln 2``. Without a bias a product is exact whatever the
    order, and these are the kernel's bits wherever ``qk`` is; a bias is added here without the kernel's
    fused multiply-add (one rounding apart). The sink is no key's logit and takes no part."""
    f32 = jnp.float32
    visible = visibility_mask(seq, q.shape[1], k.shape[1], static.attn_mask_type, static.window_size,
                              static.bottom_right)
    q, k, _, _ = zero_padding(q, k, k, seq)
    raw = _logits(q.astype(f32), k.astype(f32), None, 1.0, AttnBiasType.NO_BIAS, f32,
                  invariant=static.deterministic)
    qk_scale = jnp.asarray(np.float32(static.scaling_factor * _LOG2E))
    if bias is None or static.attn_bias_type == AttnBiasType.NO_BIAS:
        scores = raw * qk_scale
    elif static.attn_bias_type == AttnBiasType.PRE_SCALE_BIAS:
        scores = (raw + bias.astype(f32)) * qk_scale
    else:
        scores = raw * qk_scale + bias.astype(f32) * jnp.asarray(np.float32(_LOG2E))
    row = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1, initial=-jnp.inf)
    return jnp.where(row == -jnp.inf, row, row * jnp.asarray(np.float32(_LN2)))


def _sum_to_shape(x, shape):
    """Sum ``x`` over the axes where ``shape`` is 1 (bias broadcast)."""
    for axis, (n, m) in enumerate(zip(x.shape, shape)):
        if m == 1 and n != 1:
            x = fixed_order_sum(x, axis=axis, keepdims=True)
    return x


def sink_grad_parts(lse, delta, seq: SeqInfo, softmax_offset) -> jax.Array:
    """Each sequence's part of d softmax_offset (learnable sink), fp32 ``[b, m, h]``:
    ``-sum_i exp(offset_h - lse_i) * delta_i`` over its rows, summed by position within the sequence
    (``fixed_order_sum``), so a part does not depend on the other sequences or on the row layout."""
    b, h, s_q = lse.shape
    p_sink = jnp.exp(jnp.reshape(softmax_offset, (h,)).astype(jnp.float32)[None, :, None] - lse)  # 0 on padding
    rows = jnp.where(jnp.isfinite(lse), p_sink * delta, 0.0)  # [b, h, s_q]
    m = seq.q_seqlens.shape[1]
    i = jnp.arange(s_q, dtype=jnp.int32)
    token = jnp.clip(seq.q_offsets[:, :m, None].astype(jnp.int32) + i, 0, s_q - 1)  # [b, m, s_q]
    gathered = jnp.take_along_axis(jnp.broadcast_to(rows[:, None], (b, m, h, s_q)),
                                   jnp.broadcast_to(token[:, :, None, :], (b, m, h, s_q)), axis=-1)
    inside = (i < seq.q_seqlens[:, :, None])[:, :, None, :]
    return -fixed_order_sum(jnp.where(inside, gathered, 0.0), axis=-1)


def row_delta(out, dout) -> jax.Array:
    """``delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij`` (holds with dropout too), fp32 ``[b, h_q, s_q]``."""
    return jnp.swapaxes(fixed_order_sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)


def fused_bwd_math(q, k, v, bias, out, dout, lse, seq: SeqInfo, seeds, *, static):
    """Backward of the fused primitive in fp32 from the per-token log-sum-exp ``[b, h, s_q]``:
    (dq, dk, dv, dbias). With sink softmax the log-sum-exp includes the sink and nothing else changes
    (the sink has no value, so ``delta = rowsum(dO * O)`` still is ``sum_j P_ij dP_ij``)."""
    f32 = jnp.float32
    b, s_q, h_q, _ = q.shape
    s_kv, h_kv = k.shape[1], k.shape[2]
    q, k, v, in_q = zero_padding(q, k, v, seq)
    dout = jnp.where(in_q, dout, jnp.zeros((), dout.dtype))  # the kernels never load dO of padding either
    qf, kf, vf = q.astype(f32), k.astype(f32), v.astype(f32)
    visible = visibility_mask(seq, s_q, s_kv, static.attn_mask_type, static.window_size, static.bottom_right)
    invariant = static.deterministic
    logits = _logits(qf, kf, bias, static.scaling_factor, static.attn_bias_type, f32, invariant=invariant)
    # exp(logits - lse) recomputes the forward probabilities; +inf lse (empty row) gives 0.
    probs = jnp.where(visible, jnp.exp(jnp.where(visible, logits, 0.0) - lse[..., None]), 0.0)
    dout_f = dout.astype(f32)
    delta = row_delta(out, dout)
    hi = _precision(f32)
    if invariant:
        dprobs_dropped = _rows_dot_keys(dout_f, vf).reshape(b, h_q, s_q, s_kv)
    else:
        dprobs_dropped = jnp.einsum(
            "bqkgd,bskd->bkgqs", _group(dout_f, h_kv), vf, preferred_element_type=f32, precision=hi
        ).reshape(b, h_q, s_q, s_kv)
    if static.has_dropout:
        keep = dropout_keep_mask(seeds, s_q, s_kv, static.dropout_probability)
        scale_keep = jnp.where(keep, 1.0 / (1.0 - static.dropout_probability), 0.0)
        probs_used = probs * scale_keep
        dprobs = dprobs_dropped * scale_keep
    else:
        probs_used = probs
        dprobs = dprobs_dropped
    dlogits = probs * (dprobs - delta[..., None])  # [b, h_q, s_q, s_kv]
    probs_g = probs_used.reshape(b, h_kv, h_q // h_kv, s_q, s_kv)
    dscores = dlogits * static.scaling_factor
    dscores_g = dscores.reshape(b, h_kv, h_q // h_kv, s_q, s_kv)
    if invariant:
        dv = _scores_times_rows(probs_g, dout_f)
        dq = _scores_times_keys(dscores_g, kf)
        dk = _scores_times_rows(dscores_g, qf)
    else:
        dv = jnp.einsum("bkgqs,bqkgd->bskd", probs_g, _group(dout_f, h_kv), precision=hi)
        dq = jnp.einsum("bkgqs,bskd->bqkgd", dscores_g, kf, precision=hi).reshape(q.shape)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", dscores_g, _group(qf, h_kv), precision=hi)
    if bias is None:
        dbias = None
    else:
        dbias_full = dscores if static.attn_bias_type == AttnBiasType.PRE_SCALE_BIAS else dlogits
        dbias = _sum_to_shape(dbias_full, bias.shape).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
