"""dK and dV as two passes (plan.BackwardPlan.dv): the dK pass and the dV pass of attn_bwd_dkdv_kernel give the
single pass's gradients, bitwise where both passes use its tiles, and match the fp64 reference with wider dV
tiles; repeated runs are bitwise the same. Masks, sliding windows, GQA, dropout, packed sequences with gaps.

Runs under the Triton interpreter here and on the GPU in qa/L1.
"""

from __future__ import annotations

import dataclasses

import pytest
from case_grid import grid
import torch

from fused_helpers import DEVICE, DTYPES, ON_GPU, assert_close_to_reference, make_qkv, ref_and_lowp, requires_fused
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import Tiles, _head_key, backward_plan, plan_arch
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.fused_attn import new_rng_state
from transformer_engine.pytorch.attention.call import fused_call
from te_torch_testing import recorded_launches

pytestmark = requires_fused

D = [(64, 64), (256, 256)] if ON_GPU else [(32, 32)]
# (mask, window): causal, a sliding window, none
MASKS = [("causal", (-1, 0)), ("no_mask", (9, 4)), ("no_mask", (-1, -1))]


def _call(fmt, mask, window, **kwargs):
    return fused_call(fmt, mask, window, 0.3, **kwargs)


def _backward(tensors, call, plan=None, seqs=None):
    q, k, v, do = tensors
    out, lse = kernel_runner.forward(q, k, v, call, seqs=seqs)
    return (out,) + kernel_runner.backward(q, k, v, out, do, lse, call, plan, seqs=seqs)[:3]


def _inputs(d, dv, dtype, heads=(4, 2), sq=45, sk=53, seed=0):
    q, k, v, _ = make_qkv(2, sq, sk, *heads, d, dv, dtype, seed=seed)
    q, k, v = (t.detach() for t in (q, k, v))
    do = torch.randn(2, sq, heads[0], dv, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    return q, k, v, do


def _plans(tensors, call, dv_tiles=None):
    q, k, v, _ = tensors
    config = kernel_runner.plan_key(q, k, v, call)
    one = backward_plan(config)
    if one.dv is not None:  # planned as two passes (Hopper at d=256): the dK/dV table's one pass instead
        one = dataclasses.replace(one, dkdv=plan_arch(config).dkdv[_head_key(config)], dv=None)
    # The Triton kernel on both sides (the Gluon dK/dV passes serve Hopper: not what is compared).
    one = dataclasses.replace(one, dkdv_warp_specialized=None, dv_warp_specialized=None)
    return one, dataclasses.replace(one, dv=dv_tiles or one.dkdv)


def _assert_repeats_and_matches_reference(tensors, mask, window, plan):
    """Bitwise the same on a second run, and as close to the fp64 reference as the same math in the inputs'
    dtype."""
    call = _call(QKVFormat.BSHD, mask, window)
    a = _backward(tensors, call, plan)
    again = _backward(tensors, call, plan)
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, again):
        assert torch.equal(x, y), name
    ref, lowp = ref_and_lowp(*tensors[:3], tensors[3], "bshd", mask.value, window, 0.3)
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), a, ref, lowp):
        assert_close_to_reference(name, ours, r, lp)


@pytest.mark.parametrize("dims,masking,heads", grid(
    "dims,masking,heads", {f"d{d}_dv{dv}": (d, dv) for d, dv in D},
    {"causal": MASKS[0], "window": MASKS[1], "no_mask": MASKS[2]}, {"mha": (4, 4), "gqa": (4, 2)}))
def test_two_passes_give_the_single_pass_bits(dims, masking, heads):
    (d, dv), (mask, window) = dims, masking
    tensors = _inputs(d, dv, DTYPES[0], heads)
    call = _call(QKVFormat.BSHD, mask, window)
    one, two = _plans(tensors, call)
    a = _backward(tensors, call, one)
    b = _backward(tensors, call, two)
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name
    assert a[3].abs().sum() > 0 and a[2].abs().sum() > 0  # not a comparison of zeros


def test_dropout_two_passes_give_the_single_pass_bits():
    d, dv = D[0]
    tensors = _inputs(d, dv, DTYPES[0])
    q = tensors[0]
    call = _call(QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, (-1, 0), dropout_p=0.2, rng_state=new_rng_state(q.device))
    one, two = _plans(tensors, call)
    a = _backward(tensors, call, one)
    b = _backward(tensors, call, two)
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name


def test_packed_sequences_with_gaps():
    d, dv = D[0]
    dtype = DTYPES[0]
    lengths, gap = [29, 1, 0, 40, 7], 3
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n + gap)
    total = starts[-1]
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(total, hh, dd, generator=g).to(DEVICE, dtype)
                   for hh, dd in ((4, d), (2, d), (2, dv), (4, dv)))
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    seqs = kernel_runner.Sequences(len(lengths), max(lengths), max(lengths), as_tensor(lengths), as_tensor(lengths),
                            as_tensor(starts[:-1]), as_tensor(starts[:-1]))
    call = _call(QKVFormat.THD, AttnMaskType.PADDING_CAUSAL_MASK, (-1, 0))
    one, two = _plans((q, k, v, do), call)
    a = _backward((q, k, v, do), call, one, seqs)
    b = _backward((q, k, v, do), call, two, seqs)
    for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name
    assert a[3].abs().sum() > 0


@pytest.mark.parametrize("mask,window", MASKS[:2])
def test_wider_dv_tiles_match_the_reference_and_repeat_bitwise(mask, window):
    """The dV pass with twice the dK pass's keys per program: close to the fp64 reference (as close as the
    same math in the inputs' dtype), and the same bits on a second run."""
    d, dv = D[-1]
    tensors = _inputs(d, dv, DTYPES[0])
    mask = AttnMaskType(mask)
    one, _ = _plans(tensors, _call(QKVFormat.BSHD, mask, window))
    t = one.dkdv
    wide = dataclasses.replace(t, block_n=2 * t.block_n)
    _, two = _plans(tensors, _call(QKVFormat.BSHD, mask, window), wide)
    _assert_repeats_and_matches_reference(tensors, mask, window, two)


def test_launches_of_the_two_passes():
    """Two dK/dV launches, the first writing dK only and the second dV only, each with its tiles' grid."""
    tensors = _inputs(*D[0], DTYPES[0], sk=260 if ON_GPU else 53)  # more key blocks of dK's tiles than dV's
    k = tensors[1]
    call = _call(QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, (-1, 0))
    one, two = _plans(tensors, call)
    two = dataclasses.replace(two, dv=Tiles(two.dkdv.block_m, 2 * two.dkdv.block_n, two.dkdv.num_warps, 1))
    with recorded_launches() as recorded:
        _backward(tensors, call, one)
        _backward(tensors, call, two)
    described = recorded[1::2]  # each run's backward (its forward first)
    passes = [[(x.args["WITH_DK"], x.args["WITH_DV"], x.args["BLOCK_N"], x.grid) for x in run
               if x.name == "attn_bwd_dkdv_kernel"] for run in described]
    blocks = lambda n: -(-k.shape[1] // n)  # noqa: E731
    assert [p[:3] for p in passes[0]] == [(True, True, one.dkdv.block_n)]
    assert [p[:3] for p in passes[1]] == [(True, False, two.dkdv.block_n), (False, True, two.dv.block_n)]
    assert passes[1][1][3][0] == blocks(two.dv.block_n) < passes[1][0][3][0] == blocks(two.dkdv.block_n)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS[:2])
def test_gluon_one_gradient_passes_match_the_reference_and_repeat_bitwise(d, mask, window):
    """The warp-specialized dK/dV kernel as a dK pass and a dV pass (one accumulator per consumer; the plan
    at d=256, the one-pass tiles twice at d=128): close to the fp64 reference, and bitwise the same on a
    second run."""
    tensors = _inputs(d, d, torch.bfloat16, (4, 2), sq=300, sk=300)
    q, k, v, _ = tensors
    mask = AttnMaskType(mask)
    one = backward_plan(kernel_runner.plan_key(q, k, v, _call(QKVFormat.BSHD, mask, window)))
    if one.dkdv_warp_specialized is None:
        pytest.skip("no Gluon dK/dV kernel on this GPU's plan (NVTE_FUSED_ATTN_WS=0 or a forced plan)")
    two = one if one.dv is not None else dataclasses.replace(
        one, dv=one.dkdv, dv_warp_specialized=one.dkdv_warp_specialized)
    assert two.dv_warp_specialized is not None
    _assert_repeats_and_matches_reference(tensors, mask, window, two)
