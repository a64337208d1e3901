"""Fused Triton attention (forward + backward) against an fp64 reference, and its determinism.

On the CPU these run under the Triton interpreter (TRITON_INTERPRET=1) at small shapes and
fp16/fp32; on a GPU the same tests run at larger shapes with fp16/bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from case_grid import grid

from fused_helpers import (
    reference,
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


@pytest.mark.parametrize("dtype,fmt,mask,heads", grid(
    "dtype,fmt,mask,heads", {str(t).split(".")[-1]: t for t in DTYPES}, ["bshd", "sbhd"], ["no_mask", "causal"],
    {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}))
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


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"dqk{d[0]}_dv{d[1]}")
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("mask", ["no_mask", "causal_bottom_right"])
def test_illegal_address_at_short_query_length(dims, sq, mask):
    """Regression: s_q = 1 against long keys (decoding-style calls; TransformerEngine's base_3_1 row)
    faulted in the d=256 dQ kernel on the H200. Every head-dim bucket, forward and backward."""
    dqk, dv = dims
    sk = 2048 if ON_GPU else 37
    q, k, v, _ = make_qkv(2, sq, sk, 2, 2, dqk, dv, DTYPES[-1])
    scale = dqk ** -0.5
    out, grads, d_out = _run(q, k, v, None, "bshd", mask, (-1, -1), scale)
    _check(q, k, v, out, grads, d_out, "bshd", mask, (-1, -1), scale)


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


@pytest.mark.skipif(not ON_GPU, reason="long sequences need a GPU")
@pytest.mark.parametrize("s", [8192, 16384])
def test_long_sequence_numerics(s):
    """Numerical check at long lengths; the fp64 reference is computed in query chunks."""
    dtype = torch.bfloat16
    q, k, v, _ = make_qkv(1, s, s, 2, 1, 128, 128, dtype)
    out = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 128 ** -0.5, deterministic=True)
    chunk = 2048
    worst, worst_lowp = 0.0, 0.0
    for c in range(0, s, chunk):
        # Rows c..c+chunk see keys < c+chunk (causal): reference on that slice with a bottom-right shift.
        qs = q.detach()[:, c:c + chunk]
        ks, vs = k.detach()[:, :c + chunk], v.detach()[:, :c + chunk]
        ref = reference(qs, ks, vs, "causal_bottom_right", scale=128 ** -0.5)
        lowp = reference(qs, ks, vs, "causal_bottom_right", scale=128 ** -0.5, dtype=dtype)
        worst = max(worst, (out[:, c:c + chunk].double() - ref).abs().max().item())
        worst_lowp = max(worst_lowp, (lowp.double() - ref).abs().max().item())
    assert worst <= 2 * worst_lowp + 1e-3, (worst, worst_lowp)
