"""``DotProductAttention`` for Flax NNX, over :func:`transformer_engine.jax.attention.fused_attn`.

The same arguments and semantics as the linen module
(:class:`transformer_engine.jax.flax.DotProductAttention`) for separate q, k, v::

    from flax import nnx
    from transformer_engine.jax.flax.nnx import DotProductAttention

    attn = DotProductAttention(head_dim=64, num_attention_heads=8, num_gqa_groups=2)
    out = attn(q, k, v)  # q [b, s, 8, 64], k and v [b, s, 2, 64] -> [b, s, 8, 64]

The module holds no parameters. Dropout draws its seed from ``rngs`` (an ``nnx.Rngs`` with a
``dropout`` stream) when ``attention_dropout > 0`` and ``deterministic`` is False.

Generation with a KV cache, as ``nnx.MultiHeadAttention`` does it: ``attn.init_cache(max_batch_size,
max_seqlen, dtype)`` creates ``nnx.Cache`` variables (``cached_key``, ``cached_value``, ``cache_lengths``), and
``attn(q, k, v, step_lens, decode=True)`` appends the new tokens (``step_lens``: ``None``, every slot takes the
call's ``t`` tokens, or an int array ``[max_batch_size]``) and attends them to their slots' cached keys
(:func:`~transformer_engine.jax.inference.kv_cache_attention`): each row bitwise the training call's row.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_engine.common.attention import enums as _common
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.enums import AttnMaskType, to_common
from transformer_engine.jax.inference import KVCache, kv_cache_attention

__all__ = ["DotProductAttention"]


class DotProductAttention(nnx.Module):
    """Scaled dot-product attention, ``softmax(q k^T * scale + bias) v``, for q, k, v ``[b, s, h, d]``.

    :param head_dim: ``d`` of q and k.
    :param num_attention_heads: query heads.
    :param num_gqa_groups: key/value heads (GQA); ``None`` for as many as query heads.
    :param attention_dropout: dropout probability on the attention weights.
    :param attn_mask_type: a TransformerEngine mask name or :class:`AttnMaskType` (causal by default).
    :param scale_factor: softmax scale; ``head_dim ** -0.5`` by default.
    :param window_size: sliding window ``(left, right)``, ``None`` for none.
    """

    def __init__(self, head_dim: int, num_attention_heads: int, num_gqa_groups: Optional[int] = None, *,
                 attention_dropout: float = 0.0,
                 attn_mask_type: Union[str, AttnMaskType] = AttnMaskType.CAUSAL_MASK,
                 scale_factor: Optional[float] = None, window_size: Optional[Tuple[int, int]] = None,
                 rngs: Optional[nnx.Rngs] = None) -> None:
        if not 0.0 <= float(attention_dropout) < 1.0:
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {attention_dropout!r}")
        self.head_dim = head_dim
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.attention_dropout = float(attention_dropout)
        self.attn_mask_type = to_common(attn_mask_type, _common.AttnMaskType, "attn_mask_type")
        self.scale_factor = float(scale_factor) if scale_factor is not None else head_dim ** -0.5
        self.window_size = window_size
        self.rngs = rngs

    def init_cache(self, max_batch_size: int, max_seqlen: int, dtype, head_dim_v: Optional[int] = None) -> None:
        """Empty KV-cache variables for ``decode=True`` calls: ``max_batch_size`` slots of ``max_seqlen`` tokens."""
        dv = self.head_dim if head_dim_v is None else head_dim_v
        self.cached_key = nnx.Cache(jnp.zeros((max_batch_size, max_seqlen, self.num_gqa_groups, self.head_dim), dtype))
        self.cached_value = nnx.Cache(jnp.zeros((max_batch_size, max_seqlen, self.num_gqa_groups, dv), dtype))
        self.cache_lengths = nnx.Cache(jnp.zeros((max_batch_size,), jnp.int32))

    def _decode_step(self, query, key, value, step_lens, bias) -> jax.Array:
        if not hasattr(self, "cached_key"):
            raise ValueError("`decode=True` needs the cache: call init_cache(max_batch_size, max_seqlen, dtype) first")
        if bias is not None:
            raise ValueError("`bias` must be None with decode=True (the cache keeps no bias), got an array")
        if step_lens is not None and (isinstance(step_lens, SequenceDescriptor) or jnp.ndim(step_lens) != 1):
            raise ValueError("`sequence_descriptor` must be None or an int array [max_batch_size] of new tokens "
                             f"per slot with decode=True, got {type(step_lens).__name__}")
        cache = KVCache(self.cached_key[...], self.cached_value[...], self.cache_lengths[...])
        out, cache = kv_cache_attention(query, key, value, cache, step_lens, attn_mask_type=self.attn_mask_type,
                                        window_size=self.window_size, scaling_factor=self.scale_factor)
        self.cached_key[...], self.cached_value[...], self.cache_lengths[...] = cache.k, cache.v, cache.lengths
        return out

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array,
                 sequence_descriptor: Optional[SequenceDescriptor] = None, bias: Optional[jax.Array] = None, *,
                 deterministic: bool = False, decode: bool = False) -> jax.Array:
        if query.shape[-2:] != (self.num_attention_heads, self.head_dim):
            raise ValueError(f"`query` must be [b, s, {self.num_attention_heads}, {self.head_dim}], got {query.shape}")
        if key.shape[-2] != self.num_gqa_groups or value.shape[-2] != self.num_gqa_groups:
            raise ValueError(f"`key` and `value` must have {self.num_gqa_groups} heads, got {key.shape}, {value.shape}")
        is_training = not deterministic
        if decode:
            if is_training and self.attention_dropout > 0.0:
                raise ValueError(f"`attention_dropout` must be 0 (or deterministic=True) with decode=True, got "
                                 f"{self.attention_dropout}")
            return self._decode_step(query, key, value, sequence_descriptor, bias)
        seed = None
        if is_training and self.attention_dropout > 0.0:
            if self.rngs is None:
                raise ValueError("`rngs` (with a 'dropout' stream) must be given for attention_dropout > 0")
            seed = self.rngs.dropout()
        return _attention.fused_attn(
            (query, key, value), bias, sequence_descriptor, seed,
            attn_bias_type=_common.AttnBiasType.NO_BIAS if bias is None else _common.AttnBiasType.POST_SCALE_BIAS,
            attn_mask_type=self.attn_mask_type, qkv_layout=_common.QKVLayout.BSHD_BSHD_BSHD,
            scaling_factor=self.scale_factor, dropout_probability=self.attention_dropout,
            is_training=is_training, window_size=self.window_size,
        )
