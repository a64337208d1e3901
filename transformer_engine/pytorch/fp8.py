"""FP8 state queries and contexts, as TransformerEngine's ``transformer_engine.pytorch.fp8`` names them.

This package has no FP8 (or FP4) kernels. The queries report that, with the reason; the contexts
are no-ops when disabled, so code that wraps every forward in ``fp8_autocast(enabled=False)``
(as Megatron does) runs unchanged; enabling any of them raises NotImplementedError.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Optional, Tuple

from transformer_engine.common import recipe as _recipe  # noqa: F401  (makes te.common.recipe reachable)

FP8_UNAVAILABLE_REASON = (
    "FP8 is not implemented by the deterministic-attention package (it computes in fp32, fp16 or bf16); "
    "use NVIDIA TransformerEngine for FP8 training"
)
FP4_UNAVAILABLE_REASON = FP8_UNAVAILABLE_REASON.replace("FP8", "FP4")


def _refuse(what: str) -> None:
    raise NotImplementedError(f"{what}: {FP8_UNAVAILABLE_REASON}")


def check_fp8_support() -> Tuple[bool, str]:
    """(False, reason): FP8 is never available here."""
    return False, FP8_UNAVAILABLE_REASON


def check_mxfp8_support() -> Tuple[bool, str]:
    """(False, reason): MXFP8 is never available here."""
    return False, FP8_UNAVAILABLE_REASON.replace("FP8", "MXFP8", 1)


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """(False, reason): FP8 block scaling is never available here."""
    return False, FP8_UNAVAILABLE_REASON


def check_nvfp4_support() -> Tuple[bool, str]:
    """(False, reason): NVFP4 is never available here."""
    return False, FP4_UNAVAILABLE_REASON


class FP8GlobalStateManager:
    """Class-level FP8 state queries. FP8 is never available, enabled, or being captured here."""

    @classmethod
    def is_fp8_available(cls) -> Tuple[bool, str]:
        return check_fp8_support()

    @classmethod
    def is_mxfp8_available(cls) -> Tuple[bool, str]:
        return check_mxfp8_support()

    @classmethod
    def is_fp8_block_scaling_available(cls) -> Tuple[bool, str]:
        return check_fp8_block_scaling_support()

    @classmethod
    def is_nvfp4_available(cls) -> Tuple[bool, str]:
        return check_nvfp4_support()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls) -> None:
        """No recipe is ever active."""
        return None

    @classmethod
    def get_fp8_group(cls) -> None:
        return None

    @classmethod
    def get_autocast_state(cls) -> Tuple[bool, bool, None, None, bool]:
        """(enabled, calibrating, recipe, group, first module): all off."""
        return False, False, None, None, False

    @classmethod
    def set_autocast_state(cls, state: Tuple[Any, ...]) -> None:
        if state and state[0]:
            _refuse("FP8GlobalStateManager.set_autocast_state with FP8 enabled")

    @classmethod
    def reset(cls) -> None:
        """Nothing to reset: no FP8 state is ever kept."""


def _check_disabled(name: str, enabled: bool, recipe: Optional[Any], calibrating: bool = False) -> None:
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if enabled or calibrating:
        _refuse(f"{name}(enabled=True) turns FP8 on")


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Any] = None,
                 fp8_group: Optional[Any] = None, _graph: bool = False):
    """No-op when ``enabled=False`` (and not calibrating); FP8 otherwise, which raises NotImplementedError.

    TransformerEngine's default is ``enabled=True``; it is kept, so a bare ``fp8_autocast()`` refuses.
    """
    _check_disabled("fp8_autocast", enabled, fp8_recipe, calibrating)
    yield


@contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Any] = None,
             amax_reduction_group: Optional[Any] = None, _graph: bool = False):
    """TransformerEngine 2.x's name for ``fp8_autocast``: no-op when disabled, else NotImplementedError."""
    _check_disabled("autocast", enabled, recipe, calibrating)
    yield


@contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Any] = None,
                   preserve_high_precision_init_val: bool = False):
    """No-op when ``enabled=False``; FP8 parameters otherwise, which raises NotImplementedError."""
    _check_disabled("fp8_model_init", enabled, recipe)
    yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Any] = None,
                         preserve_high_precision_init_val: bool = False):
    """TransformerEngine 2.x's name for ``fp8_model_init``: no-op when disabled, else NotImplementedError."""
    _check_disabled("quantized_model_init", enabled, recipe)
    yield


__all__ = ["FP8GlobalStateManager", "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init",
           "check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support", "check_nvfp4_support",
           "FP8_UNAVAILABLE_REASON"]
