"""Activations with a per-row scale: ``ScaledSwiGLU``, ``ScaledClampedQGeGLU``, ``ScaledSReLU``.

The middle operation of Megatron-core's fused grouped MLP: ``act(x) * s`` with one scale per row (the router's
probability of the token's expert), the scales the operation's extra input. The activation is the table's
(``transformer_engine.common.modules``, computed in float32 as ``LayerNormMLP`` computes it); the scales are
taken in the compute dtype and the product is rounded once to it. Backward: autograd through the same
expression, gradients for the input and, when they require one, the scales.

``glu_interleave_size=k``: FC1's output holds gates and units in interleaved blocks of ``k`` columns
(``[a_0..a_{k-1}, b_0..b_{k-1}, a_k, ...]``); the blocks are put back into the two halves before the activation.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.pytorch.module.layernorm_mlp import apply_mlp_activation
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["ScaledClampedQGeGLU", "ScaledSReLU", "ScaledSwiGLU"]


def remove_glu_interleaving(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[a-block, b-block, a-block, ...]`` (blocks of ``size`` columns) as ``[a..., b...]``."""
    width = x.shape[-1]
    if width % (2 * size):
        raise ValueError(f"the input's last dim must be a multiple of 2 * glu_interleave_size={2 * size}, got "
                         f"{width}")
    y = x.reshape(-1, width // (2 * size), 2, size).transpose(1, 2)
    return y.reshape(x.shape)


class _ScaledActivation(BasicOperation):
    num_extra_inputs: int = 1
    _name = ""
    _gated = True

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False
                 ) -> None:
        super().__init__()
        owner = type(self).__name__
        if activation_recompute_in_mlp:
            raise NotImplementedError(f"{owner}: `activation_recompute_in_mlp=True` is not implemented: the input "
                                      "is saved for the backward pass (there is no fused grouped-MLP kernel here)")
        if glu_interleave_size is not None and (isinstance(glu_interleave_size, bool)
                                                or not isinstance(glu_interleave_size, int)
                                                or glu_interleave_size < 1):
            raise ValueError(f"`glu_interleave_size` must be None or a positive int, got {glu_interleave_size!r}")
        self.glu_interleave_size = glu_interleave_size
        self.activation_recompute_in_mlp = False

    def _params(self) -> Optional[dict]:
        return None

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        owner = type(self).__name__
        if len(extra_inputs) != 1:
            raise ValueError(f"{owner} must get 1 extra input (the scales), got {len(extra_inputs)}")
        scales = extra_inputs[0]
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self._gated and x.shape[-1] % 2:
            raise ValueError(f"{owner}'s input must have an even last dim, got shape {tuple(x.shape)}")
        if not isinstance(scales, torch.Tensor) or scales.numel() != x.numel() // x.shape[-1]:
            raise ValueError(f"`scales` must be a tensor with one entry per row of the input "
                             f"({x.numel() // x.shape[-1]}), got "
                             f"{tuple(scales.shape) if isinstance(scales, torch.Tensor) else scales!r}")
        if self.glu_interleave_size is not None:
            x = remove_glu_interleaving(x, self.glu_interleave_size)
        dtype = x.dtype
        compute = torch.promote_types(dtype, torch.float32)
        act = apply_mlp_activation(x.to(compute), self._name, self._params())
        s = scales.to(dtype).to(compute).reshape(act.shape[:-1]).unsqueeze(-1)
        return (act * s).to(dtype), ()


class ScaledSwiGLU(_ScaledActivation):
    """``SiLU(a) * b * s`` over the two halves ``a, b`` of the last dim, ``s`` the row's scale."""
    _name = "swiglu"


class ScaledClampedQGeGLU(_ScaledActivation):
    """``min(a, limit) * sigmoid(alpha * min(a, limit)) * (clip(b, -limit, limit) + glu_linear_offset) * s``."""
    _name = "clamped_swiglu"

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False,
                 limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0) -> None:
        super().__init__(glu_interleave_size, activation_recompute_in_mlp=activation_recompute_in_mlp)
        self.limit, self.alpha, self.glu_linear_offset = float(limit), float(alpha), float(glu_linear_offset)

    def _params(self) -> Optional[dict]:
        return {"limit": self.limit, "alpha": self.alpha, "glu_linear_offset": self.glu_linear_offset}


class ScaledSReLU(_ScaledActivation):
    """``max(x, 0)^2 * s``."""
    _name = "srelu"
    _gated = False

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__(None, activation_recompute_in_mlp=activation_recompute_in_mlp)
