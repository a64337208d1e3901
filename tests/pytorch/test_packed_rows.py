"""The segment-row grid (packed sequences in rows of m, as JAX's max_segments_per_seq lays them out) gives the
same bits as the (block, sequence) grid: outputs, LSE and every gradient, for the Triton kernels (and on Hopper
at d=128 the Gluon ones), causal and not, windows, GQA, empty and one-token sequences, gaps between them.

The grid only decides which program computes which tile (masking.segment_block); each tile's arithmetic is
the same, so the comparison is bitwise. Runs under the Triton interpreter here and on the GPU in qa/L1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from case_grid import grid

from fused_helpers import DEVICE, DTYPES, ON_GPU, requires_fused
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call

pytestmark = requires_fused

# (rows, row length, segments per row, each row's sequence lengths and the gap after each)
LAYOUTS = {
    "uneven": (2, 96, 3, [[40, 0, 33], [1, 70, 17]], [[3, 0, 5], [0, 2, 0]]),
    "full_rows": (2, 64, 2, [[64, 0], [31, 33]], [[0, 0], [0, 0]]),
}
HEAD_DIMS = [(32, 32), (128, 128)] if ON_GPU else [(32, 32)]
MASKS = {"padding": ("padding", (-1, -1)), "causal": ("padding_causal", (-1, 0)),
         "causal_bottom_right": ("padding_causal_bottom_right", (-1, 0)), "window": ("padding", (9, 4))}


def _packed(layout, h, hk, d, dv, dtype, seed=0):
    rows, s, m, lengths, gaps = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    total = rows * s
    q, k, v, do = (torch.randn(total, heads, width, generator=g).to(DEVICE, dtype)
                   for heads, width in ((h, d), (hk, d), (hk, dv), (h, dv)))
    starts, lens = [], []
    for r in range(rows):
        pos = r * s
        for n, gap in zip(lengths[r], gaps[r]):
            starts.append(pos)
            lens.append(n)
            pos += n + gap
        assert pos <= (r + 1) * s
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    seqs = kernel_runner.Sequences(rows * m, s, s, as_tensor(lens), as_tensor(lens), as_tensor(starts),
                                   as_tensor(starts))
    return (q, k, v, do), seqs, m


def _run(tensors, seqs, mask, window):
    q, k, v, do = tensors
    call = fused_call(QKVFormat.THD, mask, window, 0.3)
    out, lse = kernel_runner.forward(q, k, v, call, seqs=seqs)
    dq, dk, dv, _, _ = kernel_runner.backward(q, k, v, out, do, lse, call, seqs=seqs)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("layout,dims,masking,heads", grid(
    "layout,dims,masking,heads", ["uneven", "full_rows"], {f"d{d}": (d, dv) for d, dv in HEAD_DIMS}, MASKS,
    {"mha": (4, 4), "gqa": (4, 2)}))
def test_segment_rows_give_the_bits_of_the_sequence_grid(layout, dims, masking, heads):
    (d, dv), (mask, window) = dims, masking
    tensors, seqs, m = _packed(layout, *heads, d, dv, DTYPES[0])
    mask = AttnMaskType(mask)
    plain = _run(tensors, seqs, mask, window)
    rows = _run(tensors, dataclasses.replace(seqs, segments_per_row=m), mask, window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), plain[:1] + plain[2:], rows[:1] + rows[2:]):
        assert torch.equal(a, b), name
    for i, n in enumerate(seqs.len_q.tolist()):  # the LSE rows a sequence has (the rest are never written)
        assert torch.equal(plain[1][i, :, :n], rows[1][i, :, :n]), f"lse of sequence {i}"
    assert torch.isfinite(plain[0]).all()
    assert plain[2].abs().sum() > 0  # the comparison is not of zeros


def test_segment_rows_must_divide_the_sequences_and_be_packed():
    from transformer_engine.common.attention import launch_description

    (q, k, v, _), seqs, m = _packed("uneven", 2, 2, 16, 16, DTYPES[0])
    with pytest.raises(ValueError, match="`segments_per_row` must be a positive divisor"):
        kernel_runner.forward(q, k, v, fused_call(QKVFormat.THD, AttnMaskType.PADDING_MASK, (-1, -1), 0.3),
                              seqs=dataclasses.replace(seqs, segments_per_row=4))
    call = kernel_runner.describe(q, k, v, fused_call(), kernel_runner.Sequences(2, 8, 8, None, None, None, None),
                                  {}, (0, 0))
    with pytest.raises(ValueError, match="needs packed sequences with lengths"):
        dataclasses.replace(call, segments_per_row=2)
    assert launch_description.Call.grid_rows(dataclasses.replace(call, num_seqs=6, packed=True, has_seqlens=True,
                                                       segments_per_row=3), 96, 16, 4) == (6 + 2, 2 * 4)
