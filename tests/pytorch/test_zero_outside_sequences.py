"""zero_outside_sequences (common/attention/kernels/fill.py): the flash-attn-4 backend's
clearing of token rows outside every sequence. Exactly the gap rows become zero (NaN there
included); every row inside a sequence keeps its bits.

CPU: Triton interpreter; GPU: the same tests.
"""

from __future__ import annotations

import pytest
import torch

from fused_helpers import DEVICE, requires_fused
from te_torch_testing import zero_outside_sequences_reference
from transformer_engine.common.attention.kernels.fill import zero_outside_sequences


CASES = [
    ([0, 5, 9, 20], [5, 4, 11], 20),  # cu_seqlens without gaps, no tail
    ([0, 5, 9, 20], [5, 4, 11], 37),  # ... and a tail after the last sequence
    ([3, 8, 16, 30], [2, 8, 0], 41),  # gaps before, between and after; an empty sequence
    ([0, 16, 32, 48], [16, 7, 1], 48),  # padded batch as packed rows: starts n * s, used = lengths
    ([0, 0, 0], [0, 0], 9),  # no token inside any sequence
]
CASE_IDS = ["no-gaps", "tail", "gaps-empty", "padded-batch", "all-empty"]


def _inside(starts, used, total):
    keep = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(starts.tolist(), used.tolist()):
        keep[s:s + n] = True
    return keep


@requires_fused
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("starts,used,total", CASES, ids=CASE_IDS)
def test_only_gap_rows_become_zero(dtype, starts, used, total, device=DEVICE, clear=zero_outside_sequences):
    h, d = 3, 40  # not powers of two: the kernel's column mask
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((total, h, d), generator=gen).to(device, dtype)
    x[0] = float("nan")  # a gap row holding NaN must still read zero
    before = x.clone()
    starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
    used_t = torch.tensor(used, dtype=torch.int32, device=device)
    out = clear(x, starts_t, used_t)
    assert out is x
    keep = _inside(torch.tensor(starts), torch.tensor(used), total).to(device)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    assert torch.equal(x[keep].view(bits), before[keep].view(bits))  # bitwise, NaN-safe
    assert torch.equal(x[~keep], torch.zeros_like(x[~keep]))


@pytest.mark.parametrize("starts,used,total", CASES, ids=CASE_IDS)
def test_the_tests_torch_reference_clears_the_same_rows(starts, used, total):
    """The stand-in backends' tests clear rows with a torch reference on CPU (no interpreter there)."""
    test_only_gap_rows_become_zero(torch.float32, starts, used, total, device="cpu",
                                   clear=zero_outside_sequences_reference)


@requires_fused
def test_strided_rows_leave_other_columns_alone():
    """A view of every other head of a [t, 2h, d] tensor: only the viewed heads of gap rows clear."""
    total, h, d = 12, 2, 16
    base = torch.ones((total, 2 * h, d), device=DEVICE, dtype=torch.float16)
    view = base[:, ::2]
    zero_outside_sequences(view, torch.tensor([2, 12], dtype=torch.int32, device=DEVICE),
                           torch.tensor([10], dtype=torch.int32, device=DEVICE))
    assert torch.equal(base[:2, ::2], torch.zeros_like(base[:2, ::2]))
    assert torch.equal(base[:2, 1::2], torch.ones_like(base[:2, 1::2]))
    assert torch.equal(base[2:], torch.ones_like(base[2:]))


def test_launch_states_fp_contraction(monkeypatch):
    """Every launch in the package states enable_fp_fusion rather than relying on Triton's default."""
    from transformer_engine.common.attention.kernels import fill

    seen = []

    class _Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((grid, kwargs))

    monkeypatch.setattr(fill, "zero_outside_sequences_kernel", _Kernel())
    fill.zero_outside_sequences(torch.zeros(9, 2, 4), torch.tensor([0, 4]), torch.tensor([3, 5]))
    assert len(seen) == 1 and seen[0][0][0] == 3 and seen[0][1]["enable_fp_fusion"] is True
