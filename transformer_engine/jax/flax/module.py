"""``DotProductAttention``: a Flax linen module over :func:`transformer_engine.jax.attention.fused_attn`;
``TransformerEngineBase``: the base of modules that quantize their GEMMs (``generate_quantizer_set``)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_engine.common import recipe as _common_recipe
from transformer_engine.common.attention import enums as _common
from transformer_engine.common.attention.backends import fallback_message
from transformer_engine.common.log import get_logger, warn_once
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.inference import KVCache, kv_cache_attention
from transformer_engine.jax import quantize as _quantize
from transformer_engine.jax.enums import (AttnBiasType, AttnMaskType, AttnSoftmaxType, CPStrategy, QKVLayout,
                                          canonicalize_attn_mask_type, to_common)

__all__ = ["DotProductAttention", "TransformerEngineBase"]

_SBHD_OF = {
    _common.QKVLayout.BS3HD: _common.QKVLayout.SB3HD,
    _common.QKVLayout.BSHD_BS2HD: _common.QKVLayout.SBHD_SB2HD,
    _common.QKVLayout.BSHD_BSHD_BSHD: _common.QKVLayout.SBHD_SBHD_SBHD,
}

_CP_STRATEGIES = {"DEFAULT": CPStrategy.DEFAULT, "ALL_GATHER": CPStrategy.ALL_GATHER,
                  "ALLGATHER": CPStrategy.ALL_GATHER, "RING": CPStrategy.RING}


def _cp_strategy(value) -> CPStrategy:
    if isinstance(value, CPStrategy):
        return value
    key = value.upper() if isinstance(value, str) else value
    if key not in _CP_STRATEGIES:
        raise ValueError(
            f"`context_parallel_strategy` must be one of {', '.join(_CP_STRATEGIES)} (any case), got {value!r}"
        )
    return _CP_STRATEGIES[key]


def _descriptor_for_init(descriptor, batch: int):
    """The descriptor (or mask) for an initializing call with ``batch`` rows of queries.

    Initialization only creates the parameters (``softmax_offset``), whose values do not depend on
    the call's data. Callers initialize on dummy inputs of batch 1 with the descriptor of the real
    batch (MaxText's ``lazy_init`` of this module does); TransformerEngine runs that call, reading
    the descriptor's first rows. So does this: a descriptor with more rows than the queries is cut to
    its first ``batch`` rows. Outside initialization a batch mismatch is an error (``fused_attn``
    raises it, naming the argument)."""
    if descriptor is None:
        return None

    def rows(x):
        if x is None or getattr(x, "ndim", 0) == 0 or x.shape[0] <= batch:
            return x
        return x[:batch]

    if isinstance(descriptor, SequenceDescriptor):
        return jax.tree_util.tree_map(rows, descriptor)
    if isinstance(descriptor, (jax.Array, np.ndarray)):
        return rows(descriptor)
    return descriptor


class TransformerEngineBase(nn.Module):  # pylint: disable=too-few-public-methods
    """Base of the modules whose GEMMs run through :func:`transformer_engine.jax.dense.dense`:
    :meth:`generate_quantizer_set` makes a GEMM's quantizer set, keeping the delayed-scaling state
    in this module's Flax variables (MaxText subclasses it for its ``dot_general``)."""

    def generate_quantizer_set(self, postfix: str = "", variable_collection: Optional[str] = None,
                               quantization_checkpoint_name: Optional[str] = None, fp8_recipe: Any = None,
                               n_groups: Optional[int] = None):
        """The quantizer set of one GEMM, as TransformerEngine-JAX makes it.

        - ``fp8_recipe``: the recipe; None takes the enclosing ``autocast(enabled=True)``'s, and
          outside one the set is ``noop_quantizer_set`` (no quantization).
        - ``variable_collection``: where ``DelayedScaling`` keeps its state (default
          ``"fp8_metas"``): ``x{postfix}_scale``, ``kernel{postfix}_scale``, ``grad{postfix}_scale``
          (float32 ``[1]``, ones at init) and the ``..._amax_history`` variables (float32
          ``[amax_history_len]``, zeros). The other recipes keep no state. The state advances through
          the gradient: ``jax.grad`` with respect to this collection gives its next value, which the
          train step writes back (MaxText's ``_overwrite_with_gradient``).
        - ``quantization_checkpoint_name``: names the FP8 operands for remat policies.
        - ``n_groups``: must be None (grouped GEMMs are not implemented).

        Call it from a compact method (it creates variables)."""
        if fp8_recipe is None:
            fp8_recipe = _quantize.get_global_quantize_recipe()
        if fp8_recipe is None:
            return _quantize.QuantizerFactory.create_set(n_groups=n_groups)
        meta = {}
        if isinstance(fp8_recipe, _common_recipe.DelayedScaling):
            collection = variable_collection if variable_collection is not None else _quantize.NVTE_FP8_COLLECTION_NAME
            scale_shape, history_shape = _quantize.delayed_state_shapes(fp8_recipe)
            for source in (_quantize.TensorSource.X, _quantize.TensorSource.KERNEL, _quantize.TensorSource.DGRAD):
                name = f"{source.value}{postfix}"
                scale = self.variable(collection, f"{name}_scale", jnp.ones, scale_shape, jnp.float32).value
                history = self.variable(collection, f"{name}_amax_history", jnp.zeros, history_shape,
                                        jnp.float32).value
                meta[source.value] = (scale, history)
        return _quantize.QuantizerFactory.create_set(fp8_recipe=fp8_recipe, quantize_meta_set=meta,
                                                     checkpoint_name=quantization_checkpoint_name, n_groups=n_groups)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with TransformerEngine's fields (in its order), on the fused
    kernels when they can run (CUDA GPUs) and on the unfused jnp path otherwise, logging why once.

    Fields:

    - ``head_dim``: per-head size of queries and keys (values may differ).
    - ``num_attention_heads``: query heads.
    - ``num_gqa_groups``: key/value heads (``None``: as many as query heads); a divisor of
      ``num_attention_heads`` (GQA; 1 is MQA).
    - ``attention_dropout``: dropout probability on the attention weights (training only).
    - ``attn_mask_type``: ``'no_mask'``, ``'padding'``, ``'causal'``, ``'padding_causal'``,
      ``'causal_bottom_right'``, ``'padding_causal_bottom_right'`` (and TransformerEngine's
      aliases: ``'causal_padding'``, ``'bottom_right_causal'``, ...), or an ``AttnMaskType``.
    - ``attn_bias_type``: ``None`` (post_scale_bias when a bias is passed, else no_bias), or
      ``'no_bias'``, ``'pre_scale_bias'``, ``'post_scale_bias'`` (any case) or an ``AttnBiasType``.
    - ``dtype``: deprecated in TransformerEngine; ``None`` or the inputs' dtype (else ``ValueError``).
    - ``dropout_rng_name``: the Flax RNG stream dropout draws from.
    - ``float32_logits``: accepted; the logits are always computed in float32 here.
    - ``qkv_layout``: ``'bshd_bshd_bshd'`` (separate), ``'bshd_bs2hd'`` (``key`` is packed
      ``[b, s, 2, h, d]``, ``value`` None), ``'bs3hd'`` (``query`` is packed ``[b, s, 3, h, d]``),
      or their ``thd`` forms (rows packing several sequences; pass a SequenceDescriptor); any case.
    - ``scale_factor``: logits scale; ``None`` is ``1 / sqrt(head_dim)``.
    - ``transpose_batch_sequence``: inputs and output are ``[s, b, ...]`` instead of ``[b, s, ...]``
      (``None`` reads as False).
    - ``window_size``: ``(left, right)`` sliding window, ``-1`` unbounded.
    - ``bottom_right_diagonal``: the window's diagonal for the non-causal masks (``fused_attn``'s
      keyword: None = TransformerEngine-JAX's top-left, True = bottom-right).
    - ``max_segments_per_seq``: sequences per row for THD layouts.
    - ``context_parallel_causal_load_balanced``, ``context_parallel_axis``,
      ``context_parallel_strategy`` (``'DEFAULT'``, ``'ALL_GATHER'``, ``'RING'``): passed to
      :func:`~transformer_engine.jax.attention.fused_attn` (context parallelism over that mesh axis,
      :mod:`transformer_engine.jax.context_parallel`).
    - ``context_checkpoint_name``: the remat checkpoint name of the output.
    - ``softmax_type``: ``'vanilla'``, ``'off_by_one'`` (or ``'off-by-one'``) or ``'learnable'``, see
      :func:`~transformer_engine.jax.attention.fused_attn`. ``'learnable'`` owns the parameter
      ``softmax_offset`` (float32 ``[1, num_attention_heads, 1, 1]``, zeros at init), as
      TransformerEngine-JAX's module does.
    - ``score_mod``, ``score_mod_bprop``: must be ``None`` (``NotImplementedError``).
    - ``decode``: generation with a KV cache in the ``"cache"`` collection (Flax's convention, as in
      ``flax.linen.MultiHeadDotProductAttention``): ``init`` with inputs of the cache's size
      ``[max_batch_size, max_seqlen, ...]`` creates ``cached_key``, ``cached_value`` and
      ``cache_lengths`` (tokens cached per slot); each later ``apply(..., mutable=["cache"])`` appends its
      new tokens and attends them to their slots' cached keys
      (:func:`~transformer_engine.jax.inference.kv_cache_attention`, bshd): every output row is bitwise the
      row the module gives that token in a training call over the whole sequence. ``sequence_descriptor``
      is then ``None`` (every slot takes the call's ``t`` tokens) or an int array ``[max_batch_size]``: the
      new tokens of each slot (0: not in this step; rows past them are zeros). Separate bshd inputs only,
      no bias, dropout or context parallelism.

    ``__call__(query, key, value, sequence_descriptor=None, bias=None, *, deterministic=False,
    mask=None)``: ``sequence_descriptor`` is a ``SequenceDescriptor``, or a padding mask
    ``[b, 1, s_q, s_kv]`` with True (1) where attention is masked out (``mask`` is its deprecated
    name, as in TransformerEngine); ``deterministic=True`` disables dropout (Flax's meaning;
    bitwise reproducibility is ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``). A mask may also be
    ``[b, 1, ..., 1, s_q, s_kv]`` (MaxText passes ``[b, 1, 1, s_q, s_kv]``). While the module
    initializes (``init``, ``lazy_init``), a descriptor with more rows than the queries is read by
    its first rows, as TransformerEngine does. Returns
    ``[b, s_q, num_attention_heads, d_v]``.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: Union[str, AttnMaskType] = "causal"
    attn_bias_type: Optional[Union[str, AttnBiasType]] = None
    dtype: Optional[Any] = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: Union[str, QKVLayout] = "bshd_bshd_bshd"
    scale_factor: Optional[float] = None
    transpose_batch_sequence: Optional[bool] = False
    window_size: Optional[Tuple[int, int]] = None
    max_segments_per_seq: Optional[int] = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: Union[str, CPStrategy] = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: Union[str, AttnSoftmaxType] = "vanilla"
    score_mod: Optional[Callable] = None
    score_mod_bprop: Optional[Callable] = None
    bottom_right_diagonal: Optional[bool] = None
    decode: bool = False

    def _decode_step(self, layout: _common.QKVLayout, qkv, step_lens, bias, dropout: float, is_training: bool,
                     mask_type, scale: float, softmax_type, softmax_offset) -> Optional[jax.Array]:
        """``decode``: the cache's step, or None while the module initializes (the cache is created, and the
        call runs as a training call on the cache-sized inputs)."""
        if layout != _common.QKVLayout.BSHD_BSHD_BSHD or self.transpose_batch_sequence:
            raise ValueError("`qkv_layout` must be 'bshd_bshd_bshd' (and `transpose_batch_sequence` False) with "
                             f"decode=True, got {layout.value!r} (transpose_batch_sequence="
                             f"{self.transpose_batch_sequence})")
        if bias is not None:
            raise ValueError("`bias` must be None with decode=True (the cache keeps no bias), got an array")
        if dropout > 0.0 and is_training:
            raise ValueError(f"`attention_dropout` must be 0 (or deterministic=True) with decode=True, got {dropout}")
        if self.context_parallel_axis:
            raise ValueError("`context_parallel_axis` must be empty with decode=True, got "
                             f"{self.context_parallel_axis!r}")
        q, k, v = qkv
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        lengths = self.variable("cache", "cache_lengths", jnp.zeros, (k.shape[0],), jnp.int32)
        if not initialized:
            return None
        if step_lens is not None and (isinstance(step_lens, SequenceDescriptor) or jnp.ndim(step_lens) != 1):
            raise ValueError("`sequence_descriptor` must be None or an int array [max_batch_size] of new tokens "
                             f"per slot with decode=True, got {type(step_lens).__name__}")
        cache = KVCache(cached_key.value, cached_value.value, lengths.value)
        out, cache = kv_cache_attention(q, k, v, cache, step_lens, attn_mask_type=mask_type,
                                        window_size=self.window_size, softmax_type=softmax_type,
                                        softmax_offset=softmax_offset, scaling_factor=scale, qkv_format="bshd")
        cached_key.value, cached_value.value, lengths.value = cache.k, cache.v, cache.lengths
        return out

    def _layout(self) -> _common.QKVLayout:
        layout = to_common(self.qkv_layout, _common.QKVLayout, "qkv_layout")
        if self.transpose_batch_sequence:
            if layout.qkv_format == _common.QKVFormat.THD:
                raise ValueError(f"`transpose_batch_sequence` must be False with qkv_layout={layout.value!r}")
            layout = _SBHD_OF.get(layout, layout)
        return layout

    def _qkv(self, layout: _common.QKVLayout, query, key, value) -> Tuple[Any, ...]:
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

    def _check_heads(self, layout: _common.QKVLayout, qkv) -> None:
        q_heads, q_dim = qkv[0].shape[-2], qkv[0].shape[-1]
        if q_heads != self.num_attention_heads:
            raise ValueError(f"`num_attention_heads` is {self.num_attention_heads} but the query has {q_heads} heads")
        if q_dim != self.head_dim:
            raise ValueError(f"`head_dim` is {self.head_dim} but the query has head dim {q_dim}")
        kv_heads = qkv[-1].shape[-2]
        expected = self.num_gqa_groups or self.num_attention_heads
        if kv_heads != expected:
            raise ValueError(f"`num_gqa_groups` is {expected} but key/value have {kv_heads} heads")

    def _check_dtype(self, query) -> None:
        if self.dtype is not None and jnp.dtype(self.dtype) != query.dtype:
            raise ValueError(
                f"`dtype` must be None or the inputs' dtype ({query.dtype}; the module has no parameters and "
                f"computes in the inputs' dtype), got {jnp.dtype(self.dtype).name}"
            )

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
        mask: Optional[Union[SequenceDescriptor, jax.Array]] = None,
        score_mod_tensors: Optional[Mapping[str, Any]] = None,
        score_mod_bprop_tensors: Optional[Mapping[str, Any]] = None,
    ) -> jax.Array:
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError("`mask` must be None when `sequence_descriptor` is given (it is its old name)")
            warnings.warn("`mask` is deprecated, pass `sequence_descriptor` instead", DeprecationWarning, stacklevel=2)
            sequence_descriptor = mask
        layout = self._layout()
        qkv = self._qkv(layout, query, key, value)
        self._check_heads(layout, qkv)
        self._check_dtype(qkv[0])
        if self.is_initializing():
            batch = qkv[0].shape[1 if self.transpose_batch_sequence else 0]
            sequence_descriptor = _descriptor_for_init(sequence_descriptor, batch)
        if self.attn_bias_type is None:
            bias_type = _common.AttnBiasType.NO_BIAS if bias is None else _common.AttnBiasType.POST_SCALE_BIAS
        else:
            bias_type = to_common(self.attn_bias_type, _common.AttnBiasType, "attn_bias_type")
        if bias is not None:
            bias = jnp.asarray(bias).astype(qkv[0].dtype)  # as TransformerEngine's module does
        is_training = not deterministic
        dropout = float(self.attention_dropout)
        seed = self.make_rng(self.dropout_rng_name) if (is_training and dropout > 0.0) else None
        scale = self.scale_factor if self.scale_factor is not None else self.head_dim**-0.5
        softmax_offset = None
        softmax_type = _attention._softmax_type(self.softmax_type, None)
        if softmax_type.is_learnable:
            softmax_offset = self.param("softmax_offset", nn.initializers.zeros, (1, self.num_attention_heads, 1, 1),
                                        jnp.float32)

        mask_type = to_common(canonicalize_attn_mask_type(self.attn_mask_type), _common.AttnMaskType, "attn_mask_type")
        if self.decode:
            out = self._decode_step(layout, qkv, sequence_descriptor, bias, dropout, is_training, mask_type, scale,
                                    softmax_type, softmax_offset)
            if out is not None:
                return out
            sequence_descriptor = None  # initializing: a training call over the cache-sized inputs
        out, selection = _attention._attention_with_selection(_attention._FusedAttnArgs(
            qkv=qkv, bias=bias, sequence_descriptor=sequence_descriptor, seed=seed, attn_bias_type=bias_type,
            attn_mask_type=mask_type, qkv_layout=layout,
            softmax_type=softmax_type, scaling_factor=scale, dropout_probability=dropout,
            is_training=is_training, max_segments_per_seq=self.max_segments_per_seq, window_size=self.window_size,
            context_parallel_strategy=_cp_strategy(self.context_parallel_strategy),
            context_parallel_causal_load_balanced=self.context_parallel_causal_load_balanced,
            context_parallel_axis=self.context_parallel_axis,
            context_checkpoint_name=self.context_checkpoint_name, score_mod=self.score_mod,
            score_mod_bprop=self.score_mod_bprop, score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors, bottom_right_diagonal=self.bottom_right_diagonal,
            softmax_offset=softmax_offset,
        ))
        fused_reasons = selection.rejected.get(_attention.FusedAttention.NAME)
        # flash-attn-4 in its place is no fallback; a deterministic training call's fallback was reported by the
        # selection, in the same words.
        if fused_reasons and not selection.backend.IS_FUSED and not selection.fallback_reported:
            reasons = {_attention.FusedAttention.NAME: fused_reasons}
            warn_once(f"flax-dpa-fallback:{reasons}", fallback_message(selection.name, reasons, False))
        get_logger().debug("DotProductAttention ran %s", selection.name)
        return out
