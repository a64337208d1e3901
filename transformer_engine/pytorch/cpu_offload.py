"""Activation offloading to CPU memory: ``get_cpu_offload_context``, TransformerEngine's signature.

The context installs saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) around each layer's
forward. In an offloaded layer (the first ``num_layers`` of every ``model_layers`` entries of the context, which
is how many layers the model runs under it) each tensor autograd saves for the backward pass is copied to CPU
memory (pinned when CUDA is there) when it is saved, and copied back to its device when the backward pass asks
for it. The copies are exact, so the gradients are the bits of a run without offloading.

What is offloaded: plain tensors (``type(t) is torch.Tensor``) on a non-CPU device, contiguous, not marked with
``mark_not_offload``. Parameters, tensor subclasses and non-contiguous tensors stay where they are (a
non-contiguous tensor is often a view of a larger one, so copying it could take more memory than it frees). A
tensor already in CPU memory has nowhere to go: it is kept as it is, but it still goes through the hooks (the
context's ``num_packed`` / ``num_unpacked`` count them; ``num_moved`` counts the tensors copied to the host).

The copies run on the current stream with ``non_blocking=True``: the device memory of an offloaded activation is
free once its copy is done, and the reload is stream-ordered after it. There is no separate offload stream, so
the transfers do not overlap the layer's compute (TransformerEngine's do); the saving in device memory is the
same. ``retain_pinned_cpu_buffers=True`` keeps each layer's host buffers and reuses them the next step when the
shapes and dtypes repeat (a step's forward then overwrites the previous step's host copies: run each step's
backward before the next step's forward).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, List, Optional, Tuple

import torch

__all__ = ["get_cpu_offload_context", "is_cpu_offload_enabled", "mark_not_offload"]

_ACTIVE_CONTEXTS: List["_CpuOffloadContext"] = []


def is_cpu_offload_enabled() -> bool:
    """Whether a layer is running inside an enabled offload context now."""
    return bool(_ACTIVE_CONTEXTS)


def mark_not_offload(*tensors: Optional[torch.Tensor]) -> None:
    """Keep these tensors on their device when autograd saves them inside an offload context."""
    for tensor in tensors:
        if tensor is not None:
            tensor._te_do_not_offload = True


# Saved tensors on these devices are not copied (they are in host memory already, or have no data).
_STAYING_DEVICE_TYPES = ("cpu", "meta")


def _moves(tensor: torch.Tensor) -> bool:
    """Whether a saved tensor is copied to the host (see the module docstring)."""
    return (type(tensor) is torch.Tensor and tensor.device.type not in _STAYING_DEVICE_TYPES
            and tensor.is_contiguous() and not getattr(tensor, "_te_do_not_offload", False))


class _Offloaded:
    """A saved tensor's host copy and where it came from."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device


class _LayerBuffers:
    """One layer's host buffers, in the order its tensors were saved; reused the next step when retained."""

    def __init__(self, retain: bool) -> None:
        self.retain = retain
        self.buffers: List[torch.Tensor] = []
        self.next = 0

    def start_step(self) -> None:
        self.next = 0
        if not self.retain:
            self.buffers = []

    def buffer_for(self, tensor: torch.Tensor) -> torch.Tensor:
        i, self.next = self.next, self.next + 1
        if i < len(self.buffers) and self.buffers[i].shape == tensor.shape and self.buffers[i].dtype == tensor.dtype:
            return self.buffers[i]
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        if self.retain:
            if i < len(self.buffers):
                self.buffers[i] = buf
            else:
                self.buffers.append(buf)
        return buf


class _CpuOffloadContext(contextlib.ContextDecorator):
    """What ``get_cpu_offload_context`` returns first: enter it around each layer's forward."""

    def __init__(self, num_layers: int, model_layers: int, retain_pinned_cpu_buffers: bool) -> None:
        self.num_layers, self.model_layers = num_layers, model_layers
        self.inside_context = False
        self.current_layer: Optional[int] = None
        self._entries = 0
        self._hooks = None
        self._layers = [_LayerBuffers(retain_pinned_cpu_buffers) for _ in range(num_layers)]
        self.num_packed = self.num_unpacked = self.num_moved = 0

    def __enter__(self) -> "_CpuOffloadContext":
        if self.inside_context:
            raise RuntimeError("the CPU offload context was entered again before the synchronization function "
                               "was called on the layer's output")
        self.inside_context = True
        self.current_layer = self._entries % self.model_layers
        self._entries += 1
        if self.current_layer < self.num_layers:
            self._layers[self.current_layer].start_step()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            _ACTIVE_CONTEXTS.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
            _ACTIVE_CONTEXTS.remove(self)
        self.inside_context = False

    def _pack(self, tensor: torch.Tensor) -> Any:
        self.num_packed += 1
        if not _moves(tensor):
            return tensor
        self.num_moved += 1
        host = self._layers[self.current_layer].buffer_for(tensor)
        host.copy_(tensor, non_blocking=host.is_pinned())
        return _Offloaded(host, tensor.device)

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.num_unpacked += 1
        if not isinstance(packed, _Offloaded):
            return packed
        return packed.host.to(packed.device, non_blocking=packed.host.is_pinned(), copy=True)

    def synchronization_function(self, tensor: torch.Tensor) -> torch.Tensor:
        """Called on each layer's output after the context is left; returns it unchanged (the copies are
        stream-ordered, so there is nothing to wait for)."""
        if self.inside_context:
            raise RuntimeError("the synchronization function was called inside the CPU offload context; call it "
                               "on the layer's output after leaving the context")
        if self.current_layer is None:
            raise RuntimeError("the synchronization function was called before the CPU offload context was entered")
        return tensor


def get_cpu_offload_context(enabled: bool = False, num_layers: Optional[int] = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False,
                            offload_stream: Optional[Any] = None) -> Tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """``(context, sync_function)``: enter ``context`` around each of the model's ``model_layers`` layers'
    forward and pass each layer's output through ``sync_function``; the saved activations of the first
    ``num_layers`` layers go to CPU memory and come back for the backward pass (see the module docstring).

    ``enabled=False``: a context that does nothing and the identity. ``offload_weights`` and
    ``double_buffering`` are accepted and have no effect, as in TransformerEngine (weights are parameters and
    stay on the device). ``manual_synchronization`` and ``offload_stream`` (user-driven offload and reload on a
    given stream) are refused.
    """
    if manual_synchronization:
        raise NotImplementedError("get_cpu_offload_context: `manual_synchronization=True` is not implemented: "
                                  "activations are offloaded when saved and reloaded when the backward needs them")
    if offload_stream is not None:
        raise NotImplementedError("get_cpu_offload_context: `offload_stream` is not implemented: the copies run on "
                                  "the current stream")
    if not enabled:
        return contextlib.nullcontext(), lambda tensor: tensor
    if not offload_activations and not offload_weights:
        raise ValueError("`offload_activations` or `offload_weights` must be True when offloading is enabled, "
                         "got both False")
    if offload_weights:
        warnings.warn("`offload_weights=True` has no effect: weights are parameters and stay on their device",
                      DeprecationWarning, stacklevel=2)
        if not offload_activations:
            return contextlib.nullcontext(), lambda tensor: tensor
    if isinstance(model_layers, bool) or not isinstance(model_layers, int) or model_layers < 1:
        raise ValueError(f"`model_layers` must be a positive int, got {model_layers!r}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 0 <= num_layers < model_layers:
        raise ValueError(f"`num_layers` must be an int in [0, model_layers - 1 = {model_layers - 1}] (the last layer "
                         f"is not offloaded: its backward comes first), got {num_layers!r}")
    context = _CpuOffloadContext(num_layers, model_layers, bool(retain_pinned_cpu_buffers))
    return context, context.synchronization_function
