"""The operation base classes: ``FusibleOperation`` and ``BasicOperation``.

An operation is a ``torch.nn.Module`` whose forward is plain autograd over this package's functions (the same
ones the modules call), so an operation gives the bits of the module it stands for, forward and backward, and
goes through the batch-invariant kernels under that mode. An operation may take extra tensor inputs
(``num_extra_inputs``) and give extra tensor outputs (``num_extra_outputs``); ``Sequential`` routes them.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from transformer_engine.pytorch.module.base import resolve_device, resolve_dtype

__all__ = ["FusibleOperation", "BasicOperation"]


class FusibleOperation(torch.nn.Module):
    """An operation ``Sequential`` can hold among its ops (TransformerEngine's name for the common base)."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()
               ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """``(output, extra_outputs)`` for ``x`` and this op's ``num_extra_inputs`` extra inputs."""
        raise NotImplementedError(f"{type(self).__name__} does not define op_run")

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(f"{type(self).__name__} must get {self.num_extra_inputs} extra inputs, "
                             f"got {len(extra_inputs)}")
        y, extra_outputs = self.op_run(x, tuple(extra_inputs))
        return (y,) + tuple(extra_outputs) if extra_outputs else y


class BasicOperation(FusibleOperation):
    """One operation (not a fusion of several): every operation here is one."""

    @staticmethod
    def _device_and_dtype(device, dtype) -> Tuple[torch.device, torch.dtype]:
        """``device="meta"`` defers the parameters (TransformerEngine's way for a caller that assigns its own
        parameters afterwards); those still on meta at the first forward are made then, on the input's device.
        ``device=None``: CUDA when available, else the CPU."""
        if device is not None and str(device) == "meta":
            return torch.device("meta"), resolve_dtype(dtype)
        return resolve_device(device), resolve_dtype(dtype)

    def _materialize(self, device: torch.device) -> None:
        """Parameters still on meta at the first forward: allocated on the input's device and initialized (only
        those: a parameter the caller assigned keeps its values)."""
        for name, param in list(self._parameters.items()):
            if param is not None and param.device.type == "meta":
                param = torch.nn.Parameter(torch.empty_like(param, device=device))
                with torch.no_grad():
                    self._init_parameter(name, param)
                setattr(self, name, param)

    def reset_parameters(self) -> None:
        """Initialize every parameter that is not on meta."""
        for name, param in self._parameters.items():
            if param is not None and param.device.type != "meta":
                with torch.no_grad():
                    self._init_parameter(name, param)

    def _init_parameter(self, name: str, param: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no parameter {name!r} to initialize")


def check_no_quantized_cache(owner: str, cache_quantized_input: Optional[bool]) -> None:
    if cache_quantized_input:
        raise NotImplementedError(f"{owner}: `cache_quantized_input=True` is not implemented: the input is saved "
                                  "for the backward pass in its own dtype")
