"""Megatron's weight-gradient fusion: a weight gradient added (or copied) into ``weight.main_grad``.

A leaf module: the GEMM paths (FP8, batch-invariant, grouped, plain) all call it.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["accumulate_into_main_grad"]


def accumulate_into_main_grad(weight: torch.Tensor, wgrad: torch.Tensor, overwrite: bool) -> Optional[torch.Tensor]:
    """Add (or copy, on the first micro-batch / ``overwrite_main_grad``) ``wgrad`` into ``weight.main_grad``.

    Returns what autograd gets for the weight: None, or a zero that takes no memory when the weight
    carries Megatron's ``grad_added_to_main_grad`` flag (then set), so its gradient hooks still fire.
    """
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or main_grad.shape != weight.shape:
        raise RuntimeError(
            f"`weight.main_grad` must be a tensor of the weight's shape {tuple(weight.shape)} with "
            f"fuse_wgrad_accumulation=True, got {None if main_grad is None else tuple(main_grad.shape)}"
        )
    if overwrite or getattr(weight, "overwrite_main_grad", False):
        main_grad.copy_(wgrad)
    else:
        main_grad.add_(wgrad)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    return None
