"""LayerNorm and RMSNorm with TransformerEngine's arguments.

Computed in fp32 for 16-bit and fp32 inputs (as TransformerEngine's kernels do; fp64 in fp64), returned in the
input dtype; plain torch ops, so the result is the same bits run to run on CPU and CUDA.
``zero_centered_gamma=True`` stores gamma - 1: the scale applied is ``1 + weight`` and the weight
starts at zero.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch

from transformer_engine.pytorch.batch_invariance import bi_norm, is_batch_invariant
from transformer_engine.pytorch.module.base import check_normalization, resolve_device, resolve_dtype


def apply_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
               normalization: str, zero_centered_gamma: bool) -> torch.Tensor:
    """Normalize over the last dim in fp32 (fp64 for fp64 input), scale (and shift for LayerNorm), cast back to x's dtype.
    In batch-invariant mode, on the batch-invariant row kernels (float32 inside)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"input's last dim must be the normalized size {weight.shape[0]}, got shape {tuple(x.shape)}")
    if is_batch_invariant():
        return bi_norm(x, weight, bias, eps, normalization, zero_centered_gamma)
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32 for 16-bit inputs, fp64 stays fp64
    xf = x.to(compute)
    if normalization == "LayerNorm":
        y = torch.nn.functional.layer_norm(xf, (xf.shape[-1],), None, None, eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    gamma = weight.to(compute) + 1 if zero_centered_gamma else weight.to(compute)
    y = y * gamma
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def _hidden_size(normalized_shape: Union[int, Iterable[int]]) -> int:
    if isinstance(normalized_shape, int):
        size = normalized_shape
    else:
        shape = tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"`normalized_shape` must be an int or a 1-element shape, got {shape}")
        size = shape[0]
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"`normalized_shape` must be a positive int, got {normalized_shape!r}")
    return size


class _Norm(torch.nn.Module):
    _normalization = "LayerNorm"

    def __init__(self, normalized_shape: Union[int, Iterable[int]], eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, device: Union[str, int, torch.device, None] = None,
                 sm_margin: int = 0, **kwargs) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}")
        check_normalization(type(self).__name__, self._normalization)
        if not float(eps) > 0:
            raise ValueError(f"`eps` must be positive, got {eps!r}")
        hidden = _hidden_size(normalized_shape)
        self.normalized_shape = (hidden,)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        # sm_margin reserves SMs for overlapping communication in TransformerEngine's kernels;
        # these are plain torch ops, so it is accepted and has no effect.
        self.sm_margin = sm_margin
        device = resolve_device(device)
        dtype = resolve_dtype(params_dtype)
        self.weight = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        if self._normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Megatron all-reduces the gradients of parameters so marked over the TP group.
            param.sequence_parallel = self.sequence_parallel
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return apply_norm(inp, self.weight, self.bias, self.eps, self._normalization, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    r"""LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * gamma + beta``.

    Args follow TransformerEngine's: ``normalized_shape``, ``eps``, ``sequence_parallel`` (marks the
    parameters for Megatron's gradient all-reduce), ``params_dtype``, ``zero_centered_gamma``
    (scale is ``1 + weight``), ``device`` (default None: CUDA when available, else the CPU; TransformerEngine's
    default is "cuda"), ``sm_margin`` (accepted, no effect).
    """

    _normalization = "LayerNorm"


class RMSNorm(_Norm):
    r"""RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * gamma``; arguments as LayerNorm's."""

    _normalization = "RMSNorm"
