"""``MakeExtraOutput`` and ``AddExtraInput``: a residual branch inside ``Sequential``.

``MakeExtraOutput`` returns its input unchanged and also as an extra output of the ``Sequential`` (the residual
Megatron's fused-residual RMSNorm keeps); the gradients of both uses add up in the backward, as autograd adds
them for a tensor used twice. ``AddExtraInput`` adds the next extra input of the ``Sequential`` to its input.
``in_place=True`` (TransformerEngine's in-place gradient accumulation / addition into the extra tensor) is refused.
"""

from __future__ import annotations

from typing import Tuple

import torch

from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["MakeExtraOutput", "AddExtraInput"]


def _refuse_in_place(owner: str, in_place: bool) -> None:
    if in_place:
        raise NotImplementedError(f"{owner}: `in_place=True` is not implemented: the sum is a new tensor "
                                  "(autograd's, with no in-place update of the extra tensor)")


class MakeExtraOutput(BasicOperation):
    """The input, passed on and also given as an extra output."""

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        _refuse_in_place("MakeExtraOutput", in_place)

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        return x, (x,)


class AddExtraInput(BasicOperation):
    """``extra_input + x``."""

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        _refuse_in_place("AddExtraInput", in_place)

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        return extra_inputs[0] + x, ()
