"""Fp8Unpadding: drop the alignment rows Fp8Padding added to each expert's row block."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from transformer_engine.pytorch.module.fp8_padding import _check_rows, check_padding_args, padded_splits

__all__ = ["Fp8Unpadding"]


class Fp8Unpadding(torch.nn.Module):
    """``forward(inp, m_splits) -> out``: ``inp`` holds blocks of ``m_splits[i]`` rounded up to ``align_size``
    rows; ``out`` keeps the first ``m_splits[i]`` rows of each (the inverse of ``Fp8Padding``, exactly).
    ``align_size=None`` takes the active recipe's alignment on the first forward. Already aligned splits return
    ``inp`` itself. The gradient is the output gradient with zero rows where the padding was."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        check_padding_args(type(self).__name__, num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        splits, padded = padded_splits(self, m_splits)
        x = _check_rows(inp, sum(padded), "padded m_splits")
        if splits == padded:
            return inp
        return torch.cat([block[:m] for block, m in zip(x.split(padded), splits)])

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"
