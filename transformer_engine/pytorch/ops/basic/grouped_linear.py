"""``GroupedLinear`` (the operation): ``y_i = x_i W_i^T + b_i`` over consecutive row blocks of the input.

The operation form of ``transformer_engine.pytorch.GroupedLinear`` for MoE experts in a ``Sequential``
(Megatron-core's fused grouped MLP: ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear``). Its extra input is the
split sizes (one row count per group, a list or an integer tensor); with ``scale_bias=True`` a second extra input,
one scale per row, multiplies the bias (``y_i = x_i W_i^T + s_i b_i``, Megatron's router probabilities on FC2's
bias). The GEMMs are the module's (``transformer_engine.pytorch.grouped_gemm.grouped_linear``): the same
paths, the same per-expert FP8 GEMMs with one quantization state per group (this operation keeps its own, as a
module does), the same fused accumulation into ``weight{i}.main_grad``, so the operation gives the module's bits.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from transformer_engine.pytorch.grouped_gemm import WeightStack, grouped_linear
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.grouped_linear import check_m_splits
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["GroupedLinear"]


class GroupedLinear(BasicOperation, TransformerEngineBaseModule):
    """``num_groups`` linear maps on consecutive row blocks: ``forward(x, split_sizes)`` (and ``scales`` with
    ``scale_bias=True``).

    Parameters ``weight0`` .. ``weight{num_groups-1}`` [out_features, in_features] (each
    ``kaiming_uniform_(w, a=sqrt(5))``, inside ``rng_state_tracker_function().fork()`` when given) and, with
    ``bias=True``, ``bias0`` .. (zeros); without a bias the ``bias{i}`` are None. ``device="meta"`` leaves the
    parameters for the caller to assign (Megatron registers its ``TEGroupedLinear``'s own); those still on meta
    at the first forward are made on the input's device. ``accumulate_into_main_grad``: each weight gradient is
    added in float32 to ``weight{i}.main_grad`` (copied there when ``weight{i}.overwrite_main_grad`` is set).

    Not implemented (refused by name): ``single_grouped_weight``, ``single_grouped_bias`` (one parameter per
    group is kept) and ``delay_wgrad_compute``.
    """

    num_extra_inputs: int = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None,
                 rng_state_tracker_function: Optional[Callable[[], Any]] = None,
                 accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, delay_wgrad_compute: bool = False,
                 scale_bias: bool = False) -> None:
        for arg, value, why in (
                ("single_grouped_weight", single_grouped_weight, "one parameter per group is kept (weight0, ...)"),
                ("single_grouped_bias", single_grouped_bias, "one parameter per group is kept (bias0, ...)"),
                ("delay_wgrad_compute", delay_wgrad_compute, "weight gradients are computed in the backward pass")):
            if value:
                raise NotImplementedError(f"GroupedLinear: `{arg}=True` is not implemented: {why}")
        for name, value in (("num_groups", num_groups), ("in_features", in_features),
                            ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        self._scale_bias = bool(scale_bias) and bool(bias)
        super().__init__()
        # An instance attribute, as TransformerEngine decides it: the scales are a second extra input.
        self.num_extra_inputs = 2 if self._scale_bias else 1
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bool(bias)
        self.single_grouped_weight = self.single_grouped_bias = False
        self._rng_state_tracker_function = rng_state_tracker_function
        self._accumulate_into_main_grad = bool(accumulate_into_main_grad)
        # One FP8 state per group (`_fp8_state_0`, ...), as the module keeps them.
        self._fp8_gemms = tuple(str(i) for i in range(num_groups))
        self._weight_stack = WeightStack()
        device, dtype = self._device_and_dtype(device, dtype)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"`dtype` must be float32, float16 or bfloat16, got {dtype}")
        for i in range(num_groups):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=dtype)))
        for i in range(num_groups):
            self.register_parameter(f"bias{i}", torch.nn.Parameter(
                torch.empty(out_features, device=device, dtype=dtype)) if self.use_bias else None)
        self.reset_parameters()

    def _init_parameter(self, name: str, param: torch.Tensor) -> None:
        if name.startswith("bias"):
            param.zero_()
            return
        fork = self._rng_state_tracker_function().fork() if self._rng_state_tracker_function is not None \
            else contextlib.nullcontext()
        with fork:
            torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))

    def _weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_groups)]

    def _biases(self) -> List[torch.Tensor]:
        return [getattr(self, f"bias{i}") for i in range(self.num_groups)]

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(f"GroupedLinear must get {self.num_extra_inputs} extra inputs (split sizes"
                             f"{', scales' if self._scale_bias else ''}), got {len(extra_inputs)}")
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"`input` must be a tensor whose last dim is in_features={self.in_features}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        self._materialize(x.device)
        x2 = x.reshape(-1, self.in_features)
        splits = check_m_splits(extra_inputs[0], self.num_groups, x2.shape[0])
        if torch.is_autocast_enabled(x2.device.type):
            x2 = x2.to(torch.get_autocast_dtype(x2.device.type))
        plans = [self._fp8_plan(x2.device, gemm) for gemm in self._fp8_gemms]
        if all(p is None for p in plans):
            plans = None
        add_bias = self.use_bias and not self._scale_bias
        y = grouped_linear(x2, splits, self._weights(), self._biases() if add_bias else None,
                           fuse_wgrad_accumulation=self._accumulate_into_main_grad, is_first_microbatch=None,
                           fp8_plans=plans, stack=self._weight_stack, owner="GroupedLinear")
        if self._scale_bias:
            scales = extra_inputs[1]
            if not isinstance(scales, torch.Tensor) or scales.numel() != x2.shape[0]:
                raise ValueError(f"`scales` must be a tensor with one entry per row ({x2.shape[0]}), got "
                                 f"{tuple(scales.shape) if isinstance(scales, torch.Tensor) else scales!r}")
            # Each group's rows get s * b_i added (the scale's dtype promotes the product, the sum is rounded
            # to the output's dtype once), as Megatron adds its probabilities-weighted expert biases.
            rows = []
            for yi, si, bi in zip(y.split(splits), scales.reshape(-1).split(splits), self._biases()):
                rows.append((yi + bi * si.unsqueeze(-1)).to(yi.dtype))
            y = torch.cat(rows)
        return y.view(*x.shape[:-1], self.out_features), ()

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, scale_bias={self._scale_bias}")
