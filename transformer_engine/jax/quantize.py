"""FP8 quantization for the JAX frontend, with TransformerEngine-JAX's names: ``autocast``, recipes
turned into quantizer sets, and the quantized operands :func:`transformer_engine.jax.dense.dense`
multiplies.

A recipe is read once, as PyTorch reads it: ``common.quantizer_roles.quantizers_for`` gives a spec per
role (x is the input, kernel the weight, grad the output gradient) and the GEMMs' accumulation, and
:class:`QuantizerFactory` builds one quantizer per spec by its scaling kind (delayed, current, block);
nothing here looks at the recipe's type.

Recipes (``transformer_engine.common.recipe``):

- ``DelayedScaling``: per-tensor scales from an amax history kept in a Flax variable collection
  (``{x,kernel,grad}{postfix}_scale`` of shape ``[1]`` and ``..._amax_history`` of shape
  ``[amax_history_len]``, as TransformerEngine-JAX names them). Each quantization uses the stored
  scale and folds the tensor's amax into ``amax_history[0]``; the state that leaves the step is
  updated once from it (next scale from the history, history rolled), PyTorch's update at autocast
  exit and after the backward, with the same shared functions. The updated state leaves ``dense`` as the *gradient* of the state variables (the
  forward of a differentiated function cannot write Flax variables): a train step replaces the
  variables by their gradients, which is what MaxText's ``_overwrite_with_gradient`` collection
  means.
- ``Float8CurrentScaling``: per-tensor scales from the tensor's own amax; no state.
- ``Float8BlockScaling``: 1x128 tiles of activations and gradients, 128x128 tiles of weights,
  power-of-two scales by default; no state.
- ``MXFP8BlockScaling``, ``NVFP4BlockScaling`` (Blackwell tensor cores) and ``CustomRecipe`` are
  refused by name.

Formats: the forward tensors (x, kernel) take the recipe's forward format, the gradient its
backward format (``Format.HYBRID``: E4M3 forward, E5M2 gradients). The scale formulas are
:mod:`transformer_engine.common.quantization`'s. Amaxes are of the whole (global) tensor: under
``jit`` with sharded arrays XLA reduces them over the devices, and a max does not depend on the
order, so every quantity here is deterministic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import warnings
from typing import Any, Iterator, List, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.tree_util import register_pytree_node_class

from transformer_engine.common import quantization as _q
from transformer_engine.common import quantizer_roles as _roles
from transformer_engine.common import recipe as _recipe
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

__all__ = [
    "AmaxComputeAlgo",
    "NVTE_FP8_COLLECTION_NAME",
    "Quantizer",
    "DelayedScaleQuantizer",
    "CurrentScaleQuantizer",
    "BlockScaleQuantizer",
    "QuantizerSet",
    "QuantizerFactory",
    "ScaledTensor",
    "ScalingMode",
    "TensorSource",
    "autocast",
    "fp8_autocast",
    "get_global_quantize_recipe",
    "is_fp8_available",
    "noop_quantizer_set",
    "recipe_quantizers",
]

# TransformerEngine-JAX's default collection for the delayed-scaling state.
NVTE_FP8_COLLECTION_NAME = "fp8_metas"

_FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


class ScalingMode(enum.Enum):
    """How a tensor is scaled. ``BLOCK_SCALING_1D`` / ``BLOCK_SCALING_2D`` are Float8BlockScaling's
    1x128 and 128x128 tiles (TransformerEngine's C API names); MXFP8 and NVFP4 are named so that
    they can be refused."""

    NO_SCALING = "no_scaling"
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    BLOCK_SCALING_1D = "block_scaling_1d"
    BLOCK_SCALING_2D = "block_scaling_2d"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"
    NVFP4_2D_SCALING = "nvfp4_2d_scaling"

    def is_tensor_scaling(self) -> bool:
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    def is_block_scaling(self) -> bool:
        return self in (ScalingMode.BLOCK_SCALING_1D, ScalingMode.BLOCK_SCALING_2D)


class TensorSource(enum.Enum):
    """The role of a quantized tensor in a dense layer."""

    X = "x"
    KERNEL = "kernel"
    DGRAD = "grad"


class AmaxComputeAlgo(enum.Enum):
    MAX = "max"
    MOST_RECENT = "most_recent"


# ------------------------------------------------------------------------------------------------
# Which recipes run where
# ------------------------------------------------------------------------------------------------

def _device_reasons(block: bool) -> List[str]:
    """Why FP8 cannot run on the default device (empty: it can). CPU and TPU run the quantized math
    with XLA's own FP8 dot (no speed-up, the same numbers); CUDA needs FP8 tensor cores (sm89+,
    sm90+ for block scaling, as TransformerEngine requires)."""
    device = jax.devices()[0]
    if device.platform in ("cpu", "tpu"):
        return []
    if device.platform in ("gpu", "cuda"):
        cc = getattr(device, "compute_capability", None)
        try:
            major, minor = (int(p) for p in str(cc).split(".")[:2])
        except ValueError:
            return [f"the GPU's compute capability is unknown ({cc!r})"]
        need = (9, 0) if block else (8, 9)
        if (major, minor) < need:
            what = "Float8BlockScaling" if block else "FP8"
            return [f"{what} needs compute capability {need[0]}.{need[1]}+, this GPU ({device.device_kind}) "
                    f"is {major}.{minor}"]
        return []
    return [f"FP8 is implemented for CPU, TPU and CUDA devices, not {device.platform!r} (ROCm's FP8 formats "
            "are the 'fnuz' variants)"]


def _recipe_reasons(recipe: Any) -> List[str]:
    """Why ``recipe`` cannot run here, checked before anything is quantized (empty: it can). The recipe is
    read through its quantizer specs (``common.quantizer_roles``), as PyTorch reads it."""
    reason = _roles.refusal(recipe)
    if reason is not None:
        return [reason]
    quantizers = _roles.quantizers_for(recipe)
    reasons = []
    if any(s.scaling_factor_compute_algo is not None for s in quantizers.specs):
        reasons.append("DelayedScaling.scaling_factor_compute_algo is not supported with JAX (as in "
                       "TransformerEngine-JAX): the scale is fp8_max / 2**margin / amax")
    if any(s.stateful and not s.reduce_amax for s in quantizers.specs):
        reasons.append("DelayedScaling.reduce_amax=False is not supported with JAX: the amax is always the "
                       "whole (sharded) tensor's, as in TransformerEngine-JAX")
    if getattr(recipe, "interval", 1) != 1:
        reasons.append(f"DelayedScaling.interval must be 1, got {recipe.interval!r}")
    if getattr(recipe, "backward_override", None) is not None:
        reasons.append(f"backward_override={recipe.backward_override!r} is not implemented: the backward GEMMs run "
                       "in FP8")
    reasons += _device_reasons(quantizers.needs_block_gemm_device)
    return reasons


def is_fp8_available(recipe: Any = None) -> Tuple[bool, str]:
    """``(available, reason)`` for ``recipe`` (default: ``DelayedScaling()``) on the default device."""
    reasons = _recipe_reasons(recipe if recipe is not None else _recipe.DelayedScaling())
    return (not reasons, "; ".join(reasons))


def _check_recipe(recipe: Any) -> None:
    reasons = _recipe_reasons(recipe)
    if reasons:
        raise NotImplementedError("FP8 recipe refused: " + "; ".join(reasons))


# ------------------------------------------------------------------------------------------------
# autocast
# ------------------------------------------------------------------------------------------------

_GLOBAL_RECIPE: Optional[Any] = None


def get_global_quantize_recipe() -> Optional[Any]:
    """The recipe of the innermost ``autocast(enabled=True)`` block (None outside one)."""
    return _GLOBAL_RECIPE


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Optional[Any] = None,
             mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Quantize the dense layers built inside the block with ``recipe`` (default ``DelayedScaling()``)
    when ``enabled``, and make ``mesh_resource`` the active MeshResource (``None``: an empty one).

    ``enabled=False`` turns quantization off inside the block (an outer block's recipe too), as in
    TransformerEngine-JAX. The recipe is read when quantizer sets are made
    (:meth:`~transformer_engine.jax.flax.module.TransformerEngineBase.generate_quantizer_set`), i.e.
    while the model is traced: wrap ``init`` and the traced step, not the call of a jitted function.
    MXFP8 / NVFP4 recipes raise ``NotImplementedError`` naming the hardware they need."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if recipe is None:
        recipe = _recipe.DelayedScaling()
    if enabled:
        _check_recipe(recipe)
    global _GLOBAL_RECIPE
    previous = _GLOBAL_RECIPE
    _GLOBAL_RECIPE = recipe if enabled else None
    try:
        with global_shard_guard(mesh_resource):
            yield
    finally:
        _GLOBAL_RECIPE = previous


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe: Optional[Any] = None,
                 mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Deprecated in TransformerEngine for :func:`autocast` (``fp8_recipe`` is its ``recipe``)."""
    warnings.warn("fp8_autocast is deprecated, use autocast(enabled=..., recipe=..., mesh_resource=...)",
                  DeprecationWarning, stacklevel=3)
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield


# ------------------------------------------------------------------------------------------------
# Quantized operands
# ------------------------------------------------------------------------------------------------


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """An FP8 operand: ``data`` (float8, the tensor padded to whole tiles for block scaling),
    ``scale_inv`` (float32; ``[1]`` for tensor scaling, one per tile for block scaling) and the
    layout: ``block`` is ``None`` (one scale), ``(1, 128)`` (tiles along the last axis) or
    ``(128, 128)``; ``shape`` is the unpadded 2-D shape. ``dequantize()`` gives the float32 values."""

    data: jax.Array
    scale_inv: jax.Array
    block: Optional[Tuple[int, int]] = None
    shape: Tuple[int, int] = ()

    def tree_flatten(self):
        return (self.data, self.scale_inv), (self.block, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def dequantize(self) -> jax.Array:
        values = self.data.astype(jnp.float32)
        if self.block is None:
            out = values * self.scale_inv[0]
        else:
            rows, cols = self.block
            expanded = jnp.repeat(jnp.repeat(self.scale_inv, rows, axis=0), cols, axis=1)
            out = values * expanded
        return out[: self.shape[0], : self.shape[1]]


def _saturating_cast(x32: jax.Array, fmt: str) -> jax.Array:
    """Multiply-then-cast's second half: clip to +-fp8_max (E4M3fn has no infinities) and round."""
    fmax = _q.fp8_max(fmt)
    return jnp.clip(x32, -fmax, fmax).astype(_FP8_DTYPES[fmt])


def _tensor_amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32).reshape((1,))


def _quantize_with_scale(x2d: jax.Array, scale: jax.Array, fmt: str) -> ScaledTensor:
    data = _saturating_cast(x2d.astype(jnp.float32) * scale[0], fmt)
    return ScaledTensor(data, 1.0 / scale, None, tuple(x2d.shape))


def _pad_to_tiles(x2d: jax.Array, rows: int, cols: int) -> jax.Array:
    m, n = x2d.shape
    pad = ((0, -m % rows), (0, -n % cols))
    return jnp.pad(x2d, pad) if any(p for _, p in pad) else x2d


def _block_quantize(x2d: jax.Array, block: Tuple[int, int], fmt: str, power_2_scale: bool,
                    epsilon: float) -> ScaledTensor:
    """Current scaling per ``block`` tile of a 2-D tensor (zero-padded to whole tiles)."""
    rows, cols = block
    xp = _pad_to_tiles(x2d.astype(jnp.float32), rows, cols)
    m, n = xp.shape
    tiles = xp.reshape(m // rows, rows, n // cols, cols)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
    scale = _q.scale_from_current_amax(jnp, amax, _q.fp8_max(fmt), epsilon, power_2_scale)
    data = _saturating_cast(tiles * scale[:, None, :, None], fmt).reshape(m, n)
    return ScaledTensor(data, 1.0 / scale, block, tuple(x2d.shape))


# ------------------------------------------------------------------------------------------------
# Quantizers
# ------------------------------------------------------------------------------------------------


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Quantizer:
    """Quantizes one role's tensor (x, kernel or grad) of a dense layer. Immutable: a stateful
    quantizer returns its successor from :meth:`quantize_2d`. ``q_dtype`` is the FP8 dtype,
    ``checkpoint_name`` names the FP8 data for remat policies (``jax.ad_checkpoint.checkpoint_name``)."""

    q_dtype: Any
    scaling_mode: ScalingMode
    checkpoint_name: Optional[str] = None

    @property
    def fmt(self) -> str:
        return "e4m3" if jnp.dtype(self.q_dtype) == jnp.dtype(jnp.float8_e4m3fn) else "e5m2"

    def tree_flatten(self):
        return (), (self.q_dtype, self.scaling_mode, self.checkpoint_name)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, *children)

    def quantize_2d(self, x2d: jax.Array, contract_axis: int) -> Tuple[ScaledTensor, "Quantizer"]:
        """Quantize a 2-D tensor for a GEMM contracting its ``contract_axis`` (block scaling tiles
        along it); returns the operand and the quantizer that follows this one."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize")

    def _named(self, tensor: ScaledTensor) -> ScaledTensor:
        if self.checkpoint_name is None:
            return tensor
        data = jax.ad_checkpoint.checkpoint_name(tensor.data, self.checkpoint_name)
        return dataclasses.replace(tensor, data=data)


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class CurrentScaleQuantizer(Quantizer):
    """``scale = fp8_max / max(amax, amax_epsilon)`` of the tensor itself (optionally a power of two)."""

    scaling_mode: ScalingMode = ScalingMode.CURRENT_TENSOR_SCALING
    checkpoint_name: Optional[str] = None
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def tree_flatten(self):
        return (), (self.q_dtype, self.scaling_mode, self.checkpoint_name, self.power_2_scale, self.amax_epsilon)

    def quantize_2d(self, x2d, contract_axis):
        del contract_axis
        scale = _q.scale_from_current_amax(jnp, _tensor_amax(x2d), _q.fp8_max(self.fmt), self.amax_epsilon,
                                           self.power_2_scale)
        return self._named(_quantize_with_scale(x2d, scale, self.fmt)), self


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DelayedScaleQuantizer(Quantizer):
    """Quantizes with the stored ``scale`` ``[1]``, then records the tensor's amax in
    ``amax_history[0]`` and moves on: next scale from the history (``max`` or ``most_recent``),
    history rolled by one with row 0 cleared (:func:`transformer_engine.common.quantization.delayed_update`)."""

    scaling_mode: ScalingMode = ScalingMode.DELAYED_TENSOR_SCALING
    checkpoint_name: Optional[str] = None
    margin: float = 0.0
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    scale: Any = None
    amax_history: Any = None

    def tree_flatten(self):
        return (self.scale, self.amax_history), (self.q_dtype, self.scaling_mode, self.checkpoint_name, self.margin,
                                                 self.amax_compute_algo)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, *children)

    def updated(self, amax: jax.Array) -> "DelayedScaleQuantizer":
        """The state after a quantization whose tensor had ``amax`` ``[1]``."""
        history = self.amax_history.at[0].set(_roles.record_amax(jnp, self.amax_history[0], amax[0]))
        rolled, scale = _q.delayed_update(jnp, history[:, None], self.scale, _q.fp8_max(self.fmt), self.margin,
                                          self.amax_compute_algo.value)
        return dataclasses.replace(self, scale=scale.reshape((1,)).astype(jnp.float32),
                                   amax_history=rolled[:, 0].astype(jnp.float32))

    def quantize_2d(self, x2d, contract_axis):
        del contract_axis
        tensor = _quantize_with_scale(x2d, self.scale, self.fmt)
        return self._named(tensor), self.updated(_tensor_amax(x2d))


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockScaleQuantizer(Quantizer):
    """Float8BlockScaling: current scaling per 1x128 tile along the contracted axis
    (``BLOCK_SCALING_1D``, activations and gradients) or per 128x128 tile (``BLOCK_SCALING_2D``,
    weights); tensors are zero-padded to whole tiles."""

    scaling_mode: ScalingMode = ScalingMode.BLOCK_SCALING_1D
    checkpoint_name: Optional[str] = None
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def tree_flatten(self):
        return (), (self.q_dtype, self.scaling_mode, self.checkpoint_name, self.power_2_scale, self.amax_epsilon)

    def quantize_2d(self, x2d, contract_axis):
        size = _q.BLOCK_SIZE
        if self.scaling_mode == ScalingMode.BLOCK_SCALING_2D:
            block = (size, size)
        else:
            block = (size, 1) if contract_axis == 0 else (1, size)
        tensor = _block_quantize(x2d, block, self.fmt, self.power_2_scale, self.amax_epsilon)
        return self._named(tensor), self


@register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """The quantizers of one dense layer: ``x``, ``kernel`` and ``dgrad`` (None: not quantized), and
    whether its forward, dgrad and wgrad GEMMs accumulate without cuBLASLt's fast FP8 accumulation
    (the recipe's ``fp8_gemm_*.use_split_accumulator``; XLA: ``precision=HIGHEST``)."""

    x: Optional[Quantizer] = None
    kernel: Optional[Quantizer] = None
    dgrad: Optional[Quantizer] = None
    split_accumulator: Tuple[bool, bool, bool] = (False, True, True)

    def tree_flatten(self):
        return (self.x, self.kernel, self.dgrad), (self.split_accumulator,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def is_noop(self) -> bool:
        return self.x is None and self.kernel is None and self.dgrad is None


noop_quantizer_set = QuantizerSet()


# ------------------------------------------------------------------------------------------------
# Recipes -> quantizer sets
# ------------------------------------------------------------------------------------------------


_ROLES = {TensorSource.X: _roles.Role.INPUT, TensorSource.KERNEL: _roles.Role.WEIGHT,
          TensorSource.DGRAD: _roles.Role.GRAD_OUTPUT}


def _amax_compute_algo(spec: _roles.QuantizerSpec) -> AmaxComputeAlgo:
    algo = spec.amax_compute_algo
    if algo not in ("max", "most_recent"):
        raise NotImplementedError(f"`amax_compute_algo` must be 'max' or 'most_recent' with JAX (as in "
                                  f"TransformerEngine-JAX), got {algo!r}")
    return AmaxComputeAlgo(algo)


def recipe_quantizers(recipe: Any) -> _roles.RecipeQuantizers:
    """The recipe's quantizer specs per role (``common.quantizer_roles``), refused recipes raising by name."""
    _check_recipe(recipe)
    return _roles.quantizers_for(recipe)


def delayed_state_shapes(recipe: Any) -> Tuple[Tuple[int], Tuple[int]]:
    """Shapes of a stateful (delayed-scaling) quantizer's ``scale`` and ``amax_history`` variables."""
    return (1,), (int(recipe_quantizers(recipe).input.amax_history_len),)


def _delayed(spec, q_dtype, checkpoint_name, scale, amax_history):
    return DelayedScaleQuantizer(
        q_dtype, checkpoint_name=checkpoint_name, margin=float(spec.margin),
        amax_compute_algo=_amax_compute_algo(spec),
        scale=jnp.ones((1,), jnp.float32) if scale is None else scale,
        amax_history=jnp.zeros((spec.amax_history_len,), jnp.float32) if amax_history is None else amax_history)


def _current(spec, q_dtype, checkpoint_name, scale, amax_history):
    return CurrentScaleQuantizer(q_dtype, checkpoint_name=checkpoint_name, power_2_scale=spec.power_2_scale,
                                 amax_epsilon=spec.amax_epsilon)


def _block(spec, q_dtype, checkpoint_name, scale, amax_history):
    mode = ScalingMode.BLOCK_SCALING_2D if spec.tile == _roles.SQUARE_TILE else ScalingMode.BLOCK_SCALING_1D
    return BlockScaleQuantizer(q_dtype, mode, checkpoint_name, spec.power_2_scale, spec.amax_epsilon)


# One quantizer per scaling kind (the specs' kinds, not the recipes' types).
_QUANTIZERS = {_roles.Scaling.DELAYED: _delayed, _roles.Scaling.CURRENT: _current, _roles.Scaling.BLOCK: _block}


class QuantizerFactory:
    """Builds quantizer sets from a recipe, as TransformerEngine-JAX's factory does."""

    @staticmethod
    def create_quantizer(recipe: Any, source: TensorSource, checkpoint_name: Optional[str] = None,
                         scale: Any = None, amax_history: Any = None) -> Quantizer:
        spec = recipe_quantizers(recipe).spec(_ROLES[source])
        return _QUANTIZERS[spec.scaling](spec, _FP8_DTYPES[spec.fmt], checkpoint_name, scale, amax_history)

    @staticmethod
    def create_set(n_quantizer_sets: int = 1, scaling_mode: Optional[ScalingMode] = None, fwd_dtype: Any = None,
                   bwd_dtype: Any = None, is_2x2x: Optional[bool] = None, n_groups: Optional[int] = None,
                   checkpoint_name: Optional[str] = None, fp8_recipe: Optional[Any] = None, **kwargs: Any):
        """Quantizer set(s) for ``fp8_recipe`` (None: the autocast recipe; none: ``noop_quantizer_set``).

        ``quantize_meta_set`` (keyword) carries the delayed-scaling state read from Flax variables
        (``{"x": (scale, amax_history), "kernel": ..., "grad": ...}``); without it the state starts at
        scale 1 and a zero history. ``scaling_mode=ScalingMode.NO_SCALING`` gives the no-op set; other
        scaling modes without a recipe, ``n_groups`` (grouped GEMMs) and ``is_2x2x`` are not
        implemented."""
        if n_groups is not None:
            raise NotImplementedError(f"`n_groups` must be None (grouped GEMMs are not implemented), got {n_groups!r}")
        del is_2x2x  # layouts are XLA's business here
        meta = kwargs.pop("quantize_meta_set", None)
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        if fp8_recipe is None and scaling_mode is None:
            fp8_recipe = get_global_quantize_recipe()
        if fp8_recipe is None:
            if scaling_mode not in (None, ScalingMode.NO_SCALING) or fwd_dtype is not None or bwd_dtype is not None:
                raise NotImplementedError(f"quantizer sets are made from a recipe here; `scaling_mode` must be None "
                                          f"or NO_SCALING without one, got {scaling_mode}")
            sets = [noop_quantizer_set] * n_quantizer_sets
        else:
            if scaling_mode is not None or fwd_dtype is not None or bwd_dtype is not None:
                raise ValueError("`scaling_mode`, `fwd_dtype` and `bwd_dtype` must be None when a recipe is given")
            _check_recipe(fp8_recipe)
            meta = meta or {}

            split = recipe_quantizers(fp8_recipe).split_accumulator

            def one():
                return QuantizerSet(*(
                    QuantizerFactory.create_quantizer(fp8_recipe, source, checkpoint_name,
                                                      *meta.get(source.value, (None, None)))
                    for source in (TensorSource.X, TensorSource.KERNEL, TensorSource.DGRAD)), split)

            sets = [one() for _ in range(n_quantizer_sets)]
        return sets[0] if n_quantizer_sets == 1 else tuple(sets)
