"""Quantization recipes, as TransformerEngine's ``transformer_engine.common.recipe`` names them.

This package computes in the activation dtype (fp32, fp16, bf16); it has no FP8 or FP4 kernels.
The recipe classes exist so that code written against TransformerEngine can name them (Megatron
builds them from its config and subclasses ``DelayedScaling``). A recipe holds its settings and
does nothing else: handing one to ``transformer_engine.pytorch.fp8_autocast`` (or ``autocast``,
``fp8_model_init``, ``quantized_model_init``) with ``enabled=True`` raises NotImplementedError.
"""

from __future__ import annotations

import enum
from typing import Any


class Format(enum.Enum):
    """FP8 formats by name: E4M3 everywhere, E5M2 everywhere, or E4M3 forward and E5M2 backward."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


class Recipe:
    """Base of the recipes: keyword settings stored as attributes, nothing computed."""

    _DEFAULTS: dict = {}

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(self._DEFAULTS))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {unknown}; "
                            f"it takes {sorted(self._DEFAULTS)}")
        for name, default in self._DEFAULTS.items():
            setattr(self, name, kwargs.get(name, default))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._DEFAULTS)
        return f"{type(self).__name__}({fields})"

    # TransformerEngine's recipes answer these; none of them is ever true of a running recipe here.
    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)


class DelayedScaling(Recipe):
    """FP8 with scales from an amax history (settings only; see the module docstring)."""

    _DEFAULTS = dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                     override_linear_precision=(False, False, False), scaling_factor_compute_algo=None,
                     reduce_amax=True, fp8_dpa=False, fp8_mha=False, interval=1)


class Float8CurrentScaling(Recipe):
    """FP8 with per-tensor scales from the current tensor (settings only)."""

    _DEFAULTS = dict(fp8_format=Format.HYBRID, fp8_dpa=False, fp8_mha=False)


class Float8BlockScaling(Recipe):
    """FP8 with block-wise scales (settings only)."""

    _DEFAULTS = dict(fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False)


class MXFP8BlockScaling(Recipe):
    """MXFP8 (settings only)."""

    _DEFAULTS = dict(fp8_format=Format.E4M3, fp8_dpa=False, fp8_mha=False)


class NVFP4BlockScaling(Recipe):
    """NVFP4 (settings only)."""

    _DEFAULTS = dict(fp4_format=None, fp8_dpa=False, fp8_mha=False)


class CustomRecipe(Recipe):
    """A user-supplied quantizer factory (settings only)."""

    _DEFAULTS = dict(qfactory=None, fp8_dpa=False, fp8_mha=False)


__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]
