"""Fp8Padding: pad each expert's row block of a grouped-GEMM input to the FP8 recipe's row alignment."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

__all__ = ["Fp8Padding", "align_size_for_recipe", "padded_splits", "check_padding_args"]


def align_size_for_recipe(recipe) -> int:
    """The row alignment grouped FP8 GEMMs need under ``recipe`` (TransformerEngine's values): 32 for MXFP8,
    128 for NVFP4, 16 for the other recipes; the default recipe's when ``recipe`` is None (outside FP8)."""
    from transformer_engine.common.quantizer_roles import row_alignment
    from transformer_engine.pytorch.fp8 import get_default_fp8_recipe

    return row_alignment(get_default_fp8_recipe() if recipe is None else recipe)


def check_padding_args(owner: str, num_gemms: int, align_size: Optional[int]) -> None:
    if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
        raise ValueError(f"{owner}: `num_gemms` must be a positive int, got {num_gemms!r}")
    if align_size is not None and (not isinstance(align_size, int) or isinstance(align_size, bool) or align_size < 1):
        raise ValueError(f"{owner}: `align_size` must be None or a positive int, got {align_size!r}")


def padded_splits(module, m_splits: Union[Sequence[int], torch.Tensor]) -> Tuple[List[int], List[int]]:
    """(``m_splits`` as a list, each rounded up to the module's alignment), the alignment fixed on first use from
    the active recipe when the module was built without one (as TransformerEngine does)."""
    if isinstance(m_splits, torch.Tensor):
        m_splits = m_splits.tolist()
    if not isinstance(m_splits, (list, tuple)) or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 0
                                                         for m in m_splits):
        raise ValueError(f"`m_splits` must be a list of non-negative ints, got {m_splits!r}")
    if len(m_splits) != module.num_gemms:
        raise ValueError(f"`m_splits` must have num_gemms={module.num_gemms} entries, got {len(m_splits)}")
    if module.align_size is None:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

        module.align_size = align_size_for_recipe(FP8GlobalStateManager.get_fp8_recipe())
    a = module.align_size
    return list(m_splits), [(m + a - 1) // a * a for m in m_splits]


def _check_rows(inp: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
        raise ValueError(f"`inp` must be a tensor, got {type(inp).__name__}")
    x = inp.reshape(-1, inp.shape[-1])
    if x.shape[0] != rows:
        raise ValueError(f"`inp` must have sum({what}) = {rows} rows, got {x.shape[0]}")
    return x


class Fp8Padding(torch.nn.Module):
    """``forward(inp, m_splits) -> (padded, padded_m_splits)``: each block of ``m_splits[i]`` rows of ``inp``
    (2-D, or flattened to [rows, last dim]) followed by zero rows up to a multiple of ``align_size``.
    ``align_size=None`` takes the active recipe's alignment on the first forward. Already aligned splits
    return ``inp`` itself. The gradient is the padded gradient's unpadded rows (a gather: exact)."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        check_padding_args(type(self).__name__, num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor]):
        splits, padded = padded_splits(self, m_splits)
        x = _check_rows(inp, sum(splits), "m_splits")
        if splits == padded:
            return inp, splits
        parts = []
        for block, m, p in zip(x.split(splits), splits, padded):
            parts.append(block)
            if p > m:
                parts.append(x.new_zeros((p - m, x.shape[1])))
        return torch.cat(parts), padded

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"
