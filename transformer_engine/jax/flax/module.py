"""``DotProductAttention``: a Flax linen module over :func:`transformer_engine.jax.attention.fused_attn`."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVFormat, QKVLayout
from transformer_engine.common.log import get_logger, warn_once
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.attention import SequenceDescriptor

__all__ = ["DotProductAttention"]

_SBHD_OF = {
    QKVLayout.BS3HD: QKVLayout.SB3HD,
    QKVLayout.BSHD_BS2HD: QKVLayout.SBHD_SB2HD,
    QKVLayout.BSHD_BSHD_BSHD: QKVLayout.SBHD_SBHD_SBHD,
}


def _mask_to_descriptor(mask: jax.Array) -> SequenceDescriptor:
    """A padding mask ``[b, 1, s_q, s_kv]`` (True or 1 = masked out, TransformerEngine's convention)
    -> segment ids: a query (key) is real when it sees (is seen by) at least one key (query)."""
    if mask.ndim != 4:
        raise ValueError(f"`sequence_descriptor` as a mask must be [b, 1, s_q, s_kv], got shape {mask.shape}")
    visible = jnp.logical_not(mask.astype(bool))[:, 0]
    q_ids = jnp.any(visible, axis=-1).astype(jnp.int32)
    kv_ids = jnp.any(visible, axis=-2).astype(jnp.int32)
    return SequenceDescriptor.from_segment_ids_and_pos((q_ids, kv_ids))


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with TransformerEngine's fields, on the fused kernels when they
    can run (CUDA GPUs) and on the unfused jnp path otherwise, logging why once.

    Fields:

    - ``head_dim``: per-head size of queries and keys (values may differ).
    - ``num_attention_heads``: query heads.
    - ``num_gqa_groups``: key/value heads (``None``: as many as query heads); a divisor of
      ``num_attention_heads`` (GQA; 1 is MQA).
    - ``attention_dropout``: dropout probability on the attention weights (training only).
    - ``attn_mask_type``: ``'no_mask'``, ``'padding'``, ``'causal'``, ``'padding_causal'``,
      ``'causal_bottom_right'``, ``'padding_causal_bottom_right'``.
    - ``attn_bias_type``: ``None`` (post_scale_bias when a bias is passed, else no_bias), or an
      ``AttnBiasType``.
    - ``dropout_rng_name``: the Flax RNG stream dropout draws from.
    - ``qkv_layout``: ``'bshd_bshd_bshd'`` (separate), ``'bshd_bs2hd'`` (``key`` is packed
      ``[b, s, 2, h, d]``, ``value`` None), ``'bs3hd'`` (``query`` is packed ``[b, s, 3, h, d]``),
      or their ``thd`` forms (rows packing several sequences; pass a SequenceDescriptor).
    - ``scale_factor``: logits scale; ``None`` is ``1 / sqrt(head_dim)``.
    - ``window_size``: ``(left, right)`` sliding window, ``-1`` unbounded.
    - ``transpose_batch_sequence``: inputs and output are ``[s, b, ...]`` instead of ``[b, s, ...]``.
    - ``max_segments_per_seq``: sequences per row for THD layouts.

    ``__call__(query, key, value, sequence_descriptor=None, bias=None, *, deterministic=False)``:
    ``sequence_descriptor`` is a ``SequenceDescriptor``, or a padding mask ``[b, 1, s_q, s_kv]``
    with True (1) where attention is masked out; ``deterministic=True`` disables dropout (Flax's
    meaning; bitwise reproducibility is ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``). Returns
    ``[b, s_q, num_attention_heads, d_v]``.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: Union[str, AttnMaskType] = AttnMaskType.CAUSAL_MASK
    attn_bias_type: Optional[Union[str, AttnBiasType]] = None
    dropout_rng_name: str = "dropout"
    qkv_layout: Union[str, QKVLayout] = QKVLayout.BSHD_BSHD_BSHD
    scale_factor: Optional[float] = None
    window_size: Optional[Tuple[int, int]] = None
    transpose_batch_sequence: bool = False
    max_segments_per_seq: int = 1

    def _layout(self) -> QKVLayout:
        layout = _attention._enum(QKVLayout, self.qkv_layout, "qkv_layout")
        if self.transpose_batch_sequence:
            if layout.qkv_format == QKVFormat.THD:
                raise ValueError(f"`transpose_batch_sequence` must be False with qkv_layout={layout.value!r}")
            layout = _SBHD_OF.get(layout, layout)
        return layout

    def _qkv(self, layout: QKVLayout, query, key, value) -> Tuple[Any, ...]:
        if layout.packing == "qkv":
            if key is not None or value is not None:
                raise ValueError(f"`key` and `value` must be None with qkv_layout={layout.value!r} (query is packed)")
            return (query,)
        if layout.packing == "kv":
            if value is not None:
                raise ValueError(f"`value` must be None with qkv_layout={layout.value!r} (key is packed)")
            return (query, key)
        if key is None or value is None:
            raise ValueError(f"`key` and `value` must be arrays with qkv_layout={layout.value!r}")
        return (query, key, value)

    def _check_heads(self, layout: QKVLayout, qkv) -> None:
        q_heads, q_dim = qkv[0].shape[-2], qkv[0].shape[-1]
        if q_heads != self.num_attention_heads:
            raise ValueError(f"`num_attention_heads` is {self.num_attention_heads} but the query has {q_heads} heads")
        if q_dim != self.head_dim:
            raise ValueError(f"`head_dim` is {self.head_dim} but the query has head dim {q_dim}")
        kv_heads = qkv[-1].shape[-2]
        expected = self.num_gqa_groups or self.num_attention_heads
        if kv_heads != expected:
            raise ValueError(f"`num_gqa_groups` is {expected} but key/value have {kv_heads} heads")

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: Optional[jax.Array] = None,
        value: Optional[jax.Array] = None,
        sequence_descriptor: Optional[Union[SequenceDescriptor, jax.Array]] = None,
        bias: Optional[jax.Array] = None,
        *,
        deterministic: bool = False,
    ) -> jax.Array:
        layout = self._layout()
        qkv = self._qkv(layout, query, key, value)
        self._check_heads(layout, qkv)
        if self.attn_bias_type is None:
            bias_type = AttnBiasType.NO_BIAS if bias is None else AttnBiasType.POST_SCALE_BIAS
        else:
            bias_type = _attention._enum(AttnBiasType, self.attn_bias_type, "attn_bias_type")
        if sequence_descriptor is not None and not isinstance(sequence_descriptor, SequenceDescriptor):
            sequence_descriptor = _mask_to_descriptor(jnp.asarray(sequence_descriptor))
        is_training = not deterministic
        dropout = float(self.attention_dropout)
        seed = self.make_rng(self.dropout_rng_name) if (is_training and dropout > 0.0) else None
        scale = self.scale_factor if self.scale_factor is not None else self.head_dim**-0.5

        out, selection = _attention._attention_with_selection(
            qkv, bias, sequence_descriptor, seed, bias_type, self.attn_mask_type, layout, scale, dropout,
            is_training, self.max_segments_per_seq, self.window_size,
        )
        fused_reasons = selection.rejected.get(_attention.FusedAttention.NAME)
        if fused_reasons:
            text = "; ".join(fused_reasons)
            warn_once(
                f"flax-dpa-fallback:{text}",
                f"DotProductAttention: the fused attention kernel is unavailable ({text}); using "
                f"{selection.name}.",
            )
        get_logger().debug("DotProductAttention ran %s", selection.name)
        return out
