"""Quantization recipes, as TransformerEngine 2.x's ``transformer_engine.common.recipe`` declares them.

A recipe is data: its fields (with TransformerEngine's names and defaults) and the predicates the
frontends dispatch on (``delayed()``, ``float8_current_scaling()``, ...). The PyTorch frontend runs
``DelayedScaling``, ``Float8CurrentScaling`` and ``Float8BlockScaling``; ``MXFP8BlockScaling`` and
``NVFP4BlockScaling`` need Blackwell tensor cores and are refused by name when enabled, as
TransformerEngine refuses them on Hopper. The scaling formulas live in
``transformer_engine.common.quantization``.

TransformerEngine lets two environment variables change the recipes' power-of-two-scale defaults;
here the defaults are fixed (pass ``fp8_quant_*=QParams(power_2_scale=...)`` instead) so that a
recipe means the same thing in every process (docs/fp8.rst names them).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Tuple


class _FormatMax(NamedTuple):
    """Largest finite value of a format's forward and backward tensors."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """FP8 formats by name: E4M3 everywhere, E5M2 everywhere, or E4M3 forward and E5M2 backward.

    ``Format.X.value.max_fwd`` / ``.max_bwd`` are the formats' largest finite values, as in
    TransformerEngine. E2M1 is NVFP4's element format.
    """

    E2M1 = _FormatMax(6.0, 6.0)
    E4M3 = _FormatMax(448.0, 448.0)
    E5M2 = _FormatMax(57344.0, 57344.0)
    HYBRID = _FormatMax(448.0, 57344.0)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options. ``use_split_accumulator`` selects cuBLAS's promoted (non fast-accumulate) FP8 GEMM."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """Per-tensor-role quantization options: power-of-two scales, a floor on the amax."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


_IGNORED_KWARGS = ("params_dtype", "device")


class Recipe:
    """Base of the recipes: keyword settings stored as attributes, checked, nothing computed.

    Subclasses declare ``_DEFAULTS`` (TransformerEngine's fields and defaults) and may check them in
    ``_check``. Positional arguments follow the declared order, as TransformerEngine's dataclasses do.
    """

    _DEFAULTS: dict = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = list(self._DEFAULTS)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments, got {len(args)}")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"{type(self).__name__} got multiple values for argument {name!r}")
            kwargs[name] = value
        # TransformerEngine's recipes are pydantic dataclasses, which drop unknown keywords; Megatron-core
        # relies on that (it hands DelayedScaling its module kwargs). Only those two are dropped here.
        for name in _IGNORED_KWARGS:
            kwargs.pop(name, None)
        unknown = sorted(set(kwargs) - set(self._DEFAULTS))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {unknown}; "
                            f"it takes {sorted(self._DEFAULTS)}")
        for name, default in self._DEFAULTS.items():
            setattr(self, name, kwargs.get(name, default))
        self._check()

    def _check(self) -> None:
        fmt = getattr(self, "fp8_format", None)
        if fmt is not None and not isinstance(fmt, Format):
            raise ValueError(f"`fp8_format` must be a recipe.Format, got {fmt!r}")
        if fmt is Format.E5M2:
            raise ValueError("`fp8_format` must be Format.E4M3 or Format.HYBRID, got Format.E5M2 "
                             "(pure E5M2 training is not supported, as in TransformerEngine)")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._DEFAULTS)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and all(getattr(self, n) == getattr(other, n) for n in self._DEFAULTS)

    def __hash__(self) -> int:  # recipes are mutable settings; identity-hashed like TransformerEngine's
        return id(self)

    # The predicates TransformerEngine's frontends dispatch on (class-level there too).
    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        return issubclass(cls, CustomRecipe)


_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _check_backward_override(recipe: Recipe) -> None:
    value = getattr(recipe, "backward_override", None)
    if value not in _BACKWARD_OVERRIDES:
        raise ValueError(f"`backward_override` must be one of {_BACKWARD_OVERRIDES}, got {value!r}")
    if value is not None:
        raise NotImplementedError(f"`backward_override={value!r}` is not implemented: the backward GEMMs run in FP8 "
                                  "with the recipe's scaling")


class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history (``scale = fp8_max / 2**margin / amax``), updated after each step.

    ``interval`` and ``override_linear_precision`` are accepted at their defaults for clients that
    still pass TransformerEngine 1.x's arguments.
    """

    _DEFAULTS = dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                     scaling_factor_compute_algo=None, reduce_amax=True, fp8_dpa=False, fp8_mha=False,
                     backward_override=None, interval=1, override_linear_precision=(False, False, False))

    def _check(self) -> None:
        super()._check()
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not self.margin >= 0:
            # scale = fp8_max / 2**margin / amax: a negative margin scales values past the format's largest,
            # which the saturating cast then clips.
            raise ValueError(f"`margin` must be a non-negative number, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"`amax_history_len` must be a positive int, got {self.amax_history_len!r}")
        if not (callable(self.amax_compute_algo) or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError(f"`amax_compute_algo` must be 'max', 'most_recent' or a callable, "
                             f"got {self.amax_compute_algo!r}")
        if tuple(self.override_linear_precision) != (False, False, False):
            raise NotImplementedError(f"`override_linear_precision={self.override_linear_precision!r}` is not "
                                      "implemented (removed in TransformerEngine 2.x): every GEMM runs in FP8")
        _check_backward_override(self)


class Float8CurrentScaling(Recipe):
    """Per-tensor scales from the tensor being quantized (``scale = fp8_max / amax``)."""

    _DEFAULTS = dict(fp8_format=Format.HYBRID,
                     fp8_quant_fwd_inp=QParams(), fp8_quant_fwd_weight=QParams(), fp8_quant_bwd_grad=QParams(),
                     fp8_gemm_fprop=MMParams(use_split_accumulator=False),
                     fp8_gemm_dgrad=MMParams(use_split_accumulator=True),
                     fp8_gemm_wgrad=MMParams(use_split_accumulator=True),
                     fp8_dpa=False, fp8_mha=False, backward_override=None)

    def _check(self) -> None:
        super()._check()
        _check_backward_override(self)


class Float8BlockScaling(Recipe):
    """Block scales: 1x128 tiles of activations and gradients, 128x128 tiles of weights (Hopper and later).

    Scales are powers of two by default (``QParams(power_2_scale=True)``).
    """

    _DEFAULTS = dict(fp8_format=Format.E4M3,
                     fp8_quant_fwd_inp=QParams(power_2_scale=True),
                     fp8_quant_fwd_weight=QParams(power_2_scale=True),
                     fp8_quant_bwd_grad=QParams(power_2_scale=True),
                     x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1,
                     fp8_gemm_fprop=MMParams(use_split_accumulator=True),
                     fp8_gemm_dgrad=MMParams(use_split_accumulator=True),
                     fp8_gemm_wgrad=MMParams(use_split_accumulator=True),
                     fp8_dpa=False, fp8_mha=False, backward_override=None)

    def _check(self) -> None:
        super()._check()
        dims = {"x_block_scaling_dim": self.x_block_scaling_dim, "w_block_scaling_dim": self.w_block_scaling_dim,
                "grad_block_scaling_dim": self.grad_block_scaling_dim}
        for name, value in dims.items():
            if value not in (1, 2):
                raise ValueError(f"`{name}` must be 1 or 2, got {value!r}")
        if sum(v == 2 for v in dims.values()) > 1:
            raise ValueError(f"at most one of {sorted(dims)} may be 2 (no GEMM takes two 128x128-scaled operands), "
                             f"got {dims}")
        if (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim) != (1, 2, 1):
            raise NotImplementedError(f"block scaling dims {dims} are not implemented: only TransformerEngine's "
                                      "defaults (1x128 activations and gradients, 128x128 weights)")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                raise ValueError(f"`{name}` must use the split accumulator with block scaling, got {getattr(self, name)}")
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("FP8 attention under Float8BlockScaling is not implemented (FP8 attention is "
                                      "per-tensor scaled: DelayedScaling or Float8CurrentScaling), got "
                                      f"fp8_dpa={self.fp8_dpa}, fp8_mha={self.fp8_mha}")
        _check_backward_override(self)


class MXFP8BlockScaling(Recipe):
    """MXFP8 (1x32 blocks, E8M0 scales): Blackwell tensor cores only, refused when enabled."""

    _DEFAULTS = dict(margin=0, fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False, backward_override=None)


class NVFP4BlockScaling(Recipe):
    """NVFP4 (1x16 blocks of E2M1 with E4M3 scales): Blackwell tensor cores only, refused when enabled."""

    _DEFAULTS = dict(disable_rht=False, disable_stochastic_rounding=False, disable_2d_quantization=False,
                     row_scaled_activation=False, fp4_format=Format.E2M1, fp8_format=Format.E4M3,
                     fp8_dpa=False, fp8_mha=False, backward_override=None)


class CustomRecipe(Recipe):
    """A user-supplied quantizer factory (refused when enabled: quantizers are the recipes' own here)."""

    _DEFAULTS = dict(qfactory=None, fp8_dpa=False, fp8_mha=False, backward_override=None)


def format_max(fmt: Format) -> Tuple[float, float]:
    """(forward, backward) largest finite values of a Format."""
    return fmt.value.max_fwd, fmt.value.max_bwd


__all__ = ["Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
           "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]
