"""TransformerEngine-JAX's transformer layers: ``transformer_engine.jax.flax.transformer``.

:class:`MultiHeadAttention` (norm, QKV projection, rotary embedding, :class:`DotProductAttention`,
output projection), :class:`RelativePositionBiases` (T5's bucketed relative position bias),
:class:`TransformerLayer` (encoder or decoder layer; its sublayer/norm/residual order is
:class:`transformer_engine.common.modules.LayerStructure`'s), :func:`rotary_pos_emb` and
:func:`extend_logical_axis_rules`, with TransformerEngine-JAX's fields, parameter names and
parameter shapes. ``DotProductAttention`` is :class:`transformer_engine.jax.flax.DotProductAttention`.
"""

from __future__ import annotations

import functools
import warnings
from enum import Enum
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from transformer_engine.common.modules import LayerStructure
from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.jax.flax.module import (DenseGeneral, DotProductAttention, LayerNorm, LayerNormDenseGeneral,
                                                LayerNormMLP, canonicalize_norm_type)
from transformer_engine.jax.sharding import (BATCH_AXES, HEAD_AXES, HIDDEN_AXES, HIDDEN_TP_AXES,
                                             SEQLEN_AXES, SEQLEN_TP_AXES, W_FSDP_AXES, W_JOINED_AXES,
                                             W_NO_SHARD_AXES, W_TP_AXES, get_sharding_map_logic_axis_to_mesh_axis)
from transformer_engine.jax.sharding import with_sharding_constraint_by_logical_axes as _constrain

__all__ = [
    "DotProductAttention", "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer", "TransformerLayerType",
    "extend_logical_axis_rules", "rotary_pos_emb", "AttnBiasType", "AttnMaskType", "AttnSoftmaxType", "QKVLayout",
]

Initializer = Callable[..., Any]
LogicalRules = Sequence[Tuple[str, Union[str, None]]]


def extend_logical_axis_rules(rules: LogicalRules) -> Tuple[Tuple[str, Optional[str]], ...]:
    """``rules`` (Flax logical axis rules) plus TransformerEngine's logical axes (``BATCH_AXES``, ``W_TP_AXES``,
    ...) mapped by the active :class:`~transformer_engine.jax.sharding.MeshResource`
    (:func:`~transformer_engine.jax.sharding.get_sharding_map_logic_axis_to_mesh_axis`). A rule the
    caller gives for one of these axes must agree with it (``ValueError`` otherwise)."""
    given = {}
    for item in rules:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"`rules` must hold (logical axis, mesh axis) pairs, got {item!r}")
        key, val = item
        if not isinstance(key, str) or not (val is None or isinstance(val, str)):
            raise ValueError(f"`rules` must pair a str with a str or None, got {item!r}")
        given.setdefault(key, []).append(val)
    extended = [tuple(item) for item in rules]
    for key, val in get_sharding_map_logic_axis_to_mesh_axis().items():
        if key in given:
            if given[key] != [val]:
                raise ValueError(f"`rules` map {key!r} to {given[key]}, but the MeshResource maps it to {val!r}")
        else:
            extended.append((key, val))
    return tuple(extended)


def _group_method(group_method: str) -> str:
    key = group_method.lower().strip().replace("-", "").replace("_", "") if isinstance(group_method, str) else None
    if key not in ("consecutive", "alternate"):
        raise ValueError(f"`rotary_pos_emb_group_method` must be 'consecutive' or 'alternate', got {group_method!r}")
    return key


def rotary_pos_emb(x: jax.Array, windows: Tuple[int, int], transpose_batch_sequence: bool,
                   group_method: str = "consecutive") -> jax.Array:
    """Rotary position embedding of ``x`` ``[b, s, ..., h, d]`` (``[s, b, ...]`` when
    ``transpose_batch_sequence``), TransformerEngine-JAX's form: the pair of features ``j`` rotates by
    ``position / timescale_j``, ``timescale_j = min * (max / min) ** (2 j / d)`` with ``windows =
    (min, max)``. ``'consecutive'`` pairs features ``(2j, 2j + 1)``, ``'alternate'`` pairs ``(j, j + d/2)``.
    Computed in float32, returned in ``x.dtype``."""
    method = _group_method(group_method)
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary position embedding needs an even head dim, got {d}")
    half = d // 2
    lo, hi = float(windows[0]), float(windows[1])
    timescales = lo * (hi / lo) ** (2.0 * np.arange(half, dtype=np.float32) / d)
    seq_dim = 0 if transpose_batch_sequence else 1
    positions = jnp.arange(x.shape[seq_dim], dtype=jnp.float32)
    angles = positions[:, None] / jnp.asarray(timescales, jnp.float32)[None, :]  # [s, d/2]
    shape = [1] * (x.ndim - 1) + [half]
    shape[seq_dim] = x.shape[seq_dim]
    sin, cos = jnp.sin(angles).reshape(shape), jnp.cos(angles).reshape(shape)
    x32 = x.astype(jnp.float32)
    if method == "alternate":
        a, b = x32[..., :half], x32[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        pairs = x32.reshape(*x.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def _lora_scope(scope: Optional[str]) -> None:
    if scope is not None and (not isinstance(scope, str) or scope.lower() != "none"):
        raise NotImplementedError(f"`low_rank_adaptation_scope={scope!r}` is not implemented: the layers here train "
                                  "their full kernels (no LoRA kernels); pass 'none'")


def _leading_axes(transpose_batch_sequence: bool, sequence_parallel: bool) -> Tuple[str, str]:
    seq = SEQLEN_TP_AXES if sequence_parallel else SEQLEN_AXES
    return (seq, BATCH_AXES) if transpose_batch_sequence else (BATCH_AXES, seq)


class MultiHeadAttention(nn.Module):  # pylint: disable=too-few-public-methods
    """Multi-head attention: norm + QKV projection, :class:`DotProductAttention`, output projection.

    Fields (TransformerEngine-JAX's, in its order): ``head_dim``, ``num_attention_heads``,
    ``num_gqa_groups`` (None: as many as the query heads); ``attention_dropout``, ``dropout_rng_name``;
    ``input_layernorm`` (norm the query input), ``layernorm_type``, ``layernorm_epsilon``,
    ``return_layernorm_output``, ``zero_centered_gamma``; ``kernel_init`` (None:
    ``variance_scaling(1.0, 'fan_in', 'normal')``), ``use_bias``, ``bias_init``; ``attn_mask_type``,
    ``attn_bias_type`` (as :class:`DotProductAttention`'s); ``enable_rotary_pos_emb``,
    ``rotary_pos_emb_windows``, ``rotary_pos_emb_group_method`` (:func:`rotary_pos_emb` on the projected
    queries and keys); ``dtype`` (parameters); ``fuse_qkv_params``; ``transpose_batch_sequence``
    (None warns and reads False, as TransformerEngine-JAX); ``enable_sequence_parallel`` (the norm's
    input is sequence-sharded over ``SEQLEN_TP_AXES``); ``scale_attn_logits`` (logits scaled by
    ``1/sqrt(head_dim)``; otherwise 1 and the query kernel is scaled at init when
    ``scaled_query_init``); ``float32_logits``; ``window_size``; ``softmax_type``; ``score_mod``,
    ``score_mod_bprop`` (:class:`DotProductAttention` refuses them). Deprecated names: ``num_heads``,
    ``dropout_rate`` (read with a ``DeprecationWarning``), ``apply_residual_connection_post_layernorm``,
    ``fuse_qkv`` (warned, unused); ``output_layernorm`` must be None. ``low_rank_adaptation_scope``
    other than 'none' and ``decode=True`` are refused (``NotImplementedError``).

    Parameters (TransformerEngine-JAX's layout): self attention with as many key/value heads as query
    heads and ``fuse_qkv_params``: ``qkv`` (a :class:`LayerNormDenseGeneral`, kernel
    ``[hidden, 3, heads * head_dim]``); otherwise ``query`` (``LayerNormDenseGeneral``) and either ``kv``
    (kernel ``[hidden, 2, num_gqa_groups * head_dim]``, fused) or ``key`` and ``value``; then ``out``.
    In self attention (``inputs_q is inputs_kv``) the keys and values are projected from the
    normalized input (which is then returned as the norm output, as TransformerEngine-JAX does).

    ``__call__(inputs_q, inputs_kv, mask=None, bias=None, *, decode=False, deterministic=False, ...)``:
    ``mask`` ``[b, 1, s_q, s_kv]`` True where attention is masked out (padding masks; a padding mask
    type with ``mask=None`` masks nothing); ``bias`` ``[1, heads, s_q, s_kv]``. Returns
    ``(output [b, s, hidden_q], norm output or None)``."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Optional[Initializer] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: Optional[bool] = None
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None
    # Deprecated names
    num_heads: Optional[int] = None
    dropout_rate: Optional[float] = None
    output_layernorm: Optional[bool] = None
    apply_residual_connection_post_layernorm: Optional[bool] = None
    fuse_qkv: Optional[bool] = None

    def _settings(self) -> Tuple[int, int, float, bool]:
        """(heads, kv heads, attention dropout, transpose_batch_sequence), deprecated names read."""
        heads, dropout = self.num_attention_heads, self.attention_dropout
        if self.num_heads is not None:
            warnings.warn("`num_heads` is deprecated, use `num_attention_heads`", DeprecationWarning, stacklevel=3)
            heads = self.num_heads
        if self.dropout_rate is not None:
            warnings.warn("`dropout_rate` is deprecated, use `attention_dropout`", DeprecationWarning, stacklevel=3)
            dropout = self.dropout_rate
        if self.apply_residual_connection_post_layernorm is not None:
            warnings.warn("`apply_residual_connection_post_layernorm` is deprecated and unused, use "
                          "`return_layernorm_output`", DeprecationWarning, stacklevel=3)
        if self.fuse_qkv is not None:
            warnings.warn("`fuse_qkv` is deprecated and unused, use `fuse_qkv_params`", DeprecationWarning,
                          stacklevel=3)
        if self.output_layernorm is not None:
            raise ValueError("`output_layernorm` must be None (deprecated; `input_layernorm` chooses the norm), got "
                             f"{self.output_layernorm!r}")
        tbs = self.transpose_batch_sequence
        if tbs is None:
            warnings.warn("`transpose_batch_sequence` of MultiHeadAttention defaults to False (pass it to silence "
                          "this)", UserWarning, stacklevel=3)
            tbs = False
        kv_heads = self.num_gqa_groups if self.num_gqa_groups is not None else heads
        if heads % kv_heads:
            raise ValueError(f"`num_gqa_groups` must divide num_attention_heads ({heads}), got {kv_heads}")
        return heads, kv_heads, dropout, bool(tbs)

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array, mask: Optional[jax.Array] = None,
                 bias: Optional[jax.Array] = None, *, decode: bool = False, deterministic: bool = False,
                 score_mod_tensors: Optional[Mapping[str, Any]] = None,
                 score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None) -> Tuple[jax.Array, Optional[jax.Array]]:
        heads, kv_heads, dropout, tbs = self._settings()
        _lora_scope(self.low_rank_adaptation_scope)
        if decode:
            raise NotImplementedError("`decode=True` is not implemented in MultiHeadAttention (its cache_index "
                                      "cache); DotProductAttention(decode=True) keeps a KV cache")
        if inputs_q.dtype != inputs_kv.dtype:
            raise ValueError(f"`inputs_kv` must have the dtype of inputs_q ({inputs_q.dtype}), got {inputs_kv.dtype}")
        canonicalize_norm_type(self.layernorm_type)
        input_dtype = inputs_q.dtype
        d = self.head_dim
        kernel_init = self.kernel_init or nn.initializers.variance_scaling(1.0, "fan_in", "normal", dtype=self.dtype)

        def query_init(key, shape, dtype):
            k = kernel_init(key, shape, dtype)
            return k / jnp.sqrt(d).astype(dtype) if self.scaled_query_init else k

        def stacked_init(key, shape, dtype, first=None):
            # [hidden, n, features]: one kernel per slot (query's scaled in the fused QKV), each from its own key.
            n = shape[-2]
            keys = jax.random.split(key, n)
            inits = [first or kernel_init] + [kernel_init] * (n - 1)
            return jnp.stack([f(k, (shape[0], shape[-1]), dtype) for f, k in zip(inits, keys)], axis=-2)

        is_self_attn = inputs_q is inputs_kv
        is_qkvpack = is_self_attn and heads == kv_heads
        axes_sp = (*_leading_axes(tbs, self.enable_sequence_parallel), HIDDEN_AXES)
        axes_no_sp = (*_leading_axes(tbs, False), HIDDEN_AXES)
        inputs_q = _constrain(inputs_q, axes_sp)
        norm_dense = functools.partial(
            LayerNormDenseGeneral, enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, epsilon=self.layernorm_epsilon, axis=-1,
            scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,), use_bias=self.use_bias,
            bias_init=self.bias_init, layernorm_input_axes=axes_sp, dot_input_axes=axes_no_sp,
            transpose_batch_sequence=tbs, dtype=self.dtype)
        leading = _leading_axes(tbs, False)
        if self.fuse_qkv_params and is_qkvpack:
            qkv, ln_out = norm_dense(features=(3, heads * d), return_layernorm_output=self.return_layernorm_output,
                                     kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES),
                                     kernel_init=functools.partial(stacked_init, first=query_init),
                                     bias_axes=(W_JOINED_AXES, W_TP_AXES), name="qkv")(inputs_q)
            qkv = checkpoint_name(qkv, "combined_qkv_proj")
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, ln_out = norm_dense(features=heads * d,
                                   return_layernorm_output=self.return_layernorm_output or is_self_attn,
                                   kernel_axes=(W_FSDP_AXES, W_TP_AXES), kernel_init=query_init,
                                   bias_axes=(W_TP_AXES,), name="query")(inputs_q)
            if is_self_attn:
                inputs_kv = ln_out
            if self.fuse_qkv_params:
                kv = DenseGeneral(axis=-1, features=(2, kv_heads * d),
                                  kernel_axes=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES), kernel_init=stacked_init,
                                  use_bias=self.use_bias, bias_init=self.bias_init,
                                  bias_axes=(W_JOINED_AXES, W_TP_AXES), transpose_batch_sequence=tbs, name="kv",
                                  dtype=self.dtype)(inputs_kv)
                kv = checkpoint_name(kv, "combined_kv_proj")
                k, v = kv[..., 0, :], kv[..., 1, :]
            else:
                proj = functools.partial(DenseGeneral, axis=-1, features=kv_heads * d,
                                         kernel_axes=(W_FSDP_AXES, W_TP_AXES), kernel_init=kernel_init,
                                         use_bias=self.use_bias, bias_init=self.bias_init,
                                         bias_axes=(W_TP_AXES,), transpose_batch_sequence=tbs, dtype=self.dtype)
                k, v = proj(name="key")(inputs_kv), proj(name="value")(inputs_kv)
                q, k, v = (checkpoint_name(t, n) for t, n in ((q, "query_proj"), (k, "key_proj"), (v, "value_proj")))
        q = q.reshape(*q.shape[:2], heads, d)
        k = k.reshape(*k.shape[:2], kv_heads, d)
        v = v.reshape(*v.shape[:2], kv_heads, d)
        if self.enable_rotary_pos_emb:
            q = rotary_pos_emb(q, self.rotary_pos_emb_windows, tbs, self.rotary_pos_emb_group_method)
            k = rotary_pos_emb(k, self.rotary_pos_emb_windows, tbs, self.rotary_pos_emb_group_method)
        # The packed layouts are the same values as separate q, k, v: pass them separately (one layout for
        # every configuration; DotProductAttention's result does not depend on the packing).
        head_axes = (*leading, HEAD_AXES, HIDDEN_AXES)
        q, k, v = (_constrain(t, head_axes) for t in (q, k, v))
        mask_kind = str(self.attn_mask_type).lower()
        if mask is None and "padding" in mask_kind:
            s_q, s_kv = q.shape[0 if tbs else 1], k.shape[0 if tbs else 1]
            mask = jnp.zeros((q.shape[1 if tbs else 0], 1, s_q, s_kv), bool)  # padding type, no mask: all real
        x = DotProductAttention(
            head_dim=d, num_attention_heads=heads, num_gqa_groups=kv_heads, attn_mask_type=self.attn_mask_type,
            attn_bias_type=self.attn_bias_type, attention_dropout=dropout, dropout_rng_name=self.dropout_rng_name,
            float32_logits=self.float32_logits, qkv_layout="bshd_bshd_bshd",
            scale_factor=d**-0.5 if self.scale_attn_logits else 1.0, transpose_batch_sequence=tbs,
            window_size=self.window_size, softmax_type=self.softmax_type, score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop,
        )(q, k, v, mask, bias, deterministic=deterministic, score_mod_tensors=score_mod_tensors,
          score_mod_bprop_tensors=score_mod_bprop_tensors)
        x = x.reshape(*x.shape[:2], x.shape[2] * x.shape[3])
        x = _constrain(x, (*leading, HIDDEN_TP_AXES))
        out = DenseGeneral(features=inputs_q.shape[-1], axis=-1, kernel_init=kernel_init,
                           kernel_axes=(W_TP_AXES, W_FSDP_AXES), use_bias=self.use_bias, bias_init=self.bias_init,
                           bias_axes=(W_NO_SHARD_AXES,), dtype=self.dtype, name="out")(x)
        out = checkpoint_name(out, "out_proj")
        if out.dtype != input_dtype:  # pragma: no cover - the layers keep the input's dtype
            raise AssertionError(f"output dtype {out.dtype} is not the input's {input_dtype}")
        return out, ln_out


class RelativePositionBiases(nn.Module):  # pylint: disable=too-few-public-methods
    """T5's relative position bias: each (query, key) distance falls in one of ``num_buckets``
    buckets (exact below half of them, log-spaced up to ``max_distance``; split by sign when
    ``bidirectional``), each bucket a learned bias per head.

    Fields (TransformerEngine-JAX's): ``num_buckets``, ``max_distance``, ``num_attention_heads``,
    ``embedding_init``, ``embedding_axes``, ``dtype``. Parameter ``rel_embedding``
    ``[num_attention_heads, num_buckets]``. ``__call__(q_seqlen, k_seqlen, bidirectional=True)``
    returns ``[1, num_attention_heads, q_seqlen, k_seqlen]``."""

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., Any] = nn.linear.default_embed_init
    embedding_axes: Tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @staticmethod
    def buckets(q_seqlen: int, k_seqlen: int, num_buckets: int, max_distance: int,
                bidirectional: bool = True) -> np.ndarray:
        """The bucket of each (query, key) pair, int32 ``[q_seqlen, k_seqlen]`` (host numpy: static shapes)."""
        distance = np.arange(q_seqlen, dtype=np.int64)[:, None] - np.arange(k_seqlen, dtype=np.int64)[None, :]
        n = num_buckets
        bucket = np.zeros_like(distance)
        if bidirectional:
            n //= 2
            bucket += (distance < 0) * n  # keys after the query get the upper half
            distance = np.abs(distance)
        else:
            distance = np.maximum(distance, 0)
        exact = n // 2
        large = exact + (np.log(distance.astype(np.float32) / exact + np.finfo(np.float32).eps)
                         / np.log(max_distance / exact) * (n - exact)).astype(np.int64)
        bucket += np.where(distance < exact, distance, np.minimum(large, n - 1))
        return bucket.astype(np.int32)

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        for name, value in (("num_buckets", self.num_buckets), ("max_distance", self.max_distance)):
            if not isinstance(value, (int, np.integer)) or value < (2 if name == "num_buckets" else 1):
                raise ValueError(f"`{name}` must be a positive int (num_buckets at least 2), got {value!r}")
        bucket = self.buckets(q_seqlen, k_seqlen, self.num_buckets, self.max_distance, bidirectional)
        table = self.param("rel_embedding", nn.with_logical_partitioning(self.embedding_init, self.embedding_axes),
                           (self.num_attention_heads, self.num_buckets), self.dtype)
        # A one-hot contraction rather than a gather: its gradient is a matmul, not a scatter-add.
        one_hot = jnp.asarray(bucket[None] == np.arange(self.num_buckets)[:, None, None], self.dtype)
        values = jax.lax.dot_general(jnp.asarray(table, self.dtype), one_hot, (((1,), (0,)), ((), ())))
        return values[None]


class TransformerLayerType(Enum):
    """Which :class:`TransformerLayer`: ``ENCODER`` (self attention, MLP) or ``DECODER`` (self
    attention, cross attention over the encoder's output, MLP)."""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):  # pylint: disable=too-few-public-methods
    """An encoder or decoder layer with TransformerEngine-JAX's fields (in its order) and parameter tree.

    Self attention (``attention`` in an encoder, ``self_attention`` in a decoder; a
    :class:`MultiHeadAttention` with ``self_attn_mask_type``, ``self_attn_bias_type`` and, with
    ``enable_relative_embedding``, the bias of ``relative_embedding`` or a default
    ``RelativePositionBiases(32 buckets, max distance 128)`` named ``relpos_bias``), cross attention
    (decoder: ``encoder_decoder_attention`` over ``encoded``, padding mask ``encoder_decoder_mask``),
    MLP (``mlp``: a :class:`LayerNormMLP` with ``mlp_hidden_size``, ``mlp_activations``,
    ``mlp_activation_params``), each followed by hidden dropout (``hidden_dropout``,
    ``hidden_dropout_dims``) and a residual addition; ``drop_path`` (stochastic depth per sample) after
    self attention and MLP; with ``output_layernorm`` self attention skips its norm and a final
    ``output_layernorm`` follows; with ``apply_residual_connection_post_layernorm`` the residuals are the
    normalized inputs. That order is :class:`transformer_engine.common.modules.LayerStructure`'s.

    The other fields pass to the sublayers as in TransformerEngine-JAX: ``hidden_size``,
    ``num_attention_heads``, ``num_gqa_groups``, ``layernorm_type``, ``layernorm_epsilon``,
    ``zero_centered_gamma``, ``attention_dropout``, ``intermediate_dropout``,
    ``intermediate_dropout_dims``, ``dropout_rng_name``, ``mha_kernel_init``, ``mlp_kernel_init``,
    ``use_bias``, ``bias_init``, ``float32_attention_logits``, ``enable_rotary_pos_emb``,
    ``rotary_pos_emb_windows``, ``rotary_pos_emb_group_method``, ``dtype``, ``fuse_qkv_params``,
    ``transpose_batch_sequence``, ``enable_sequence_parallel``, ``scale_attn_logits``,
    ``scaled_query_init``, ``window_size``, ``softmax_type``, ``score_mod``, ``score_mod_bprop``.
    ``low_rank_adaptation_scope`` other than 'none' and ``decode=True`` are refused.

    ``__call__(inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None, deterministic=False,
    decode=False, max_decode_length=None, ...)``: ``inputs`` ``[b, s, hidden]`` (``[s, b, hidden]`` when
    ``transpose_batch_sequence``); masks ``[b, 1, s_q, s_kv]`` True where masked out. Returns the
    layer's output, shaped as ``inputs``."""

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: Optional[Mapping[str, float]] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    relative_embedding: Optional[nn.Module] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: str = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None

    def _check(self, inputs, encoded, decode: bool) -> TransformerLayerType:
        layer_type = self.layer_type
        if not isinstance(layer_type, TransformerLayerType):
            try:
                layer_type = TransformerLayerType(str(layer_type).lower())
            except ValueError:
                raise ValueError(f"`layer_type` must be a TransformerLayerType (ENCODER or DECODER), got "
                                 f"{self.layer_type!r}") from None
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"`hidden_size` must be a multiple of num_attention_heads ({self.num_attention_heads}), "
                             f"got {self.hidden_size}")
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"`inputs` must be [batch, seq, hidden_size={self.hidden_size}] (or [seq, batch, ...]), "
                             f"got shape {inputs.shape}")
        if decode:
            raise NotImplementedError("`decode=True` is not implemented in TransformerLayer (MultiHeadAttention's "
                                      "cache); DotProductAttention(decode=True) keeps a KV cache")
        if layer_type == TransformerLayerType.DECODER and encoded is None:
            raise ValueError("`encoded` must be the encoder's output with layer_type=DECODER, got None")
        _lora_scope(self.low_rank_adaptation_scope)
        return layer_type

    @nn.compact
    def __call__(self, inputs: jax.Array, encoded: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None, encoder_decoder_mask: Optional[jax.Array] = None,
                 deterministic: bool = False, decode: bool = False, max_decode_length: Optional[int] = None,
                 score_mod_tensors: Optional[Mapping[str, Any]] = None,
                 score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None) -> jax.Array:
        del max_decode_length  # only read with decode, which is refused
        layer_type = self._check(inputs, encoded, decode)
        is_decoder = layer_type == TransformerLayerType.DECODER
        tbs = self.transpose_batch_sequence
        seq_dim, batch_dim = (0, 1) if tbs else (1, 0)
        head_dim = self.hidden_size // self.num_attention_heads
        act_axes = (*_leading_axes(tbs, self.enable_sequence_parallel), HIDDEN_AXES)
        mlp_kernel_init = self.mlp_kernel_init or nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", dtype=self.dtype)

        attn_bias = None
        if self.enable_relative_embedding:
            rel_emb = self.relative_embedding or RelativePositionBiases(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads, dtype=self.dtype,
                embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", dtype=self.dtype),
                name="relpos_bias")
            s = inputs.shape[seq_dim]
            attn_bias = rel_emb(s, s, not is_decoder)

        mha = functools.partial(
            MultiHeadAttention, num_attention_heads=self.num_attention_heads, dtype=self.dtype, head_dim=head_dim,
            num_gqa_groups=self.num_gqa_groups, transpose_batch_sequence=tbs,
            enable_sequence_parallel=self.enable_sequence_parallel, attention_dropout=self.attention_dropout,
            dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_attention_logits,
            scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
            layernorm_type=self.layernorm_type, layernorm_epsilon=self.layernorm_epsilon,
            zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            enable_rotary_pos_emb=self.enable_rotary_pos_emb, rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            low_rank_adaptation_scope=self.low_rank_adaptation_scope, fuse_qkv_params=self.fuse_qkv_params,
            kernel_init=self.mha_kernel_init, use_bias=self.use_bias, bias_init=self.bias_init,
            window_size=self.window_size, softmax_type=self.softmax_type)
        structure = LayerStructure(
            layer_type=layer_type.value,
            apply_residual_connection_post_layernorm=self.apply_residual_connection_post_layernorm,
            output_layernorm=self.output_layernorm)

        def sublayer(name: str, x: jax.Array):
            x = _constrain(x, act_axes)
            if name == "self_attention":
                return mha(input_layernorm=not self.output_layernorm, attn_mask_type=self.self_attn_mask_type,
                           attn_bias_type=self.self_attn_bias_type, score_mod=self.score_mod,
                           score_mod_bprop=self.score_mod_bprop,
                           name="self_attention" if is_decoder else "attention")(
                    x, x, attention_mask, attn_bias, deterministic=deterministic,
                    score_mod_tensors=score_mod_tensors, score_mod_bprop_tensors=score_mod_bprop_tensors)
            if name == "cross_attention":
                return mha(input_layernorm=True, attn_mask_type="padding", attn_bias_type="no_bias",
                           name="encoder_decoder_attention")(x, encoded, encoder_decoder_mask,
                                                             deterministic=deterministic)
            return LayerNormMLP(
                layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
                epsilon=self.layernorm_epsilon, return_layernorm_output=self.apply_residual_connection_post_layernorm,
                intermediate_dim=self.mlp_hidden_size, activations=tuple(self.mlp_activations),
                activation_params=self.mlp_activation_params, intermediate_dropout_rng_name=self.dropout_rng_name,
                intermediate_dropout_rate=self.intermediate_dropout,
                intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims), dtype=self.dtype,
                scale_axes=(W_NO_SHARD_AXES,), ln_bias_axes=(W_NO_SHARD_AXES,), kernel_init=mlp_kernel_init,
                kernel_axes_1=(W_FSDP_AXES, W_JOINED_AXES, W_TP_AXES), kernel_axes_2=(W_TP_AXES, W_FSDP_AXES),
                use_bias=self.use_bias, bias_init=self.bias_init, bias_axes_1=(W_JOINED_AXES, W_TP_AXES),
                bias_axes_2=(W_NO_SHARD_AXES,), layernorm_input_axes=act_axes,
                dot_1_input_axes=(*_leading_axes(tbs, False), HIDDEN_AXES),
                dot_2_input_axes=(*_leading_axes(tbs, False), HIDDEN_TP_AXES),
                transpose_batch_sequence=tbs, name="mlp")(x, deterministic=deterministic)

        for dims in self.hidden_dropout_dims:
            if not -3 <= dims < 3:
                raise ValueError(f"`hidden_dropout_dims` must index the 3 dims of the input, got {dims}")

        def add(residual: jax.Array, out: jax.Array, name: str) -> jax.Array:
            out, residual = _constrain(out, act_axes), _constrain(residual, act_axes)
            out = nn.Dropout(rate=self.hidden_dropout, broadcast_dims=tuple(self.hidden_dropout_dims),
                             rng_collection=self.dropout_rng_name)(out, deterministic=deterministic)
            if self.drop_path > 0.0 and name != "cross_attention":
                # One keep/drop per sample: the mask is broadcast over every dim but the batch's.
                dims = tuple(i for i in range(out.ndim) if i != batch_dim)
                out = nn.Dropout(rate=self.drop_path, broadcast_dims=dims,
                                 rng_collection=self.dropout_rng_name)(out, deterministic=deterministic)
            return out + residual

        def output_norm(z: jax.Array) -> jax.Array:
            return LayerNorm(layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
                             epsilon=self.layernorm_epsilon, scale_axes=(W_NO_SHARD_AXES,),
                             bias_axes=(W_NO_SHARD_AXES,), dtype=self.dtype,
                             name="output_layernorm")(_constrain(z, act_axes))

        inputs = _constrain(inputs, act_axes)
        out = structure.run(inputs, sublayer, add, output_norm)
        return out
