"""The Q/K head-dim split (BLOCK_DQK + BLOCK_DQK2: plan.split_head_dim) of the fused forward, dK/dV and dQ
kernels: against the fp64 reference and bitwise deterministic (repeats, batch composition, thd vs padded).

On a GPU the plan splits Hopper's narrow-V 192/128 (128 + 64) by itself; on the CPU the interpreter's plan
splits where NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK asks (set here), at d_qk = 48 = 32 + 16.
"""

from __future__ import annotations

import pytest
from case_grid import grid
import torch

from fused_helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    assert_close_to_reference,
    cu_from_lengths,
    make_qkv,
    ref_and_lowp,
    requires_fused,
    to_bshd,
    run_with_tiles,
)
from test_sink_softmax import SCALE as SINK_SCALE, sink_reference
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import forward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call
from te_torch_testing import recorded_launches
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

pytestmark = requires_fused

S = 256 if ON_GPU else 40
# (d_qk, d_v): the split's first chunk, then the second (d_qk - first).
DIMS = [(192, 128)] if ON_GPU else [(48, 32), (48, 48)]
SPLITS = {192: (128, 64), 48: (32, 16)}
# The pass of each kernel that may split: Triton's, and on Hopper the Gluon forward and dQ.
SPLIT_PASSES = {"attn_fwd_kernel": "fwd", "attn_fwd_ws_kernel": "fwd", "attn_bwd_dkdv_kernel": "dkdv",
                "attn_bwd_dq_kernel": "dq", "attn_bwd_dq_ws_kernel": "dq"}


def _gpu_plan_splits() -> bool:
    """Whether this GPU's plan splits 16-bit 192/128 (Hopper's narrow-V tiles, or another GPU forced to
    Hopper's plan)."""
    q, v = (torch.empty(1, 1, 1, d, dtype=torch.float16, device=DEVICE) for d in (192, 128))
    return forward_plan(kernel_runner.plan_key(q, q, v, fused_call())).block_dqk2 > 0


@pytest.fixture(autouse=True)
def split_kernels(monkeypatch):
    """Plans split Q/K under the interpreter; every launch is recorded (testing.recorded_launches), and each
    test checks that its forward, dK/dV and dQ launches did split."""
    if ON_GPU and not _gpu_plan_splits():
        pytest.skip("this GPU's plan does not split Q/K at 192/128 (Hopper's narrow-V tiles only)")
    monkeypatch.setenv("NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK", "1")
    with recorded_launches() as recorded:
        yield recorded


def _assert_split(recorded, d):
    seen = [x for described in recorded for x in described if x.name in SPLIT_PASSES]
    assert {SPLIT_PASSES[x.name] for x in seen} == {"fwd", "dkdv", "dq"}
    assert {(x.args["BLOCK_DQK"], x.args["BLOCK_DQK2"]) for x in seen} == {SPLITS[d]}


def _run(q, k, v, fmt, mask, window, scale, **kw):
    out = fused_attn_func(q, k, v, fmt, mask, window, scale, deterministic=True, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    return out, torch.autograd.grad(out, (q, k, v), d_out), d_out


def _check(q, k, v, out, grads, d_out, fmt, mask, window, scale, lens_q=None, lens_k=None):
    ref, lowp = ref_and_lowp(q, k, v, d_out, fmt, mask, window, scale, lens_q, lens_k)
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), [out] + list(grads), ref, lowp):
        assert_close_to_reference(name, to_bshd(ours, fmt), r, lp)


@pytest.mark.parametrize("dims,mask,heads", grid(
    "dims,mask,heads", {f"dqk{d[0]}_dv{d[1]}": d for d in DIMS}, ["no_mask", "causal"], {"mha": (4, 4), "gqa": (4, 2)}))
def test_split_matches_reference(split_kernels, dims, mask, heads):
    d, dv = dims
    q, k, v, _ = make_qkv(2, S + 3, S + 3, *heads, d, dv, DTYPES[0])
    out, grads, d_out = _run(q, k, v, "bshd", mask, (-1, -1), d ** -0.5)
    _check(q, k, v, out, grads, d_out, "bshd", mask, (-1, -1), d ** -0.5)
    _assert_split(split_kernels, d)


@pytest.mark.parametrize("sq,sk,mask,window", [
    (S, S + 17, "no_mask", (17, 5)),
    (S - 5, S + 12, "causal_bottom_right", (9, 0)),
    (S + 9, S - 13, "causal", (13, 0)),
])
def test_split_cross_attention_and_windows(split_kernels, sq, sk, mask, window):
    d, dv = DIMS[0]
    q, k, v, _ = make_qkv(2, sq, sk, 2, 1, d, dv, DTYPES[-1], seed=7)
    out, grads, d_out = _run(q, k, v, "bshd", mask, window, d ** -0.5)
    _check(q, k, v, out, grads, d_out, "bshd", mask, window, d ** -0.5)
    _assert_split(split_kernels, d)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_split_sink_softmax(split_kernels, softmax_type):
    """Sink softmax (the forward's extra logit; the learnable one's gradient) on the split kernels."""
    d, dv = DIMS[-1]
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(2, S, S, 4, 2, d, dv, dtype, seed=9)
    scale = SINK_SCALE  # sink_reference's
    offset = None
    sink64 = torch.zeros(4, dtype=torch.float64, device=DEVICE)
    if softmax_type == "learnable":
        offset = (torch.randn(4, generator=torch.Generator().manual_seed(3)) * 1.5).to(DEVICE).requires_grad_()
        sink64 = offset.detach().double()
    out = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), scale, deterministic=True,
                          softmax_type=softmax_type, softmax_offset=offset)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    leaves = [q, k, v] + ([offset] if offset is not None else [])
    grads = torch.autograd.grad(out, leaves, d_out)
    results = []
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in leaves]
        sink = ref_leaves[3] if offset is not None else sink64.to(ref_dtype)
        o = sink_reference(*ref_leaves[:3], sink, mask="causal", dtype=ref_dtype)
        results.append([o] + list(torch.autograd.grad(o, ref_leaves, d_out.to(ref_dtype))))
    for name, ours, ref, lowp in zip(("out", "dq", "dk", "dv", "d_softmax_offset"), [out] + list(grads), *results):
        assert_close_to_reference(name, ours, ref, lowp)
    _assert_split(split_kernels, d)


def test_split_repeats_and_batch_invariance_bitwise(split_kernels):
    """Repeated runs, and a sequence alone against inside a batch: bitwise the same outputs and gradients."""
    d, dv = DIMS[0]
    q, k, v, _ = make_qkv(3, S, S, 4, 2, d, dv, DTYPES[0], seed=3)
    out, grads, d_out = _run(q, k, v, "bshd", "causal", (-1, -1), 0.2)
    again = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.2, deterministic=True)
    assert torch.equal(again, out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, (q, k, v), d_out), grads))
    q1, k1, v1 = (t.detach()[1:2].clone().requires_grad_() for t in (q, k, v))
    out1 = fused_attn_func(q1, k1, v1, "bshd", "causal", (-1, -1), 0.2, deterministic=True)
    grads1 = torch.autograd.grad(out1, (q1, k1, v1), d_out[1:2])
    assert torch.equal(out1, out[1:2])
    for a, b in zip(grads1, grads):
        assert torch.equal(a, b[1:2])
    _assert_split(split_kernels, d)


@pytest.mark.parametrize("mask,gap", [("padding_causal", 3), ("padding", 0)])
def test_split_thd_against_reference_and_padded_bitwise(split_kernels, mask, gap):
    """Packed sequences (with gaps between them, GQA) equal the bshd-padded results bitwise and match the
    reference."""
    d, dv = DIMS[-1]
    dtype = DTYPES[0]
    lengths = [S // 2 + 3, 1, 0, S, 17]
    h, hk = 4, 2
    g = torch.Generator().manual_seed(5)
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    starts.append(pos)
    q, k, v = (torch.randn(pos, hh, dd, generator=g).to(DEVICE, dtype).requires_grad_()
               for hh, dd in ((h, d), (hk, d), (hk, dv)))
    cu = cu_from_lengths(lengths)
    cu_padded = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if gap else None
    max_s = max(lengths)
    out = fused_attn_func(q, k, v, "thd", mask, (-1, -1), d ** -0.5, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                          max_seqlen_q=max_s, max_seqlen_kv=max_s, deterministic=True)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    dq, dk, dvv = torch.autograd.grad(out, (q, k, v), d_out)

    def pad(t):
        p = torch.zeros(len(lengths), max_s, *t.shape[1:], dtype=t.dtype, device=DEVICE)
        for i, n in enumerate(lengths):
            p[i, :n] = t.detach()[starts[i]:starts[i] + n]
        return p.requires_grad_()

    qp, kp, vp, dop = pad(q), pad(k), pad(v), pad(d_out).detach()
    outp = fused_attn_func(qp, kp, vp, "bshd", mask, (-1, -1), d ** -0.5, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           deterministic=True)
    grads_p = torch.autograd.grad(outp, (qp, kp, vp), dop)
    for i, n in enumerate(lengths):
        rows = slice(starts[i], starts[i] + n)
        for packed, padded in zip((out, dq, dk, dvv), (outp,) + grads_p):
            assert torch.equal(packed[rows], padded[i, :n])
            assert torch.equal(padded[i, n:], torch.zeros_like(padded[i, n:]))
        if gap:
            between = slice(starts[i] + n, starts[i + 1])
            for t in (out, dq, dk, dvv):
                assert torch.equal(t[between], torch.zeros_like(t[between]))
    ref, lowp = ref_and_lowp(qp, kp, vp, dop, "bshd", mask, (-1, -1), d ** -0.5, lengths, lengths)
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), (outp,) + grads_p, ref, lowp):
        assert_close_to_reference(name, ours, r, lp)
    _assert_split(split_kernels, d)


@pytest.mark.parametrize("mask", ["padding_causal", "sliding_window"])
def test_split_loop_form_and_launch_order_change_no_result(split_kernels, mask):
    """Hopper's narrow-V dK/dV runs the split as one block loop (Tiles.single_loop): with head groups and
    either loop form the split kernels give the plain grid's bits (the GPU: within rounding of the
    instruction schedule between loop forms), with GQA over sequences of two lengths or a sliding window."""
    d, dv = DIMS[0]
    q, k, v, _ = make_qkv(2, S, S, 4, 2, d, dv, DTYPES[0], seed=5)
    q, k, v = (t.detach() for t in (q, k, v))
    d_out = torch.randn(*q.shape[:3], dv, generator=torch.Generator().manual_seed(2)).to(q.device, q.dtype)
    fmt, attn_mask, window, cu = QKVFormat.BSHD, AttnMaskType.PADDING_CAUSAL_MASK, (-1, 0), cu_from_lengths([S, S - 7])
    if mask == "sliding_window":
        attn_mask, window, cu = AttnMaskType.NO_MASK, (19, 5), None
    call = fused_call(fmt, attn_mask, window, 0.2, cu_seqlens_q=cu, cu_seqlens_kv=cu)

    def run(**variant):
        return run_with_tiles(q, k, v, d_out, call, **variant)

    results = {}
    for single_loop in (False, True):
        results[single_loop] = run(head_group=1, single_loop=single_loop)
        for a, b in zip(results[single_loop], run(head_group=3, single_loop=single_loop)):
            assert torch.equal(a, b)
    for a, b in zip(results[False], results[True]):
        if ON_GPU:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        else:
            assert torch.equal(a, b)
    _assert_split(split_kernels, d)


@pytest.mark.skipif(ON_GPU, reason="the GPU plans split 16-bit 192/128 only: no switch turns it off")
def test_split_and_unsplit_kernels_agree(monkeypatch):
    """The split changes only the order of the QK^T sum over the head dim: the unsplit kernels' results
    are within the same tolerance of the reference and close to the split ones."""
    d, dv = DIMS[0]
    q, k, v, _ = make_qkv(2, S, S, 2, 2, d, dv, torch.float32, seed=12)
    split = _run(q, k, v, "bshd", "causal", (-1, -1), d ** -0.5)
    monkeypatch.setenv("NVTE_FUSED_ATTN_INTERPRET_SPLIT_QK", "0")
    whole = _run(q, k, v, "bshd", "causal", (-1, -1), d ** -0.5)
    for a, b in zip([split[0]] + list(split[1]), [whole[0]] + list(whole[1])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
