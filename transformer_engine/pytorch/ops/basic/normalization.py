"""``LayerNorm`` and ``RMSNorm`` operations: ``transformer_engine.pytorch.module.layernorm.apply_norm``, the
function the ``LayerNorm`` / ``RMSNorm`` modules and the fused-norm linears call, so the op's bits are theirs."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple, Union

import torch

from transformer_engine.pytorch.module.layernorm import _hidden_size, apply_norm
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm"]


class _NormOp(BasicOperation):
    _normalization = "LayerNorm"

    def __init__(self, normalized_shape: Union[int, Iterable[int]], *, eps: float = 1e-5,
                 device: Optional[Union[torch.device, str]] = None, dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, sm_margin=0) -> None:
        super().__init__()
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not float(eps) > 0:
            raise ValueError(f"`eps` must be a positive float, got {eps!r}")
        hidden = _hidden_size(normalized_shape)
        self.normalized_shape = (hidden,)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        # sm_margin reserves SMs for communication in TransformerEngine's kernels; these are torch ops.
        self.sm_margin = sm_margin
        device, dtype = self._device_and_dtype(device, dtype)
        self.weight = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        if self._normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def _init_parameter(self, name: str, param: torch.Tensor) -> None:
        if name == "weight" and not self.zero_centered_gamma:
            param.fill_(1.0)
        else:
            param.zero_()

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        self._materialize(x.device)
        return apply_norm(x, self.weight, self.bias, self.eps, self._normalization, self.zero_centered_gamma), ()

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_NormOp):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last dim (``1 + gamma`` with
    ``zero_centered_gamma``), in float32 for 16-bit and float32 inputs; parameters ``weight`` and ``bias``."""
    _normalization = "LayerNorm"


class RMSNorm(_NormOp):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last dim; parameter ``weight``."""
    _normalization = "RMSNorm"
