"""Shared plumbing for the fused-kernel tests: device choice, tensors in every layout, tolerances."""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import pytest
import torch

from attention_reference import reference_attention

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"

requires_fused = pytest.mark.skipif(
    not ON_GPU and not INTERPRET,
    reason="fused kernels need a GPU, or TRITON_INTERPRET=1 set before triton is imported (CPU interpreter)",
)

# The interpreter computes tl.dot on bfloat16 wrongly (DESIGN.md): bf16 is tested on the GPU only.
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


def to_bshd(t, fmt):
    return t.transpose(0, 1) if fmt == "sbhd" else t


def ref_and_lowp(q, k, v, d_out, fmt, mask, window, scale, lens_q=None, lens_k=None):
    """(fp64 reference out+grads, same math in the inputs' dtype) for tolerance judgement."""
    results = []
    for dtype in (torch.float64, q.dtype):
        qr, kr, vr = (to_bshd(t.detach(), fmt).to(dtype).requires_grad_() for t in (q, k, v))
        o = reference_attention(qr, kr, vr, mask, window, scale, lens_q, lens_k, dtype=dtype)
        grads = torch.autograd.grad(o, (qr, kr, vr), to_bshd(d_out, fmt).to(dtype))
        results.append([o] + list(grads))
    return results


def assert_close_to_reference(name: str, ours: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
                              factor: float = 2.0):
    """Our error vs fp64 must be within ``factor`` x PyTorch's own low-precision error (+ tiny atol)."""
    ours64 = ours.to(torch.float64)
    assert torch.isfinite(ours64).all(), f"{name}: non-finite values"
    err = (ours64 - ref).abs().max().item()
    base = (lowp.to(torch.float64) - ref).abs().max().item()
    atol = 1e-5 if ours.dtype == torch.float32 else 1e-3
    assert err <= factor * base + atol, f"{name}: max error {err:.3e} > {factor} x torch's {base:.3e} + {atol}"


def cu_from_lengths(lengths: Sequence[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)
