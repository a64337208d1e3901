"""``AllReduce`` and ``ReduceScatter``: the row-parallel output's collectives as operations (the functions
``Linear(parallel_mode="row")`` uses: ``transformer_engine.pytorch.module._parallel.row_output``)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from transformer_engine.pytorch.module._parallel import row_output
from transformer_engine.pytorch.ops.basic.basic_linear import _default_group
from transformer_engine.pytorch.ops.op import BasicOperation

__all__ = ["AllReduce", "ReduceScatter"]


class AllReduce(BasicOperation):
    """The sum over ``process_group`` (default: the world); the gradient passes through unchanged (the output
    feeds computation every rank repeats). ``reduce_in_backward`` is accepted, as TransformerEngine's is, and
    changes nothing."""

    def __init__(self, process_group: Optional[Any] = None, reduce_in_backward: bool = True) -> None:
        super().__init__()
        self.process_group = process_group
        self._reduce_in_backward = bool(reduce_in_backward)

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        return row_output(x, _default_group(self.process_group), False), ()


class ReduceScatter(BasicOperation):
    """The sum over ``process_group``, this rank's slice of dim 0 (the sequence); the backward all-gathers."""

    def __init__(self, process_group: Optional[Any] = None) -> None:
        super().__init__()
        self.process_group = process_group

    def op_run(self, x: torch.Tensor, extra_inputs: Tuple[torch.Tensor, ...] = ()):
        return row_output(x, _default_group(self.process_group), True), ()
