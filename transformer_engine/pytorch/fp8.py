"""FP8 state and contexts, as TransformerEngine 2.x's ``transformer_engine.pytorch.fp8`` names them.

``autocast`` (and its older name ``fp8_autocast``) pushes an FP8 state (enabled, calibrating, recipe,
amax-reduction group) for the modules run inside it and restores the previous state on exit, so
contexts nest. ``FP8GlobalStateManager`` answers the state queries and owns the one piece of global
FP8 bookkeeping TransformerEngine has: the delayed-scaling metadata registered by the modules, whose
amaxes are reduced and whose scales are updated at fixed points of the step:

- forward metadata when the outermost ``autocast`` exits with gradients enabled;
- backward metadata at the end of the backward pass of the first FP8 module of the forward (the
  last module to run backward).

The update itself (amax all-reduce MAX over the group, then ``common.quantization.delayed_update``)
is in ``transformer_engine.pytorch.quantization``.

Support answers depend on the device: FP8 GEMMs run on CPU (torch's scaled GEMM runs there) and on
CUDA devices of compute capability 8.9 or higher; block scaling on CPU and sm90+; MXFP8 and NVFP4
need Blackwell tensor cores and are not implemented here.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple, Union

import torch


from transformer_engine.common import quantizer_roles as _roles
from transformer_engine.common import recipe as _recipe
from transformer_engine.pytorch.recompute_frames import in_checkpointed_training_forward, in_fp8_activation_recompute_phase

# What a recipe needs that this package has not built, with the hardware it needs (common.quantizer_roles).
MXFP8_UNAVAILABLE_REASON = _roles.MXFP8_UNAVAILABLE_REASON
NVFP4_UNAVAILABLE_REASON = _roles.NVFP4_UNAVAILABLE_REASON
CUSTOM_RECIPE_REASON = _roles.CUSTOM_RECIPE_REASON
FP8_MODEL_INIT_REASON = ("FP8 parameters (fp8_model_init / quantized_model_init with enabled=True) are not "
                         "implemented: weights are kept in their parameter dtype and quantized in each forward "
                         "(cached across micro-batches with is_first_microbatch)")
# Kept for clients of the earlier, FP8-less releases.
FP8_UNAVAILABLE_REASON = MXFP8_UNAVAILABLE_REASON


def _resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _torch_has_fp8() -> Tuple[bool, str]:
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2") and hasattr(torch, "_scaled_mm")):
        return False, f"FP8 needs torch's float8 dtypes and torch._scaled_mm (torch {torch.__version__} lacks them)"
    return True, ""


def check_fp8_support(device: Union[str, torch.device, None] = None) -> Tuple[bool, str]:
    """(available, reason) of per-tensor FP8 GEMMs on ``device`` (default: the current CUDA device, else CPU)."""
    ok, reason = _torch_has_fp8()
    if not ok:
        return ok, reason
    device = _resolve_device(device)
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"FP8 GEMMs run on CPU and CUDA devices here, got device {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, (f"FP8 GEMMs need a CUDA device of compute capability 8.9+ (Ada, Hopper, Blackwell), "
                       f"{device} is sm{major}{minor}")
    return True, ""


def check_fp8_block_scaling_support(device: Union[str, torch.device, None] = None) -> Tuple[bool, str]:
    """(available, reason) of Float8BlockScaling on ``device``: CPU, or CUDA sm90+ (as TransformerEngine)."""
    ok, reason = check_fp8_support(device)
    if not ok:
        return ok, reason
    device = _resolve_device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return False, (f"FP8 block scaling (Float8BlockScaling) needs a CUDA device of compute capability 9.0+ "
                           f"(Hopper, Blackwell), {device} is sm{major}{minor}")
    return True, ""


def check_mxfp8_support(device: Union[str, torch.device, None] = None) -> Tuple[bool, str]:
    """(False, reason): MXFP8 is Blackwell-only and not implemented here."""
    return False, MXFP8_UNAVAILABLE_REASON


def check_nvfp4_support(device: Union[str, torch.device, None] = None) -> Tuple[bool, str]:
    """(False, reason): NVFP4 is Blackwell-only and not implemented here."""
    return False, NVFP4_UNAVAILABLE_REASON


def check_recipe_support(recipe: Any, device: Union[str, torch.device, None] = None) -> None:
    """NotImplementedError (by recipe name, with the reason) unless ``recipe`` runs on ``device``."""
    # The recipe's quantizer specs say what it needs (refused recipes raise here, by name).
    quantizers = _roles.quantizers_for(recipe)
    check = check_fp8_block_scaling_support if quantizers.needs_block_gemm_device else check_fp8_support
    ok, reason = check(device)
    if not ok:
        raise NotImplementedError(f"{type(recipe).__name__}: {reason}")


def get_default_fp8_recipe() -> _recipe.Recipe:
    """The recipe of an ``autocast(enabled=True)`` given none: DelayedScaling() (TransformerEngine's on Hopper)."""
    return _recipe.DelayedScaling()


class FP8GlobalStateManager:
    """Class-level FP8 state: the autocast stack's top, and the delayed-scaling metadata to update."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Optional[_recipe.Recipe] = None
    FP8_DISTRIBUTED_GROUP: Optional[Any] = None
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    AUTOCAST_DEPTH = 0
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    # Delayed-scaling metadata (transformer_engine.pytorch.quantization.DelayedScalingMeta) registered
    # by modules that ran in FP8, per direction, in registration order (a fixed order: the reduction
    # concatenates them). Keys are id(meta); entries persist while their module lives, as
    # TransformerEngine's buffers do.
    _DELAYED_METAS: Dict[bool, Any] = {True: weakref.WeakValueDictionary(), False: weakref.WeakValueDictionary()}

    # --- support queries -------------------------------------------------------------------------
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

    # --- state queries ---------------------------------------------------------------------------
    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return cls.FP8_GRAPH_CAPTURING

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first FP8 module of an outermost autocast (then False): it triggers the backward update."""
        first = cls.IS_FIRST_FP8_MODULE
        cls.IS_FIRST_FP8_MODULE = False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Optional[_recipe.Recipe]:
        """The active recipe: the autocast's, DelayedScaling() when it gave none; None outside FP8."""
        if cls.FP8_RECIPE is not None:
            return cls.FP8_RECIPE
        if cls.FP8_ENABLED or cls.FP8_CALIBRATION:
            return get_default_fp8_recipe()
        return None

    @classmethod
    def get_fp8_group(cls) -> Optional[Any]:
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def get_autocast_state(cls) -> Tuple[bool, bool, Optional[_recipe.Recipe], Optional[Any], bool, bool]:
        """(enabled, calibrating, recipe, group, first module, graph capturing)."""
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state: Tuple[Any, ...]) -> None:
        if not isinstance(state, tuple) or len(state) not in (5, 6):
            raise ValueError(f"`state` must be a tuple from get_autocast_state(), got {state!r}")
        if state[0] and state[2] is not None:
            check_recipe_support(state[2])
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE) = state[:5]
        if len(state) == 6:
            cls.FP8_GRAPH_CAPTURING = state[5]

    @classmethod
    def reset(cls) -> None:
        """Back to the import-time state: FP8 off, no metadata registered."""
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = None
        cls.AUTOCAST_DEPTH = 0
        cls.FP8_PARAMETERS = cls.HIGH_PRECISION_INIT_VAL = False
        cls._DELAYED_METAS = {True: weakref.WeakValueDictionary(), False: weakref.WeakValueDictionary()}

    # --- autocast bookkeeping --------------------------------------------------------------------
    @classmethod
    def autocast_enter(cls, enabled: bool = False, calibrating: bool = False, fp8_recipe: Optional[Any] = None,
                       fp8_group: Optional[Any] = None, _graph: bool = False) -> None:
        if enabled:
            check_recipe_support(fp8_recipe if fp8_recipe is not None else get_default_fp8_recipe())
        elif fp8_recipe is not None and not isinstance(fp8_recipe, _recipe.Recipe):
            raise ValueError(f"`recipe` must be a transformer_engine.common.recipe.Recipe, got {fp8_recipe!r}")
        cls.FP8_ENABLED = enabled
        cls.FP8_CALIBRATION = calibrating
        cls.FP8_RECIPE = fp8_recipe if fp8_recipe is not None or not (enabled or calibrating) else get_default_fp8_recipe()
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.FP8_GRAPH_CAPTURING = _graph
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1

    @classmethod
    def autocast_exit(cls, enabled: bool, _graph: bool) -> None:
        cls.AUTOCAST_DEPTH -= 1
        # Forward metadata is updated once per step, when the outermost FP8 autocast closes in training
        # (a reentrant checkpoint's first forward is training without gradients); never in a recompute,
        # whose amaxes the first forward recorded.
        if enabled and cls.AUTOCAST_DEPTH == 0 and not _graph and not in_fp8_activation_recompute_phase() \
                and (torch.is_grad_enabled() or in_checkpointed_training_forward()):
            cls.reduce_and_update_fp8_tensors(forward=True)

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, meta: Any, forward: bool) -> None:
        """Register a module's delayed-scaling metadata for the updates of its direction (once)."""
        cls._DELAYED_METAS[forward].setdefault(id(meta), meta)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Reduce the registered amaxes over their groups and update scales and histories (delayed scaling)."""
        from transformer_engine.pytorch.quantization import reduce_and_update_delayed_metas

        reduce_and_update_delayed_metas(list(cls._DELAYED_METAS[forward].values()))


def _check_flags(enabled: Any, calibrating: Any) -> None:
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if not isinstance(calibrating, bool):
        raise ValueError(f"`calibrating` must be a bool, got {calibrating!r}")


@contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[_recipe.Recipe] = None,
             amax_reduction_group: Optional[Any] = None, _graph: bool = False):
    """Run the FP8-capable modules inside in FP8 under ``recipe`` (DelayedScaling() when None).

    ``calibrating=True`` (with ``enabled=False``) runs in high precision and records the amaxes that
    delayed scaling would record. ``amax_reduction_group``: the torch.distributed group whose ranks
    share delayed-scaling amaxes (all-reduce MAX) when the recipe's ``reduce_amax`` is set. Nestable;
    the previous state is restored on exit.
    """
    _check_flags(enabled, calibrating)
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                                         fp8_group=amax_reduction_group, _graph=_graph)
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(state)
        FP8GlobalStateManager.autocast_exit(enabled, _graph=_graph)


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[_recipe.Recipe] = None,
                 fp8_group: Optional[Any] = None, _graph: bool = False):
    """TransformerEngine 1.x's name for :func:`autocast` (``fp8_recipe`` is ``recipe``, ``fp8_group`` the group)."""
    with autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                  _graph=_graph):
        yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[_recipe.Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """No-op when ``enabled=False``; FP8 parameters otherwise, which are not implemented (NotImplementedError)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if enabled:
        raise NotImplementedError(f"quantized_model_init(enabled=True): {FP8_MODEL_INIT_REASON}")
    yield


@contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[_recipe.Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """TransformerEngine 1.x's name for :func:`quantized_model_init`."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if enabled:
        raise NotImplementedError(f"fp8_model_init(enabled=True): {FP8_MODEL_INIT_REASON}")
    yield


__all__ = ["FP8GlobalStateManager", "fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init",
           "check_fp8_support", "check_mxfp8_support", "check_fp8_block_scaling_support", "check_nvfp4_support",
           "check_recipe_support", "get_default_fp8_recipe"]
