"""What FusedAdam and FusedSGD share: argument checks, gradient lookup, zero_grad, and whether
torch's fused kernel serves a list of parameters."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices


def check_dtype_is_fp32(name: str, dtype) -> None:
    if dtype != torch.float32:
        raise NotImplementedError(f"`{name}` must be torch.float32, got {dtype}")


def grad_of(param: torch.Tensor, use_decoupled_grad: bool) -> Optional[torch.Tensor]:
    return getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad


def zero_grads(optimizer: torch.optim.Optimizer, set_to_none: Optional[bool]) -> None:
    """TransformerEngine's zero_grad: ``set_to_none`` defaults to the deprecated constructor
    argument ``set_grad_none``, else True; ``decoupled_grad`` is reset when the optimizer reads it."""
    fixed = getattr(optimizer, "set_grad_none", None)
    if fixed is not None:
        if set_to_none is not None and set_to_none != fixed:
            raise ValueError(
                f"`set_to_none` must equal the constructor's set_grad_none={fixed}, got {set_to_none}"
            )
        set_to_none = fixed
    if set_to_none is None:
        set_to_none = True
    attr = "decoupled_grad" if getattr(optimizer, "use_decoupled_grad", False) else "grad"
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = getattr(p, attr, None)
            if grad is None:
                continue
            if set_to_none:
                setattr(p, attr, None)
            else:
                if grad.grad_fn is not None:
                    grad.detach_()
                else:
                    grad.requires_grad_(False)
                grad.zero_()


def torch_fused_ok(tensors: List[torch.Tensor]) -> bool:
    """True when torch's fused optimizer kernels take these tensors (one supported device type,
    floating dtypes)."""
    devices = {t.device.type for t in tensors}
    return (
        len(devices) == 1
        and next(iter(devices)) in _get_fused_kernels_supported_devices()
        and all(t.is_floating_point() for t in tensors)
    )
