"""Shared plumbing for the fused-kernel tests: device choice, tensors in every layout, tolerances."""

from __future__ import annotations

import torch

from dpa_helpers import (  # noqa: F401  (re-exported for the fused-kernel tests)
    DEVICE,
    INTERPRET,
    ON_GPU,
    assert_close_to_reference,
    cu_seqlens as cu_from_lengths,
    reference,
    requires_fused,
    to_bshd,
)

# The interpreter computes tl.dot on bfloat16 wrongly: bf16 is tested on the GPU only.
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]


def make_qkv(b, sq, sk, h, hk, d, dv, dtype, fmt="bshd", packing="separate", seed=0):
    """q, k, v (leaf tensors for grads are the returned ``leaves``) in ``fmt`` with ``packing``."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    def order(t):  # t is [b, s, ...]
        return t.transpose(0, 1).contiguous() if fmt == "sbhd" else t

    if packing == "qkv":
        assert sq == sk and h == hk and d == dv
        base = order(rnd(b, sq, 3, h, d)).requires_grad_()
        q, k, v = base.unbind(2)
        return q, k, v, [base]
    if packing == "kv":
        assert d == dv
        q = order(rnd(b, sq, h, d)).requires_grad_()
        kv = order(rnd(b, sk, 2, hk, d)).requires_grad_()
        k, v = kv.unbind(2)
        return q, k, v, [q, kv]
    q = order(rnd(b, sq, h, d)).requires_grad_()
    k = order(rnd(b, sk, hk, d)).requires_grad_()
    v = order(rnd(b, sk, hk, dv)).requires_grad_()
    return q, k, v, [q, k, v]


def ref_and_lowp(q, k, v, d_out, fmt, mask, window, scale, lens_q=None, lens_k=None):
    """(fp64 reference out+grads, same math in the inputs' dtype) for tolerance judgement."""
    results = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (to_bshd(t.detach(), fmt).to(dtype).requires_grad_() for t in (q, k, v))
        o = reference(qr, kr, vr, mask, window, scale, lens_q, lens_k, dtype=dtype)
        grads = torch.autograd.grad(o, (qr, kr, vr), to_bshd(d_out, fmt).to(dtype))
        results.append([o] + list(grads))
    return results


def run_with_tiles(q, k, v, d_out, call, **fields):
    """(out, lse, dq, dk, dv) of the planned kernels of ``call`` (testing.fused_call) with these Tiles fields
    (e.g. head_group, single_loop) changed in the forward, dK/dV and dQ tiles."""
    import dataclasses

    from transformer_engine.common.attention.plan import backward_plan, forward_plan
    from transformer_engine.pytorch.attention import kernel_runner

    key = kernel_runner.plan_key(q, k, v, call)
    fwd, bwd = forward_plan(key), backward_plan(key)
    fwd = dataclasses.replace(fwd, tiles=dataclasses.replace(fwd.tiles, **fields))
    bwd = dataclasses.replace(bwd, dkdv=dataclasses.replace(bwd.dkdv, **fields),
                              dq=dataclasses.replace(bwd.dq, **fields))
    out, lse = kernel_runner.forward(q, k, v, call, fwd)
    grads = kernel_runner.backward(q, k, v, out, d_out, lse, call, bwd)[:3]
    return (out, lse) + tuple(grads)
