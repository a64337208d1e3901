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
backend computes ``unfused_attention``: framework math in the input dtype with fp32 softmax,
differentiated by JAX.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.common.attention.config import resolve_bottom_right_diagonal
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType

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
    "fused_bwd_math",
    "softmax_aux_shape",
    "lse_to_segments",
    "lse_to_tokens",
    "fixed_order_sum",
    "zero_padding",
    "sink_logits",
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


def dropout_keep_mask(seeds: jax.Array, s_q: int, s_kv: int, rate: float) -> jax.Array:
    """``[b, h, s_q, s_kv]`` bool: True where an attention probability is kept."""
    i = jnp.arange(s_q, dtype=jnp.uint32)[:, None]
    j = jnp.arange(s_kv, dtype=jnp.uint32)[None, :]
    k0 = seeds[..., 0][:, :, None, None]
    k1 = seeds[..., 1][:, :, None, None]
    x = _fmix32(k0 ^ (i * _GOLDEN))
    x = _fmix32(x ^ k1 ^ (j * _KEY_MUL))
    x = _fmix32(x + _GOLDEN)
    threshold = np.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))
    return x >= threshold


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


def lse_to_segments(lse_tokens: jax.Array, seq: SeqInfo) -> jax.Array:
    """Per-token log-sum-exp ``[b, h, s_q]`` -> per-sequence layout ``[b, m, h, s_q]``."""
    b, h, s_q = lse_tokens.shape
    m = seq.q_seqlens.shape[1]
    i = jnp.arange(s_q, dtype=jnp.int32)
    token = seq.q_offsets[:, :m, None].astype(jnp.int32) + i  # [b, m, s_q]
    inside = i < seq.q_seqlens[:, :, None]
    index = jnp.broadcast_to(jnp.clip(token, 0, s_q - 1)[:, :, None, :], (b, m, h, s_q))
    gathered = jnp.take_along_axis(jnp.broadcast_to(lse_tokens[:, None], (b, m, h, s_q)), index, axis=-1)
    return jnp.where(inside[:, :, None, :], gathered, jnp.inf)


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
):
    """softmax(QK^T * scale + bias) V in the input dtype, softmax in fp32. Returns ``[b, s_q, h_q, d_v]``.
    Sink softmax (``softmax_type``) adds one logit per row (0, or ``softmax_offset[h]``, not scaled)
    to the normaliser; dropout applies to the keys' probabilities."""
    visible = visibility_mask(seq, q.shape[1], k.shape[1], attn_mask_type, window_size, bottom_right_diagonal)
    q, k, v, in_q = zero_padding(q, k, v, seq)
    logits = _logits(q, k, bias, scaling_factor, attn_bias_type, jnp.float32)
    probs, _ = _masked_softmax(logits, visible, sink_logits(softmax_type, softmax_offset, q.shape[2]))
    if is_training and dropout_probability > 0.0:
        probs, _ = _apply_dropout(probs, seeds, dropout_probability)
    out = _pv(probs.astype(v.dtype), v, jnp.float32)
    return jnp.where(in_q, out, 0.0).astype(q.dtype)


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
