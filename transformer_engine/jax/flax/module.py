"""``DotProductAttention``: a Flax linen module over :func:`transformer_engine.jax.attention.fused_attn`;
``TransformerEngineBase``: the base of modules that quantize their GEMMs (``generate_quantizer_set``);
``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral``, ``LayerNormMLP``: TransformerEngine-JAX's
layers (fields, parameter names and shapes), their GEMMs through :func:`transformer_engine.jax.dense.dense`."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name

from transformer_engine.common import modules as _modules
from transformer_engine.common.attention import enums as _common
from transformer_engine.common.attention.backends import fallback_message
from transformer_engine.common.log import get_logger, warn_once
from transformer_engine.jax import attention as _attention
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.inference import KVCache, kv_cache_attention
from transformer_engine.jax import quantize as _quantize
from transformer_engine.jax.dense import dense as _dense
from transformer_engine.jax.sharding import with_sharding_constraint_by_logical_axes as _constrain
from transformer_engine.jax.enums import (AttnBiasType, AttnMaskType, AttnSoftmaxType, CPStrategy, QKVLayout,
                                          canonicalize_attn_mask_type, to_common)

__all__ = ["DenseGeneral", "DotProductAttention", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP",
           "TransformerEngineBase"]

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
        if _quantize.recipe_quantizers(fp8_recipe).stateful:
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


# ------------------------------------------------------------------------------------------------
# Dense, norm and MLP layers (TransformerEngine-JAX's fields, in its order)
# ------------------------------------------------------------------------------------------------

Initializer = Callable[..., Any]

# TransformerEngine-JAX's activation tuples -> the shared table (transformer_engine.common.modules).
# A gated tuple's first name acts on index 0 of FC1's activation axis, its second ("linear") on index 1;
# flattening that axis puts them in the table's [gate | linear] halves.
_ACTIVATION_NAMES = {
    ("gelu",): "gelu", ("gelu", "linear"): "geglu",
    ("silu",): "silu", ("silu", "linear"): "swiglu",
    ("relu",): "relu", ("relu", "linear"): "reglu",
    ("quick_gelu",): "qgelu", ("quick_gelu", "linear"): "qgeglu",
    ("squared_relu",): "srelu", ("squared_relu", "linear"): "sreglu",
    ("sigmoid", "linear"): "glu",
    ("clamped_silu", "clamped_linear"): "clamped_swiglu",
}
_CLAMPED_SWIGLU_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}


def _canonicalize_tuple(x) -> Tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _normalize_axes(axes: Tuple[int, ...], ndim: int, name: str = "axis") -> Tuple[int, ...]:
    out = []
    for ax in axes:
        if not isinstance(ax, (int, np.integer)) or not -ndim <= ax < ndim:
            raise ValueError(f"`{name}` must index the input's {ndim} dims, got {axes}")
        out.append(int(ax) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"`{name}` must not repeat an axis, got {axes}")
    return tuple(out)


def canonicalize_norm_type(layernorm_type: str) -> str:
    """'layernorm' or 'rmsnorm' from any case, with '-' and '_' ignored (TransformerEngine's reading)."""
    key = layernorm_type.lower().strip().replace("-", "").replace("_", "") if isinstance(layernorm_type, str) else None
    if key not in ("layernorm", "rmsnorm"):
        raise ValueError(f"`layernorm_type` must be 'layernorm' or 'rmsnorm', got {layernorm_type!r}")
    return key


def layernorm(x: jax.Array, scale: jax.Array, ln_bias: Optional[jax.Array], norm_type: str = "layernorm",
              zero_centered_gamma: bool = False, epsilon: float = 1e-6) -> jax.Array:
    """LayerNorm or RMSNorm over the last axis, computed in float32 and cast back to ``x.dtype``.

    ``layernorm``: ``(x - mean) / sqrt(var + epsilon) * gamma + beta``; ``rmsnorm``:
    ``x / sqrt(mean(x^2) + epsilon) * gamma``; ``gamma`` is ``1 + scale`` with ``zero_centered_gamma``
    (for both, as TransformerEngine-JAX computes it), else ``scale``."""
    norm_type = canonicalize_norm_type(norm_type)
    from transformer_engine.jax.batch_invariance import bi_norm, is_batch_invariant

    if is_batch_invariant():  # the kernels of PyTorch's batch-invariant mode (jax.batch_invariance)
        return bi_norm(x, scale, ln_bias if norm_type == "layernorm" else None, epsilon, norm_type == "rmsnorm",
                       zero_centered_gamma)
    x32 = x.astype(jnp.float32)
    if norm_type == "layernorm":
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    else:
        centered = x32
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    gamma = scale.astype(jnp.float32)
    if zero_centered_gamma:
        gamma = gamma + 1.0
    out = centered * jax.lax.rsqrt(var + epsilon) * gamma
    if norm_type == "layernorm":
        out = out + ln_bias.astype(jnp.float32)
    return out.astype(x.dtype)


def _scale_init(scale_init: Optional[Initializer], zero_centered_gamma: bool) -> Initializer:
    if scale_init is not None:
        return scale_init
    return nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones


def _kernel_init(kernel_init: Optional[Initializer], dtype, distribution: str = "truncated_normal") -> Initializer:
    if kernel_init is not None:
        return kernel_init
    return nn.initializers.variance_scaling(1.0, "fan_in", distribution, dtype=dtype)


def _norm_params(module: nn.Module, norm_type: str, features: int, scale_init, scale_axes, bias_init, bias_axes,
                 input_dtype, dtype) -> Tuple[jax.Array, Optional[jax.Array]]:
    """``scale`` (and ``ln_bias`` for layernorm), created in ``dtype`` and read in the input's dtype."""
    scale = module.param("scale", nn.with_logical_partitioning(scale_init, scale_axes), (features,), dtype)
    ln_bias = None
    if canonicalize_norm_type(norm_type) == "layernorm":
        ln_bias = module.param("ln_bias", nn.with_logical_partitioning(bias_init, bias_axes), (features,), dtype)
        ln_bias = ln_bias.astype(input_dtype)
    return scale.astype(input_dtype), ln_bias


def _bias_add(x: jax.Array, bias: jax.Array) -> jax.Array:
    """``x + bias``; in batch-invariant mode the bias's gradient is PyTorch's mode's (jax.batch_invariance)."""
    from transformer_engine.jax.batch_invariance import bias_add

    return bias_add(x, bias)


def _refuse_lora(enable_low_rank_adaptation: bool) -> None:
    if enable_low_rank_adaptation:
        raise NotImplementedError("`enable_low_rank_adaptation=True` is not implemented: the layers here train their "
                                  "full kernels (no LoRA kernels)")


def _refuse_other_axis(axis) -> None:
    if _canonicalize_tuple(axis) != (-1,):
        raise NotImplementedError(f"`axis` must be -1 (the layer normalizes and contracts the last axis, as "
                                  f"TransformerEngine-JAX's), got {axis!r}")


def _dense_call(inputs: jax.Array, kernel: jax.Array, axis: Tuple[int, ...],
                quantizer_set, input_axes, kernel_axes, transpose_batch_sequence: bool) -> jax.Array:
    """``inputs`` contracted over ``axis`` with the kernel's leading dims through
    :func:`transformer_engine.jax.dense.dense` (which contracts trailing dims: other axes are moved
    last first, which leaves the output's order that of ``dot_general``)."""
    trailing = tuple(range(inputs.ndim - len(axis), inputs.ndim))
    if axis != trailing:
        inputs = jnp.moveaxis(inputs, axis, trailing)
        input_axes = None  # the given axes name the input's original order
    if quantizer_set.is_noop:
        kernel = kernel.astype(inputs.dtype)
    return _dense(inputs, kernel, contracting_dims=(trailing, tuple(range(len(axis)))),
                 transpose_batch_sequence=transpose_batch_sequence, input_axes=input_axes or None,
                 kernel_axes=kernel_axes or None, quantizer_set=quantizer_set)


class LayerNorm(nn.Module):  # pylint: disable=too-few-public-methods
    """LayerNorm (``layernorm_type='layernorm'``) or RMSNorm (``'rmsnorm'``) over the last axis.

    Fields (TransformerEngine-JAX's): ``epsilon``; ``layernorm_type`` (any case, '-'/'_' ignored);
    ``zero_centered_gamma`` (the scale applied is ``1 + scale``, whose default init is then zeros);
    ``scale_init`` (None: ones, or zeros under ``zero_centered_gamma``), ``scale_axes``;
    ``bias_init``, ``bias_axes`` (layernorm's ``ln_bias``); ``dtype``: the parameters' dtype.
    Parameters: ``scale`` ``[hidden]`` and, for layernorm, ``ln_bias`` ``[hidden]``. Computes in
    float32 (see :func:`layernorm`) and returns the input's dtype."""

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ("embed",)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale, ln_bias = _norm_params(self, self.layernorm_type, x.shape[-1],
                                      _scale_init(self.scale_init, self.zero_centered_gamma), self.scale_axes,
                                      self.bias_init, self.bias_axes, x.dtype, self.dtype)
        return layernorm(x, scale, ln_bias, self.layernorm_type, self.zero_centered_gamma, self.epsilon)


class DenseGeneral(TransformerEngineBase):
    """``y = x @ kernel + bias`` over the input axes ``axis``, through
    :func:`transformer_engine.jax.dense.dense` (FP8 under :func:`transformer_engine.jax.autocast`).

    Fields (TransformerEngine-JAX's): ``features`` (int or tuple: the kernel's trailing dims);
    ``kernel_init`` (None: ``variance_scaling(1.0, 'fan_in', 'truncated_normal')``), ``kernel_axes``
    (one logical name per kernel dim, or empty); ``use_bias`` (default True, as TransformerEngine-JAX's
    field), ``bias_init``, ``bias_axes``; ``axis``: the contracted input axes (any, in the kernel's
    order); ``dtype``: the parameters' dtype (the computation runs in the input's); ``input_axes``:
    the input's logical axes (a sharding constraint); ``transpose_batch_sequence``;
    ``quantization_checkpoint_name``. ``enable_low_rank_adaptation=True`` is refused
    (``NotImplementedError``); ``low_rank_adaptation_dim`` and ``_alpha`` are then unused.
    Parameters: ``kernel`` ``[*input dims at axis, *features]``, ``bias`` ``[*features]``.
    """

    features: Union[Tuple[int, ...], int]
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[str, ...] = ()
    use_bias: bool = True
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[Tuple[int, ...], int] = -1
    dtype: Any = jnp.float32
    input_axes: Tuple[str, ...] = ()
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        _refuse_lora(self.enable_low_rank_adaptation)
        features = _canonicalize_tuple(self.features)
        axis = _normalize_axes(_canonicalize_tuple(self.axis), inputs.ndim)
        kernel_shape = tuple(inputs.shape[ax] for ax in axis) + features
        if self.kernel_axes and len(self.kernel_axes) != len(kernel_shape):
            raise ValueError(f"`kernel_axes` must name each of the kernel's {len(kernel_shape)} dims "
                             f"{kernel_shape}, got {self.kernel_axes}")
        kernel = self.param("kernel", nn.with_logical_partitioning(_kernel_init(self.kernel_init, self.dtype),
                                                                   self.kernel_axes), kernel_shape, self.dtype)
        quantizer_set = self.generate_quantizer_set(quantization_checkpoint_name=self.quantization_checkpoint_name)
        y = _dense_call(inputs, kernel, axis, quantizer_set, self.input_axes, self.kernel_axes,
                        self.transpose_batch_sequence)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes), features,
                              self.dtype).astype(inputs.dtype)
            y = _bias_add(y, bias)
        return y


class LayerNormDenseGeneral(TransformerEngineBase):
    """A norm (:class:`LayerNorm`'s) then :class:`DenseGeneral` over the last axis.

    Fields (TransformerEngine-JAX's): ``features``; ``enable_layernorm``; ``layernorm_type``,
    ``epsilon``, ``zero_centered_gamma``, ``scale_init``, ``scale_axes``, ``ln_bias_init``,
    ``ln_bias_axes`` (the norm's); ``kernel_init``, ``kernel_axes``, ``use_bias`` (default False),
    ``bias_init``, ``bias_axes`` (the dense's); ``return_layernorm_output``; ``axis`` (must be -1);
    ``dtype``; ``layernorm_input_axes``, ``dot_input_axes`` (logical axes of the norm's and the GEMM's
    inputs); ``depth_scaling`` (the output is divided by it); ``transpose_batch_sequence``;
    ``quantization_checkpoint_name``. ``enable_low_rank_adaptation=True`` is refused.
    Parameters: ``scale``, ``ln_bias`` (layernorm), ``kernel`` ``[hidden, *features]``, ``bias``.
    Returns ``(output, norm output or None)``: the norm's output (the input without the norm) when
    ``return_layernorm_output``."""

    features: Union[Tuple[int, ...], int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[str, ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes: Tuple[str, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes: Tuple[str, ...] = ()
    return_layernorm_output: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[Tuple[int, ...], int] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_input_axes: Optional[Tuple[str, ...]] = None
    depth_scaling: Optional[float] = None
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> Tuple[jax.Array, Optional[jax.Array]]:
        _refuse_lora(self.enable_low_rank_adaptation)
        _refuse_other_axis(self.axis)
        quantizer_set = self.generate_quantizer_set(quantization_checkpoint_name=self.quantization_checkpoint_name)
        y = inputs
        if self.enable_layernorm:
            inputs = _constrain(inputs, self.layernorm_input_axes)
            scale, ln_bias = _norm_params(self, self.layernorm_type, inputs.shape[-1],
                                          _scale_init(self.scale_init, self.zero_centered_gamma), self.scale_axes,
                                          self.ln_bias_init, self.ln_bias_axes, inputs.dtype, self.dtype)
            y = layernorm(inputs, scale, ln_bias, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        ln_output = y if self.return_layernorm_output else None
        features = _canonicalize_tuple(self.features)
        kernel_shape = (inputs.shape[-1],) + features
        kernel = self.param("kernel", nn.with_logical_partitioning(_kernel_init(self.kernel_init, self.dtype),
                                                                   self.kernel_axes), kernel_shape, self.dtype)
        y = _constrain(y, self.dot_input_axes)
        z = _dense_call(y, kernel, (y.ndim - 1,), quantizer_set, self.dot_input_axes, self.kernel_axes,
                        self.transpose_batch_sequence)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes), features,
                              self.dtype).astype(inputs.dtype)
            z = _bias_add(z, bias)
        if self.depth_scaling is not None:
            z = z / self.depth_scaling
        return z, ln_output


def _normalized_activations(activations) -> Tuple:
    """TransformerEngine-JAX's reading of ``activations``: lower-cased names, a leading 'linear' (or
    'clamped_linear') moved last so that the gate comes first."""
    acts = tuple(a.lower() if isinstance(a, str) else a for a in _canonicalize_tuple(activations))
    if not acts:
        raise ValueError("`activations` must name at least one activation, got ()")
    if acts[0] in ("linear", "clamped_linear"):
        acts = tuple(reversed(acts))
    return acts


def _activation_fn(name_or_fn, params: Mapping[str, float]) -> Callable:
    """One factor of a product of activations outside the shared table (TransformerEngine-JAX's
    fallback): 'linear', its own 'quick_gelu', 'squared_relu' and clamped forms, any other
    ``jax.nn`` function by name, or a callable."""
    if callable(name_or_fn):
        return name_or_fn
    limit, alpha = params["limit"], params["alpha"]
    named = {
        "linear": lambda x: x,
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "squared_relu": lambda x: jnp.square(jax.nn.relu(x)),
        "clamped_silu": lambda x: jnp.minimum(x, limit) * jax.nn.sigmoid(alpha * jnp.minimum(x, limit)),
        "clamped_linear": lambda x: jnp.clip(x, -limit, limit) + params["glu_linear_offset"],
    }
    if name_or_fn in named:
        return named[name_or_fn]
    fn = getattr(jax.nn, name_or_fn, None) if isinstance(name_or_fn, str) else None
    if not callable(fn):
        raise ValueError(f"`activations` must hold 'linear', names of jax.nn functions or callables, got "
                         f"{name_or_fn!r}")
    return fn


def mlp_activation(x: jax.Array, activations, activation_params: Optional[Mapping[str, float]] = None) -> jax.Array:
    """The activation of FC1's output ``x`` ``[..., len(activations), intermediate]``: ``[..., intermediate]``.

    A tuple TransformerEngine runs as one fused activation (``('gelu',)``, ``('gelu', 'linear')``,
    ``('silu', 'linear')``, ... see ``_ACTIVATION_NAMES``) is the shared table's entry of
    :mod:`transformer_engine.common.modules` ('gelu' is the tanh approximation, as TransformerEngine's
    kernels and ``jax.nn.gelu``'s default compute it), in float32; any other tuple is the product of its
    factors (:func:`_activation_fn`), in the input's dtype, as TransformerEngine-JAX's fallback."""
    acts = _normalized_activations(activations)
    if x.shape[-2] != len(acts):
        raise ValueError(f"FC1's output must have {len(acts)} activation rows on axis -2, got shape {x.shape}")
    params = dict(_CLAMPED_SWIGLU_DEFAULTS, **(activation_params or {}))
    name = _ACTIVATION_NAMES.get(acts)
    if name is not None:
        table_params = params if name == "clamped_swiglu" else None
        from transformer_engine.jax.batch_invariance import bi_activation, is_batch_invariant

        if is_batch_invariant():  # the kernel of PyTorch's batch-invariant mode (jax.batch_invariance)
            return bi_activation(x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1]), name, table_params)
        flat = x.astype(jnp.float32).reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
        return _modules.apply_activation(jnp, name, flat, table_params).astype(x.dtype)
    out = None
    for idx, act in enumerate(acts):
        y = _activation_fn(act, params)(x[..., idx, :])
        out = y if out is None else out * y
    return out


class LayerNormMLP(TransformerEngineBase):
    """A norm, FC1, the activation(s), dropout, FC2 (TransformerEngine-JAX's ``LayerNormMLP``).

    Fields (TransformerEngine-JAX's, in its order): ``intermediate_dim``; ``enable_layernorm``,
    ``layernorm_type``, ``epsilon``, ``zero_centered_gamma``, ``scale_init``, ``scale_axes``,
    ``ln_bias_init``, ``ln_bias_axes``; ``kernel_init`` (both kernels), ``kernel_axes_1``,
    ``kernel_axes_2``; ``use_bias``, ``bias_init``, ``bias_axes_1``, ``bias_axes_2``;
    ``return_layernorm_output``; ``activations`` (a tuple such as ``('gelu',)``,
    ``('gelu', 'linear')``, ``('silu', 'linear')``: see :func:`mlp_activation`);
    ``activation_params`` (``limit``, ``alpha``, ``glu_linear_offset`` of
    ``('clamped_silu', 'clamped_linear')``; defaults 7.0, 1.702, 1.0); ``intermediate_dropout_rng_name``,
    ``intermediate_dropout_rate``, ``intermediate_hidden_dropout_dims`` (dropout after the activation);
    ``axis`` (must be -1); ``dtype``; ``layernorm_input_axes``, ``dot_1_input_axes``,
    ``dot_2_input_axes``; ``ffn1_ckpt_name``, ``ffn2_ckpt_name`` (remat names of FC1's and FC2's
    outputs); ``transpose_batch_sequence``; ``quantization_checkpoint_name``.
    ``enable_low_rank_adaptation=True`` is refused.

    Parameters, as TransformerEngine-JAX lays them out: ``scale``, ``ln_bias``; ``wi_kernel``
    ``[hidden, len(activations), intermediate_dim]`` (one FC1 kernel per activation, stacked on axis 1);
    ``wo_kernel`` ``[intermediate_dim, hidden]``; ``wi_bias`` ``[len(activations), intermediate_dim]``,
    ``wo_bias`` ``[hidden]``. The two GEMMs' quantizer sets carry the postfixes ``_0`` and ``_1``.
    ``__call__(inputs, deterministic=False)`` returns ``(output, norm output or None)``."""

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    scale_axes: Tuple[str, ...] = ("embed",)
    ln_bias_init: Initializer = nn.initializers.zeros
    ln_bias_axes: Tuple[str, ...] = ("embed",)
    kernel_init: Optional[Initializer] = None
    kernel_axes_1: Tuple[str, ...] = ("embed", "act", "mlp")
    kernel_axes_2: Tuple[str, ...] = ("mlp", "embed")
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    bias_axes_1: Tuple[str, ...] = ("act", "mlp")
    bias_axes_2: Tuple[str, ...] = ("embed",)
    return_layernorm_output: bool = False
    activations: Tuple[Union[str, Callable], ...] = ("gelu",)
    activation_params: Optional[Mapping[str, float]] = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Tuple[int, ...] = ()
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    axis: Union[Tuple[int, ...], int] = -1
    dtype: Any = jnp.float32
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_1_input_axes: Optional[Tuple[str, ...]] = None
    dot_2_input_axes: Optional[Tuple[str, ...]] = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    transpose_batch_sequence: bool = False
    quantization_checkpoint_name: Optional[str] = None

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False) -> Tuple[jax.Array, Optional[jax.Array]]:
        _refuse_lora(self.enable_low_rank_adaptation)
        _refuse_other_axis(self.axis)
        acts = _normalized_activations(self.activations)
        unknown = sorted(set(self.activation_params or {}) - set(_CLAMPED_SWIGLU_DEFAULTS))
        if unknown:
            raise ValueError(f"`activation_params` must only hold {', '.join(_CLAMPED_SWIGLU_DEFAULTS)}, got {unknown}")
        ckpt = self.quantization_checkpoint_name
        ffn1_quantizer_set = self.generate_quantizer_set("_0", quantization_checkpoint_name=ckpt)
        ffn2_quantizer_set = self.generate_quantizer_set("_1", quantization_checkpoint_name=ckpt)
        input_dtype = inputs.dtype
        hidden = inputs.shape[-1]
        kernel_init = _kernel_init(self.kernel_init, self.dtype)
        y = inputs
        if self.enable_layernorm:
            inputs = _constrain(inputs, self.layernorm_input_axes)
            scale, ln_bias = _norm_params(self, self.layernorm_type, hidden,
                                          _scale_init(self.scale_init, self.zero_centered_gamma), self.scale_axes,
                                          self.ln_bias_init, self.ln_bias_axes, input_dtype, self.dtype)
            y = layernorm(inputs, scale, ln_bias, self.layernorm_type, self.zero_centered_gamma, self.epsilon)
        ln_output = y if self.return_layernorm_output else None

        def wi_init(key, num_kernels, each_shape, dtype):
            # One kernel per activation, stacked on the activation axis; each from a key split off in turn
            # (TransformerEngine-JAX's sequence, so that a seed gives its initial values).
            kernels = []
            for _ in range(num_kernels):
                key, sub = jax.random.split(key)
                kernels.append(kernel_init(sub, each_shape, dtype))
            return jnp.stack(kernels, axis=-2).astype(dtype)

        num_acts = len(acts)
        wi_kernel = self.param("wi_kernel", nn.with_logical_partitioning(wi_init, self.kernel_axes_1), num_acts,
                               (hidden, self.intermediate_dim), self.dtype)
        wo_kernel = self.param("wo_kernel", nn.with_logical_partitioning(kernel_init, self.kernel_axes_2),
                               (self.intermediate_dim, hidden), self.dtype)
        if self.use_bias:
            wi_bias = self.param("wi_bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes_1),
                                 (num_acts, self.intermediate_dim), self.dtype).astype(input_dtype)
            wo_bias = self.param("wo_bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes_2),
                                 (hidden,), self.dtype).astype(input_dtype)

        y = _constrain(y, self.dot_1_input_axes)
        x = _dense_call(y, wi_kernel, (y.ndim - 1,), ffn1_quantizer_set, self.dot_1_input_axes,
                        self.kernel_axes_1, self.transpose_batch_sequence)
        if self.use_bias:
            x = _bias_add(x, wi_bias)
        x = checkpoint_name(x, self.ffn1_ckpt_name)
        z = mlp_activation(x, acts, self.activation_params).astype(input_dtype)
        z = nn.Dropout(rate=self.intermediate_dropout_rate, broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                       rng_collection=self.intermediate_dropout_rng_name)(z, deterministic=deterministic)
        z = _constrain(z, self.dot_2_input_axes)
        out = _dense_call(z, wo_kernel, (z.ndim - 1,), ffn2_quantizer_set, self.dot_2_input_axes,
                          self.kernel_axes_2, self.transpose_batch_sequence)
        if self.use_bias:
            out = _bias_add(out, wo_bias)
        out = checkpoint_name(out, self.ffn2_ckpt_name)
        return out, ln_output
