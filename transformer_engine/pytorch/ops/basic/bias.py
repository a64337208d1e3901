"""``Bias``: ``x + b`` over the last dim (the bias of ``torch.nn.Linear``), in the input's dtype as ``Linear``
adds its bias; the bias gradient is autograd's sum over the leading dims."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from transformer_engine.pytorch.module._parallel import group_size
from transformer_engine.pytorch.module.base import divide
from transformer_engine.pytorch.ops.basic.basic_linear import _default_group
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["Bias"]


class Bias(BasicOperation):
    """``x + bias``; ``bias`` has ``size`` entries (``size / tp`` with ``tensor_parallel=True``, the bias of a
    column-parallel output) and starts at zero. ``device="meta"`` defers it to the first forward."""

    def __init__(self, size: int, *, device: Optional[Union[torch.device, str]] = None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel: bool = False,
                 tensor_parallel_group: Optional[Any] = None) -> None:
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"`size` must be a positive int, got {size!r}")
        group = _default_group(tensor_parallel_group) if tensor_parallel else None
        tp = group_size(group)
        self.tensor_parallel = bool(tensor_parallel) and tp > 1
        self.tensor_parallel_group = group if self.tensor_parallel else None
        self.tensor_parallel_size = tp
        self.local_size = divide(size, tp, "size") if self.tensor_parallel else size
        device, dtype = self._device_and_dtype(device, dtype)
        self.bias = torch.nn.Parameter(torch.empty(self.local_size, device=device, dtype=dtype))
        self.reset_parameters()

    def _init_parameter(self, name: str, param: torch.Tensor) -> None:
        param.zero_()

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        self._materialize(x.device)
        if x.shape[-1] != self.local_size:
            raise ValueError(f"input's last dim must be the bias size {self.local_size}, got shape {tuple(x.shape)}")
        bias = self.bias if self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return x + bias, ()
