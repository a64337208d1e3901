"""Quantized tensor types, as TransformerEngine's ``pytorch.tensor`` names them.

FP8 operands stay inside the modules' autograd functions (``pytorch/quantization.py``) and FP8
parameters (``fp8_model_init``) are refused, so no quantized tensor reaches a client. ``QuantizedTensor``
exists so that clients' ``isinstance(param, QuantizedTensor)`` checks run and answer False;
constructing one raises NotImplementedError.
"""

from __future__ import annotations

import torch


class QuantizedTensor(torch.Tensor):
    """Base of TransformerEngine's FP8/FP4 parameter tensors; never instantiated here."""

    def __new__(cls, *args, **kwargs):
        raise NotImplementedError("QuantizedTensor: quantized (FP8/FP4) tensors are not implemented by the "
                                  "deterministic-attention package")


__all__ = ["QuantizedTensor"]
