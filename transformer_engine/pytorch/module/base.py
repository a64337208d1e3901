"""What the linear and normalization modules share: constructor checks, parameter creation, init.

The modules take TransformerEngine's constructor arguments. Those that only matter to features
this package does not have (FP8 output/grad tensors, userbuffer communication overlap, delayed weight gradients, symmetric-memory all-reduce) are accepted at their "off"
value and refused with NotImplementedError otherwise, so a caller never gets a silently
different computation.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from transformer_engine.pytorch.module._parallel import group_size

_PARALLEL_MODES = (None, "column", "row")
_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# TransformerEngine's default weight init: normal with this std.
_DEFAULT_INIT_STD = 0.023


def default_init_method(weight: torch.Tensor) -> None:
    """Normal(0, 0.023), TransformerEngine's default for linear weights."""
    torch.nn.init.normal_(weight, mean=0.0, std=_DEFAULT_INIT_STD)


def resolve_device(device: Union[str, int, torch.device, None]) -> torch.device:
    """The modules' ``device`` argument as a torch.device: None (the default) is CUDA when CUDA is available
    and the CPU otherwise (TransformerEngine's modules default to "cuda"; these modules also run on a CPU); an
    int is a CUDA index. An explicit CUDA device on a machine without CUDA is refused."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"`device` must be a torch device, a device string or a CUDA index, got {device!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` must be an available device, got {device} but CUDA is not available "
                         "(pass device='cpu')")
    return device


def resolve_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    if params_dtype is None:
        return torch.get_default_dtype()
    if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
        raise ValueError(f"`params_dtype` must be a floating torch.dtype, got {params_dtype!r}")
    return params_dtype


def refuse_unsupported(owner: str, **flags: Any) -> None:
    """NotImplementedError for any TransformerEngine-only feature switched on."""
    reasons = {
        "delay_wgrad_compute": "weight gradients are computed in the backward pass",
        "symmetric_ar_type": "all-reduces go through torch.distributed",
        "fp8_output": "outputs are returned in the activation dtype (FP8 output tensors are not implemented)",
        "fp8_grad": "input gradients are returned in the activation dtype (FP8 gradient tensors are not implemented)",
    }
    for name, value in flags.items():
        if name.startswith("ub_"):
            if value:
                raise NotImplementedError(f"{owner}: `{name}=True` (userbuffer communication overlap) is not "
                                          "implemented; collectives run through torch.distributed")
            continue
        if value not in (None, False):
            raise NotImplementedError(f"{owner}: `{name}={value!r}` is not implemented: {reasons[name]}")


def check_parallel_mode(owner: str, parallel_mode: Optional[str], allowed=_PARALLEL_MODES) -> None:
    if parallel_mode not in allowed:
        raise ValueError(f"{owner}: `parallel_mode` must be one of {allowed}, got {parallel_mode!r}")


def check_normalization(owner: str, normalization: str) -> None:
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"{owner}: `normalization` must be one of {_NORMALIZATIONS}, got {normalization!r}")


def divide(total: int, parts: int, name: str) -> int:
    if total % parts:
        raise ValueError(f"`{name}` ({total}) must be divisible by the tensor-parallel size {parts}")
    return total // parts


def check_features(in_features: int, out_features: int) -> None:
    for arg, value in (("in_features", in_features), ("out_features", out_features)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{arg}` must be a positive int, got {value!r}")


def split_parameters(parameters_split: Optional[Any], out_features: int, tp_size: int):
    """TransformerEngine's ``parameters_split`` as (weight names, bias names, this rank's sizes): None, one
    ``weight``/``bias``; a tuple of names, equal parts named ``<name>_weight``/``<name>_bias`` (a trailing
    underscore dropped); a dict, name to size. ``out_features`` is the global width; each part is divided by
    ``tp_size`` (the column-parallel split of every part, as TransformerEngine shards a split weight)."""
    if parameters_split is None:
        names, sizes = [None], [out_features]
    elif isinstance(parameters_split, dict) and parameters_split:
        names, sizes = list(parameters_split), list(parameters_split.values())
    elif (isinstance(parameters_split, (tuple, list)) and parameters_split
          and all(isinstance(n, str) for n in parameters_split)):
        if out_features % len(parameters_split):
            raise ValueError(f"`parameters_split` must split out_features={out_features} into equal parts, got "
                             f"{len(parameters_split)} names")
        names, sizes = list(parameters_split), [out_features // len(parameters_split)] * len(parameters_split)
    else:
        raise ValueError(f"`parameters_split` must be None, a non-empty tuple of names or a dict of name to size, "
                         f"got {parameters_split!r}")
    if not all(isinstance(n, int) and n > 0 for n in sizes) or sum(sizes) != out_features:
        raise ValueError(f"`parameters_split` sizes must be positive ints summing to out_features={out_features}, "
                         f"got {sizes}")
    if any(n % tp_size for n in sizes):
        raise ValueError(f"`parameters_split` sizes {sizes} must each be divisible by the tensor-parallel size "
                         f"{tp_size}")
    if names == [None]:
        return ["weight"], ["bias"], [out_features // tp_size]
    stems = [n.rstrip("_") for n in names]
    if len(set(stems)) != len(stems) or not all(stems):
        raise ValueError(f"`parameters_split` names must be distinct and non-empty, got {names}")
    return [f"{n}_weight" for n in stems], [f"{n}_bias" for n in stems], [n // tp_size for n in sizes]


def set_tensor_parallel_attributes(param: torch.nn.Parameter, partition_dim: int) -> None:
    """The attributes Megatron reads from a tensor-parallel shard (gradient norm, checkpointing)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


class TransformerEngineBaseModule(torch.nn.Module):
    """Base of the linear modules: tensor-parallel group, RNG-tracked initialization, FP8 state in the state dict."""

    # The GEMMs whose FP8 state the module keeps (see _fp8_plan): None is the one GEMM of ``_fp8_state``.
    _fp8_gemms: tuple = (None,)

    def _fp8_state_attrs(self) -> list:
        return ["_fp8_state" if gemm is None else f"_fp8_state_{gemm}" for gemm in self._fp8_gemms]

    def get_extra_state(self) -> torch.Tensor:
        """The FP8 state as the state dict's ``_extra_state`` entry (a CPU uint8 tensor; empty without
        delayed-scaling state). Layout: ``transformer_engine.pytorch.module._extra_state``."""
        from transformer_engine.pytorch.module import _extra_state

        return _extra_state.save([self.__dict__.get(attr) for attr in self._fp8_state_attrs()])

    def set_extra_state(self, state) -> None:
        """Load the FP8 state saved by ``get_extra_state`` (None or an empty tensor: nothing to load). Before
        the first FP8 forward the state is created here and the next forward uses it; after, it is copied
        in place."""
        from transformer_engine.pytorch.module import _extra_state

        param = next(self.parameters(), None)
        device = param.device if param is not None and param.device.type != "meta" else torch.device("cpu")
        _extra_state.load(self, state, self._fp8_state_attrs(), device)

    def _setup_tensor_parallel(self, tp_group: Optional[Any], tp_size: int) -> None:
        if tp_group is not None:
            tp_size = group_size(tp_group)
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"`tp_size` must be a positive int, got {tp_size!r}")
        self.tp_group = tp_group
        self.tp_size = tp_size

    def set_tensor_parallel_group(self, tp_group: Optional[Any]) -> None:
        """Set the group after construction (Megatron builds modules before torch.distributed starts)."""
        if tp_group is not None and group_size(tp_group) != self.tp_size:
            raise ValueError(f"`tp_group` must have tp_size={self.tp_size} ranks, got {group_size(tp_group)}")
        self.tp_group = tp_group

    def _group_for_forward(self, parallel: Optional[bool] = None) -> Optional[Any]:
        """The tensor-parallel group of this forward (None when the module runs unsplit). ``parallel``: whether
        the module splits its GEMMs (default: it has a ``parallel_mode``)."""
        if parallel is None:
            parallel = self.parallel_mode is not None
        if self.tp_size > 1 and parallel and self.tp_group is None:
            raise RuntimeError(f"{type(self).__name__} was built with tp_size={self.tp_size} but no tp_group; "
                               "call set_tensor_parallel_group(group) before forward")
        return self.tp_group if parallel else None

    def _new_parameter(self, shape, device: torch.device, dtype: torch.dtype) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

    def _new_norm_parameters(self, hidden: int, normalization: str, device: torch.device,
                             dtype: torch.dtype) -> None:
        """The fused norm's ``layer_norm_weight`` and ``layer_norm_bias`` (None for RMSNorm), marked with the
        module's ``sequence_parallel`` (Megatron all-reduces their gradients over the sequence split)."""
        self.layer_norm_weight = self._new_parameter((hidden,), device, dtype)
        if normalization == "LayerNorm":
            self.layer_norm_bias = self._new_parameter((hidden,), device, dtype)
        else:
            self.register_parameter("layer_norm_bias", None)
        for param in (self.layer_norm_weight, self.layer_norm_bias):
            if param is not None:
                param.sequence_parallel = self.sequence_parallel

    def _new_weight_and_bias(self, out_features: int, in_features: int, bias: bool, device: torch.device,
                             dtype: torch.dtype, parameters_split: Optional[Any] = None) -> None:
        """``weight`` [out, in] and ``bias`` [out] (registered as None without a bias); with
        ``parameters_split`` one ``<name>_weight`` / ``<name>_bias`` per part instead (``out_features`` is
        this rank's: each part's size is divided by the tensor-parallel size under column parallelism)."""
        self.weight_names, self.bias_names, self.parameter_split_sizes = split_parameters(
            parameters_split, out_features * (self.tp_size if self.parallel_mode == "column" else 1),
            self.tp_size if self.parallel_mode == "column" else 1)
        for wname, bname, size in zip(self.weight_names, self.bias_names, self.parameter_split_sizes):
            self.register_parameter(wname, self._new_parameter((size, in_features), device, dtype))
            self.register_parameter(bname, self._new_parameter((size,), device, dtype) if bias else None)

    def _split_weights(self) -> list:
        return [getattr(self, name) for name in self.weight_names]

    def _split_biases(self) -> list:
        return [getattr(self, name) for name in self.bias_names]

    def _weight_and_bias(self):
        """The GEMM's weight and bias: the parameters, or the split parameters concatenated (the concatenation
        carries the gradient back to each part)."""
        weights, biases = self._split_weights(), self._split_biases()
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        if biases[0] is None:
            return weight, None
        return weight, biases[0] if len(biases) == 1 else torch.cat(biases)

    @staticmethod
    def _returned_bias(out: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """What ``return_bias=True`` returns without a bias: an empty tensor, as TransformerEngine does."""
        return bias if bias is not None else torch.empty(0, dtype=out.dtype, device=out.device)

    def _init_weight(self, weight: torch.nn.Parameter, init_method: Optional[Callable],
                     get_rng_state_tracker: Optional[Callable], rng_tracker_name: Optional[str]) -> None:
        """init_method on this rank's shard, inside the tracked RNG state when a tracker is given."""
        if weight.device.type == "meta":
            return
        init_method = default_init_method if init_method is None else init_method
        with torch.no_grad():
            if get_rng_state_tracker is None:
                init_method(weight)
            else:
                tracker = get_rng_state_tracker()
                fork = tracker.fork() if rng_tracker_name is None else tracker.fork(rng_tracker_name)
                with fork:
                    init_method(weight)

    @staticmethod
    def _check_forward_flags(owner: str, is_first_microbatch: Optional[bool], fp8_output: bool, fp8_grad: bool) -> None:
        # is_first_microbatch: under FP8, quantize the weight and cache it (True) or reuse the cache (False).
        if is_first_microbatch not in (None, True, False):
            raise ValueError(f"`is_first_microbatch` must be None or a bool, got {is_first_microbatch!r}")
        refuse_unsupported(owner, fp8_output=fp8_output, fp8_grad=fp8_grad)

    def _fp8_plan(self, device: torch.device, gemm: Optional[str] = None):
        """This forward's FP8 plan (None outside autocast and calibration): the autocast's recipe, checked
        against the device the GEMMs run on, and this module's FP8 state. ``gemm`` names the state of a
        module with several GEMMs (LayerNormMLP's "fc1", "fc2"); a one-GEMM module keeps ``_fp8_state``.

        Inside ``transformer_engine.pytorch.checkpoint`` the first forward's plans are recorded and the
        recompute gets them back (the same scales, no second amax record)."""
        from transformer_engine.pytorch import distributed

        plan = distributed.replayed_fp8_plan(self, gemm)
        if plan is not distributed.NOT_REPLAYING:
            return plan
        plan = self._new_fp8_plan(device, gemm)
        distributed.record_fp8_plan(self, gemm, plan)
        return plan

    def _new_fp8_plan(self, device: torch.device, gemm: Optional[str]):
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, check_recipe_support
        from transformer_engine.pytorch.quantization_linear import LinearFP8State

        attr = "_fp8_state" if gemm is None else f"_fp8_state_{gemm}"
        enabled = FP8GlobalStateManager.is_fp8_enabled()
        if not (enabled or FP8GlobalStateManager.is_fp8_calibration()):
            state = self.__dict__.get(attr)
            if state is not None and state.last_enabled and torch.is_grad_enabled() \
                    and torch._C._current_graph_task_id() != -1:
                # A forward run inside a backward pass (torch's activation recompute) outside the autocast
                # of the first forward would recompute in high precision what was computed in FP8.
                raise NotImplementedError(
                    f"{type(self).__name__}: activation recompute of an FP8 forward outside the first "
                    "forward's autocast is not implemented (it would recompute in high precision); use "
                    "transformer_engine.pytorch.checkpoint, which recomputes with the first forward's FP8 state")
            return None
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if enabled:
            check_recipe_support(recipe, device)
        state = self.__dict__.get(attr)
        if state is None:
            # A plain attribute, not a buffer: get_extra_state saves it (the state dict's `_extra_state`).
            state = self.__dict__[attr] = LinearFP8State()
        plan = state.plan(recipe, FP8GlobalStateManager.get_fp8_group(), device, enabled)
        plan.enabled = state.last_enabled = enabled
        return plan
