"""``BasicLinear``: ``y = x W^T`` (no bias), tensor parallel, with fused wgrad accumulation and FP8.

The GEMM is ``transformer_engine.pytorch.module.linear.parallel_linear``, the function ``Linear`` calls: the same
collectives (column: the input gathered along the sequence under sequence parallelism, the output split; row: the
partial products all-reduced, or reduce-scattered along the sequence), the same fused accumulation into
``weight.main_grad``, the same FP8 GEMMs inside ``transformer_engine.pytorch.autocast`` (this op keeps its own FP8
state, as a module does) and the batch-invariant GEMM under that mode.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional, Tuple, Union

import torch

from transformer_engine.pytorch.module._parallel import group_size
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule, divide
from transformer_engine.pytorch.module.linear import parallel_linear
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["BasicLinear"]


def _default_group(group: Optional[Any]) -> Optional[Any]:
    """None stands for the world group (TransformerEngine's default) when torch.distributed is running."""
    if group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return group


class BasicLinear(BasicOperation, TransformerEngineBaseModule):
    """``y = x W^T`` with ``weight`` of shape ``[out_features, in_features]`` (this rank's part under tensor
    parallelism: ``out_features / tp`` for ``tensor_parallel_mode="column"``, ``in_features / tp`` for ``"row"``).

    Arguments are TransformerEngine's: ``device`` (``"meta"`` defers the weight to the first forward; the caller
    may assign its own), ``dtype``, ``tensor_parallel_mode`` (None, "column", "row"), ``tensor_parallel_group``
    (default: the world group), ``sequence_parallel``, ``rng_state_tracker_function`` (the initialization runs in
    its ``fork()``), ``accumulate_into_main_grad`` (the weight gradient is added in float32 to
    ``weight.main_grad``, or copied there when ``weight.overwrite_main_grad`` is set). The weight starts as
    ``torch.nn.init.kaiming_uniform_(w, a=sqrt(5))``. ``userbuffers_options`` (communication overlap) is refused.
    """

    def __init__(self, in_features: int, out_features: int, *, device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel_mode: Optional[str] = None,
                 tensor_parallel_group: Optional[Any] = None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable[[], Any]] = None,
                 accumulate_into_main_grad: bool = False, userbuffers_options: Optional[dict] = None) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if tensor_parallel_mode not in (None, "column", "row"):
            raise ValueError(f"`tensor_parallel_mode` must be None, 'column' or 'row', got {tensor_parallel_mode!r}")
        if userbuffers_options is not None:
            raise NotImplementedError(f"BasicLinear: `userbuffers_options={userbuffers_options!r}` is not "
                                      "implemented: collectives go through torch.distributed, not overlapped")
        group = _default_group(tensor_parallel_group) if tensor_parallel_mode is not None else None
        tp = group_size(group)
        self.tensor_parallel_mode = tensor_parallel_mode if tp > 1 else None
        self.tensor_parallel_group = group if tp > 1 else None
        self.tensor_parallel_size = tp
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features = divide(in_features, tp, "in_features") if self.tensor_parallel_mode == "row" \
            else in_features
        self.local_out_features = divide(out_features, tp, "out_features") \
            if self.tensor_parallel_mode == "column" else out_features
        self._rng_state_tracker_function = rng_state_tracker_function
        self._accumulate_into_main_grad = bool(accumulate_into_main_grad)
        device, dtype = self._device_and_dtype(device, dtype)
        self.weight = torch.nn.Parameter(torch.empty(self.local_out_features, self.local_in_features,
                                                     device=device, dtype=dtype))
        self.reset_parameters()

    def _init_parameter(self, name: str, param: torch.Tensor) -> None:
        fork = self._rng_state_tracker_function().fork() if self._rng_state_tracker_function is not None \
            else contextlib.nullcontext()
        with fork:
            torch.nn.init.kaiming_uniform_(param, a=math.sqrt(5))

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        self._materialize(x.device)
        out, _ = parallel_linear(x, self.weight, None, self.tensor_parallel_mode, self.tensor_parallel_group,
                                 self.sequence_parallel, False, self._accumulate_into_main_grad, None,
                                 self._fp8_plan(x.device))
        return out, ()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tensor_parallel_mode={self.tensor_parallel_mode}, tensor_parallel_size={self.tensor_parallel_size}")
