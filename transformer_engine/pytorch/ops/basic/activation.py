"""Activation operations: the elementwise functions and gated linear units of ``LayerNormMLP``.

The math is the activation table of ``transformer_engine.common.modules`` (TransformerEngine's formulas:
GELU is the tanh approximation), computed in float32 (float64 stays float64) and returned in the input dtype,
as ``LayerNormMLP`` computes it, so an activation op gives the module's bits. Gated units split the last dim in
two halves ``a, b`` and return ``act(a) * b`` (the gate is the first half, the opposite of ``torch.nn.GLU``).
The backward is autograd's through the same expression.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.pytorch.module.layernorm_mlp import apply_mlp_activation
from transformer_engine.pytorch.ops.op import BasicOperation, check_no_quantized_cache

__all__ = ["GELU", "GEGLU", "ReLU", "ReGLU", "SiLU", "SwiGLU"]


class _Activation(BasicOperation):
    _name = ""

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        check_no_quantized_cache(type(self).__name__, cache_quantized_input)
        self.cache_quantized_input = False

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if x.shape[-1] % 2 and self._name.endswith("glu"):
            raise ValueError(f"{type(self).__name__}'s input must have an even last dim, got shape {tuple(x.shape)}")
        return apply_mlp_activation(x, self._name, None), ()


class GELU(_Activation):
    """``x * (0.5 + 0.5 tanh(0.79788456 x + 0.03567741 x^3))``: GELU's tanh approximation."""
    _name = "gelu"


class GEGLU(_Activation):
    """``GELU(a) * b`` over the two halves of the last dim."""
    _name = "geglu"


class ReLU(_Activation):
    """``max(x, 0)``."""
    _name = "relu"


class ReGLU(_Activation):
    """``ReLU(a) * b`` over the two halves of the last dim."""
    _name = "reglu"


class SiLU(_Activation):
    """``x * sigmoid(x)``."""
    _name = "silu"


class SwiGLU(_Activation):
    """``SiLU(a) * b`` over the two halves of the last dim. ``glu_interleave_size`` (a block-interleaved layout of
    gates and units for TransformerEngine's grouped kernels) is refused when set."""
    _name = "swiglu"

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size=None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        if glu_interleave_size is not None:
            raise NotImplementedError(f"SwiGLU: `glu_interleave_size={glu_interleave_size!r}` is not implemented: "
                                      "gates and units are the two contiguous halves of the last dim")
        self.glu_interleave_size = None
