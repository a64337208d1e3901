"""Fused Triton attention (forward + backward) against an fp64 reference, and its determinism.

On the CPU these run under the Triton interpreter (TRITON_INTERPRET=1) at small shapes and
fp16/fp32; on a GPU the same tests run at larger shapes with fp16/bf16.
"""

from __future__ import annotations

import math

import pytest
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
)

from transformer_engine.pytorch.attention import launch
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

pytestmark = requires_fused

S = 256 if ON_GPU else 40  # sequence lengths scale with the device
HEAD_DIMS = [(64, 64), (72, 72), (128, 128), (256, 256), (192, 128)] if ON_GPU else [(16, 16), (24, 32)]


def _run(q, k, v, leaves, fmt, mask, window, scale, deterministic=True, **kw):
    out = fused_attn_func(q, k, v, fmt, mask, window, scale, deterministic=deterministic, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads, d_out


def _check(q, k, v, out, grads, d_out, fmt, mask, window, scale, lens_q=None, lens_k=None):
    ref, lowp = ref_and_lowp(q, k, v, d_out, fmt, mask, window, scale, lens_q, lens_k)
    for name, ours, r, lp in zip(("out", "dq", "dk", "dv"), [out] + list(grads), ref, lowp):
        assert_close_to_reference(name, to_bshd(ours, fmt), r, lp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_formats_masks_heads(dtype, fmt, mask, heads):
    h, hk = heads
    q, k, v, _ = make_qkv(2, S + 3, S + 3, h, hk, 32 if not ON_GPU else 64, 32 if not ON_GPU else 64, dtype, fmt)
    scale = q.shape[-1] ** -0.5
    out, grads, d_out = _run(q, k, v, None, fmt, mask, (-1, -1), scale)
    _check(q, k, v, out, grads, d_out, fmt, mask, (-1, -1), scale)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"dqk{d[0]}_dv{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims(dims, dtype):
    dqk, dv = dims
    q, k, v, _ = make_qkv(1, S + 1, S + 1, 2, 1, dqk, dv, dtype)
    scale = 0.5 / math.sqrt(dqk)  # a non-default softmax scale
    out, grads, d_out = _run(q, k, v, None, "bshd", "causal", (-1, -1), scale)
    _check(q, k, v, out, grads, d_out, "bshd", "causal", (-1, -1), scale)


@pytest.mark.parametrize("packing", ["qkv", "kv"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_packed_layouts(packing, fmt):
    dtype = DTYPES[0]
    q, k, v, leaves = make_qkv(2, S, S, 2, 2, 32, 32, dtype, fmt, packing)
    out, grads, d_out = _run(q, k, v, leaves, fmt, "causal", (-1, -1), 32 ** -0.5)
    _check(q, k, v, out, grads, d_out, fmt, "causal", (-1, -1), 32 ** -0.5)


@pytest.mark.parametrize(
    "sq,sk,mask,window",
    [
        (S, S + 17, "no_mask", (-1, -1)),
        (S + 9, S - 13, "causal", (-1, -1)),
        (S - 11, S + 19, "causal_bottom_right", (-1, -1)),
        (S + 23, S - 7, "causal_bottom_right", (-1, -1)),  # first rows see no key: zeros, no NaN
        (S, S, "no_mask", (17, 5)),
        (S, S, "causal", (13, 0)),
        (S - 5, S + 12, "causal_bottom_right", (9, 0)),
        (S + 6, S, "no_mask", (0, 0)),
    ],
)
def test_cross_attention_and_windows(sq, sk, mask, window):
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(2, sq, sk, 2, 1, 32, 32, dtype)
    out, grads, d_out = _run(q, k, v, None, "bshd", mask, window, 32 ** -0.5)
    _check(q, k, v, out, grads, d_out, "bshd", mask, window, 32 ** -0.5)


def test_rows_without_keys_are_zero():
    dtype = DTYPES[0]
    sq, sk = S + 10, S - 10
    q, k, v, _ = make_qkv(1, sq, sk, 2, 2, 32, 32, dtype)
    out, (dq, dk, dv), _ = _run(q, k, v, None, "bshd", "causal_bottom_right", (-1, -1), 32 ** -0.5)
    blind = sq - sk  # bottom-right: the first sq - sk rows see nothing
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    assert torch.equal(dq[:, :blind], torch.zeros_like(dq[:, :blind]))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


def test_deterministic_repeats_bitwise():
    """dQ/dK/dV bitwise equal over repeated runs, several key blocks per query block."""
    runs = 100 if ON_GPU else 5
    s = 2048 if ON_GPU else 64
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    q, k, v, _ = make_qkv(2, s, s, 4, 2, 64 if ON_GPU else 16, 64 if ON_GPU else 16, dtype)
    first = None
    for _ in range(runs):
        out, grads, _ = _run(q, k, v, None, "bshd", "causal", (-1, -1), 0.125)
        if first is None:
            first = (out, grads)
            continue
        assert torch.equal(out, first[0])
        for a, b in zip(grads, first[1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_batch_invariance(mask):
    """A sequence's outputs and gradients are bitwise the same alone and inside a larger batch."""
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(3, S, S, 4, 2, 32, 32, dtype, seed=3)
    out, grads, d_out = _run(q, k, v, None, "bshd", mask, (-1, -1), 0.2)
    q1, k1, v1 = (t.detach()[1:2].clone().requires_grad_() for t in (q, k, v))
    out1 = fused_attn_func(q1, k1, v1, "bshd", mask, (-1, -1), 0.2, deterministic=True)
    grads1 = torch.autograd.grad(out1, (q1, k1, v1), d_out[1:2])
    assert torch.equal(out1, out[1:2])
    for a, b in zip(grads1, grads):
        assert torch.equal(a, b[1:2])


def _thd_inputs(lengths, h, hk, d, dtype, gap=0, seed=5):
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    starts.append(pos)
    total = pos
    def rnd(hh):
        return torch.randn(total, hh, d, generator=g).to(DEVICE, dtype).requires_grad_()
    q, k, v = rnd(h), rnd(hk), rnd(hk)
    cu = cu_from_lengths(lengths)
    cu_padded = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if gap else None
    return q, k, v, cu, cu_padded, starts


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("gap", [0, 3])
def test_thd_against_reference_and_padded_bitwise(mask, gap):
    """THD results match the reference and equal the BSHD-padded results bitwise, sequence by sequence."""
    dtype = DTYPES[0]
    lengths = [S // 2 + 3, 1, 0, S, 17]
    h, hk, d = 4, 2, 32
    q, k, v, cu, cu_padded, starts = _thd_inputs(lengths, h, hk, d, dtype, gap)
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


def test_thd_cross_attention_gqa():
    dtype = DTYPES[0]
    lq, lk = [S // 3, 5, S // 2], [S // 2 + 1, 9, S // 4]
    h, hk, d = 4, 1, 32
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lq), h, d, generator=g).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(sum(lk), hk, d, generator=g).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(sum(lk), hk, d, generator=g).to(DEVICE, dtype).requires_grad_()
    cq, ck = cu_from_lengths(lq), cu_from_lengths(lk)
    out = fused_attn_func(q, k, v, "thd", "padding_causal_bottom_right", (-1, -1), d ** -0.5,
                          cu_seqlens_q=cq, cu_seqlens_kv=ck, deterministic=True)
    d_out = torch.randn(out.shape, generator=g).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    for i in range(len(lq)):
        sq_, sk_ = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        qi, ki, vi = (t.detach()[s].unsqueeze(0) for t, s in ((q, sq_), (k, sk_), (v, sk_)))
        ref, lowp = ref_and_lowp(qi, ki, vi, d_out[sq_].unsqueeze(0), "bshd", "causal_bottom_right", (-1, -1),
                                 d ** -0.5)
        for name, ours, r, lp in zip(("out", "dq"), (out[sq_], grads[0][sq_]), ref, lowp):
            assert_close_to_reference(name, ours.unsqueeze(0), r, lp)
        for name, ours, r, lp in zip(("dk", "dv"), (grads[1][sk_], grads[2][sk_]), ref[2:], lowp[2:]):
            assert_close_to_reference(name, ours.unsqueeze(0), r, lp)


def test_nondeterministic_mode_matches_reference():
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(2, S, S, 4, 2, 32, 32, dtype)
    out, grads, d_out = _run(q, k, v, None, "bshd", "causal", (-1, -1), 32 ** -0.5, deterministic=False)
    _check(q, k, v, out, grads, d_out, "bshd", "causal", (-1, -1), 32 ** -0.5)


class _KernelSpy:
    """Wraps a Triton kernel; records the constexpr flags of each launch."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        launcher = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append(kwargs)
            return launcher(*args, **kwargs)

        return run


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_backward_never_launches_atomic_dq(monkeypatch, deterministic):
    calls = []
    monkeypatch.setattr(launch, "attn_bwd_dkdv_kernel", _KernelSpy(launch.attn_bwd_dkdv_kernel, calls))
    dq_calls = []
    monkeypatch.setattr(launch, "attn_bwd_dq_kernel", _KernelSpy(launch.attn_bwd_dq_kernel, dq_calls))
    q, k, v, _ = make_qkv(1, S, S, 2, 2, 32, 32, DTYPES[0])
    _run(q, k, v, None, "bshd", "causal", (-1, -1), 0.2, deterministic=deterministic)
    assert len(calls) == 1
    if deterministic:
        assert calls[0]["ATOMIC_DQ"] is False
        assert len(dq_calls) == 1
    else:
        assert calls[0]["ATOMIC_DQ"] == (len(dq_calls) == 0)


@pytest.mark.skipif(not ON_GPU, reason="long sequences need a GPU")
@pytest.mark.parametrize("s", [8192, 16384])
def test_long_sequence_numerics(s):
    """Numerical check at long lengths; the fp64 reference is computed in query chunks."""
    from attention_reference import reference_attention
    dtype = torch.bfloat16
    q, k, v, _ = make_qkv(1, s, s, 2, 1, 128, 128, dtype)
    out = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 128 ** -0.5, deterministic=True)
    chunk = 2048
    worst, worst_lowp = 0.0, 0.0
    for c in range(0, s, chunk):
        # Rows c..c+chunk see keys < c+chunk (causal): reference on that slice with a bottom-right shift.
        qs = q.detach()[:, c:c + chunk]
        ks, vs = k.detach()[:, :c + chunk], v.detach()[:, :c + chunk]
        ref = reference_attention(qs, ks, vs, "causal_bottom_right", scale=128 ** -0.5)
        lowp = reference_attention(qs, ks, vs, "causal_bottom_right", scale=128 ** -0.5, dtype=dtype)
        worst = max(worst, (out[:, c:c + chunk].double() - ref).abs().max().item())
        worst_lowp = max(worst_lowp, (lowp.double() - ref).abs().max().item())
    assert worst <= 2 * worst_lowp + 1e-3, (worst, worst_lowp)
