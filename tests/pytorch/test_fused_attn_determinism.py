"""Determinism contract of the fused kernels: repeated runs, batch composition and
packing (thd vs padded) give bitwise identical outputs and gradients; the deterministic
backward never launches the atomic-dQ variant. Runs in qa/L3_determinism on the GPU and in
L0 under the Triton interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from case_grid import grid

from fused_helpers import (
    DEVICE,
    DTYPES,
    ON_GPU,
    assert_close_to_reference,
    cu_from_lengths,
    make_qkv,
    ref_and_lowp,
    requires_fused,
    run_with_tiles,
)
from transformer_engine.common import settings
from transformer_engine.common.attention import AttnMaskType, QKVFormat
from transformer_engine.common.attention.plan import backward_plan, forward_plan
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import fused_call
from te_torch_testing import recorded_launches
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

pytestmark = requires_fused

S = 256 if ON_GPU else 40
# (d_qk, d_v). d=128 runs the warp-specialized Gluon forward, dK/dV and dQ on Hopper (kernels/hopper_ws.py), d=32
# and 192/128 (Hopper's narrow-V tiles) the Triton kernels; the interpreter runs Triton only.
HEAD_DIMS = [(32, 32), (128, 128), (192, 128)] if ON_GPU else [(32, 32)]


def _run(q, k, v, fmt, mask, window, scale, deterministic=True, **kw):
    out = fused_attn_func(q, k, v, fmt, mask, window, scale, deterministic=deterministic, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads, d_out


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128)] if ON_GPU else [(16, 16)])
def test_deterministic_repeats_bitwise(d, dv):
    """dQ/dK/dV bitwise equal over repeated runs, several key blocks per query block."""
    runs = 100 if ON_GPU else 5
    s = 2048 if ON_GPU else 64
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v, _ = make_qkv(2, s, s, 4, 2, d, dv, dtype)
    first = None
    for _ in range(runs):
        out, grads, _ = _run(q, k, v, "bshd", "causal", (-1, -1), 0.125)
        if first is None:
            first = (out, grads)
            continue
        assert torch.equal(out, first[0])
        for a, b in zip(grads, first[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("d,dv", HEAD_DIMS)
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_batch_invariance(mask, d, dv):
    """A sequence's outputs and gradients are bitwise the same alone and inside a larger batch."""
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(3, S, S, 4, 2, d, dv, dtype, seed=3)
    out, grads, d_out = _run(q, k, v, "bshd", mask, (-1, -1), 0.2)
    q1, k1, v1 = (t.detach()[1:2].clone().requires_grad_() for t in (q, k, v))
    out1 = fused_attn_func(q1, k1, v1, "bshd", mask, (-1, -1), 0.2, deterministic=True)
    grads1 = torch.autograd.grad(out1, (q1, k1, v1), d_out[1:2])
    assert torch.equal(out1, out[1:2])
    for a, b in zip(grads1, grads):
        assert torch.equal(a, b[1:2])


def _thd_inputs(lengths, h, hk, d, dv, dtype, gap=0, seed=5):
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    starts.append(pos)
    total = pos
    def rnd(hh, dd):
        return torch.randn(total, hh, dd, generator=g).to(DEVICE, dtype).requires_grad_()
    q, k, v = rnd(h, d), rnd(hk, d), rnd(hk, dv)
    cu = cu_from_lengths(lengths)
    cu_padded = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if gap else None
    return q, k, v, cu, cu_padded, starts


@pytest.mark.parametrize("mask,gap,dims", grid(
    "mask,gap,dims", ["padding_causal", "padding", "padding_causal_bottom_right"], [3, 0],
    {f"d{d}_dv{dv}": (d, dv) for d, dv in HEAD_DIMS}))
def test_thd_against_reference_and_padded_bitwise(mask, gap, dims):
    """THD results match the reference and equal the BSHD-padded results bitwise, sequence by sequence."""
    d, dv = dims
    dtype = DTYPES[0]
    lengths = [S // 2 + 3, 1, 0, S, 17]
    h, hk = 4, 2
    q, k, v, cu, cu_padded, starts = _thd_inputs(lengths, h, hk, d, dv, dtype, gap)
    max_s = max(lengths)
    out = fused_attn_func(q, k, v, "thd", mask, (-1, -1), d ** -0.5, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                          max_seqlen_q=max_s, max_seqlen_kv=max_s, deterministic=True)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)

    # The same sequences, padded into bshd with per-sequence lengths.
    b = len(lengths)
    def pad(t):
        p = torch.zeros(b, max_s, *t.shape[1:], dtype=t.dtype, device=DEVICE)
        for i, n in enumerate(lengths):
            p[i, :n] = t.detach()[starts[i]:starts[i] + n]
        return p.requires_grad_()
    qp, kp, vp, dop = pad(q), pad(k), pad(v), pad(d_out).detach()
    outp = fused_attn_func(qp, kp, vp, "bshd", mask, (-1, -1), d ** -0.5, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           deterministic=True)
    dqp, dkp, dvp = torch.autograd.grad(outp, (qp, kp, vp), dop)
    for i, n in enumerate(lengths):
        sl = slice(starts[i], starts[i] + n)
        assert torch.equal(out[sl], outp[i, :n])
        assert torch.equal(dq[sl], dqp[i, :n])
        assert torch.equal(dk[sl], dkp[i, :n])
        assert torch.equal(dv[sl], dvp[i, :n])
        # Padded positions are zero in bshd outputs and gradients.
        for t in (outp, dqp, dkp, dvp):
            assert torch.equal(t[i, n:], torch.zeros_like(t[i, n:]))
    if gap:
        for i, n in enumerate(lengths):
            gap_rows = slice(starts[i] + n, starts[i + 1])
            for t in (out, dq, dk, dv):
                assert torch.equal(t[gap_rows], torch.zeros_like(t[gap_rows]))

    lens = lengths
    ref, lowp = ref_and_lowp(qp, kp, vp, dop, "bshd", mask, (-1, -1), d ** -0.5, lens, lens)
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), (outp, dqp, dkp, dvp), ref, lowp):
        assert_close_to_reference(name, ours, r, lp)


@pytest.fixture
def launches():
    """The kernel runner's launches while the test runs (testing.recorded_launches)."""
    with recorded_launches() as recorded:
        yield recorded


def _names(recorded):
    """Names of the recorded kernels, in launch order."""
    return [x.name for described in recorded for x in described]


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_runs_a_separate_dq_pass_in_both_modes(launches, deterministic):
    """No atomic dQ exists: both modes launch the preprocess, dK/dV and dQ passes."""
    q, k, v, _ = make_qkv(1, S, S, 2, 2, 32, 32, DTYPES[0])
    _run(q, k, v, "bshd", "causal", (-1, -1), 0.2, deterministic=deterministic)
    assert _names(launches) == ["attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                                "attn_bwd_dq_kernel"]


@pytest.mark.parametrize("mask", ["causal", "padding_causal", "sliding_window"])
def test_launch_order_and_loop_form_change_no_result(mask):
    """Grouping heads in the launch order (Tiles.head_group, kernels/masking.py grid_program) only
    reorders programs: every output and gradient is bitwise the one of the plain grid, also when the
    group size divides neither the query heads (10 = 2 x 5) nor the kv heads (2 x 1). The block loop
    run as one loop that masks per block (Tiles.single_loop) or as three loops does the same sums in
    the same order: bitwise equal under the interpreter, within rounding of the instruction schedule
    on the GPU."""
    q, k, v, _ = make_qkv(2, S, S, 5, 1, 32, 32, DTYPES[0], seed=5)
    q, k, v = (t.detach() for t in (q, k, v))
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.device, q.dtype)
    fmt, attn_mask, window = QKVFormat.BSHD, AttnMaskType.CAUSAL_MASK, (-1, 0)
    cu_seqlens = None
    if mask == "padding_causal":
        attn_mask = AttnMaskType.PADDING_CAUSAL_MASK
        cu_seqlens = cu_from_lengths([S, S - 7])
    if mask == "sliding_window":
        attn_mask, window = AttnMaskType.NO_MASK, (19, 5)
    call = fused_call(fmt, attn_mask, window, 0.2, cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)

    def run(**variant):
        return run_with_tiles(q, k, v, d_out, call, **variant)

    for single_loop in (False, True):
        plain = run(head_group=1, single_loop=single_loop)
        for a, b in zip(plain, run(head_group=3, single_loop=single_loop)):
            assert torch.equal(a, b)
    segmented = run(single_loop=False)
    for a, b in zip(segmented, plain):
        if ON_GPU:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        else:
            assert torch.equal(a, b)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="Hopper GPU only")
@pytest.mark.skipif(settings.get("NVTE_FUSED_ATTN_PLAN_ARCH") not in ("", "sm90"),
                    reason="NVTE_FUSED_ATTN_PLAN_ARCH forces another architecture's plan (Triton kernels only)")
@pytest.mark.parametrize("mask,window", [("causal", (-1, 0)), ("no_mask", (-1, -1)), ("no_mask", (40, 9))])
def test_warp_specialized_kernels_serve_d128(launches, mask, window):
    """At d=128 the plan runs the Gluon forward, dK/dV and dQ (kernels/hopper_ws.py): they are launched, their
    results are as close to the fp32 reference as the Triton kernels' (NVTE_FUSED_ATTN_WS=0), and the
    head-grouped launch order changes no bit."""
    q, k, v, _ = make_qkv(2, 700, 700, 4, 2, 128, 128, torch.bfloat16, seed=11)
    out, grads, d_out = _run(q, k, v, "bshd", mask, window, 128 ** -0.5)
    ws = ["attn_fwd_ws_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_ws_kernel", "attn_bwd_dq_ws_kernel"]
    assert _names(launches) == ws
    with settings.environment(NVTE_FUSED_ATTN_WS="0"):
        out_t, grads_t, _ = _run(q, k, v, "bshd", mask, window, 128 ** -0.5)
    assert _names(launches)[4:] == [n.replace("_ws", "") for n in ws]  # the Triton kernels ran
    ref, lowp = ref_and_lowp(q, k, v, d_out, "bshd", mask, window, 128 ** -0.5)
    for name, ours, triton_ours, r, lp in zip(("out", "dq", "dk", "dv"), (out,) + grads, (out_t,) + grads_t, ref,
                                              lowp):
        assert_close_to_reference(name, ours, r, lp)
        assert_close_to_reference(name, triton_ours, r, lp)

    fmt = QKVFormat.BSHD
    attn_mask = AttnMaskType.CAUSAL_MASK if mask == "causal" else AttnMaskType.NO_MASK
    q, k, v = (t.detach() for t in (q, k, v))
    call = fused_call(fmt, attn_mask, window, 0.1)
    cfg = kernel_runner.plan_key(q, k, v, call)

    def run(head_group):
        fwd, bwd = forward_plan(cfg), backward_plan(cfg)
        fwd = dataclasses.replace(fwd, warp_specialized=dataclasses.replace(fwd.warp_specialized,
                                                                            head_group=head_group))
        bwd = dataclasses.replace(bwd, dq_warp_specialized=dataclasses.replace(bwd.dq_warp_specialized,
                                                                               head_group=head_group),
                                  dkdv_warp_specialized=dataclasses.replace(bwd.dkdv_warp_specialized,
                                                                            head_group=head_group))
        o, lse = kernel_runner.forward(q, k, v, call, fwd)
        return (o, lse) + tuple(kernel_runner.backward(q, k, v, o, d_out, lse, call, bwd)[:3])

    for a, b in zip(run(1), run(3)):
        assert torch.equal(a, b)
