"""Fused attention beyond plain masks: post-scale bias (+dBias), ALiBi, dropout, bad input.

CPU: Triton interpreter at small shapes, fp16/fp32; GPU: the same tests, fp16/bf16.
"""

from __future__ import annotations

import pytest
from case_grid import grid
import torch

from fused_helpers import DEVICE, reference, DTYPES, ON_GPU, assert_close_to_reference, cu_from_lengths, make_qkv, requires_fused
from te_torch_testing import dropout_keep_mask
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func, new_rng_state

pytestmark = requires_fused

S = 128 if ON_GPU else 33
D = 64 if ON_GPU else 16


def _grads_and_ref(q, k, v, extra_leaves, mask, scale, ref_kwargs, fused_kwargs, d_seed=1):
    """(ours: out + grads of q, k, v, extras), (fp64 ref), (low-precision ref)."""
    out = fused_attn_func(q, k, v, "bshd", mask, (-1, -1), scale, deterministic=True, **fused_kwargs)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(d_seed)).to(out.device, out.dtype)
    leaves = (q, k, v) + tuple(extra_leaves)
    ours = [out] + list(torch.autograd.grad(out, leaves, d_out))
    refs = []
    for dtype in (torch.float64, q.dtype):
        lv = [t.detach().to(dtype).requires_grad_() for t in leaves]
        kw = dict(ref_kwargs)
        if "bias" in kw and kw["bias"] is not None:
            kw["bias"] = lv[3]
        o = reference(lv[0], lv[1], lv[2], mask, (-1, -1), scale, dtype=dtype, **kw)
        refs.append([o] + list(torch.autograd.grad(o, lv, d_out.to(dtype))))
    return ours, refs[0], refs[1]


@pytest.mark.parametrize("shape,mask", grid("shape,mask", ["1hss", "b1ss", "bhss", "11ss"], ["no_mask", "causal"]))
def test_post_scale_bias_and_its_gradient(shape, mask):
    dtype = DTYPES[0]
    b, h = 2, 4
    q, k, v, _ = make_qkv(b, S, S + 5, h, 2, D, D, dtype)
    bshape = {"1hss": (1, h), "b1ss": (b, 1), "bhss": (b, h), "11ss": (1, 1)}[shape] + (S, S + 5)
    bias = torch.randn(bshape, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype).requires_grad_()
    ours, ref, lowp = _grads_and_ref(q, k, v, [bias], mask, D ** -0.5, {"bias": bias},
                                     {"core_attention_bias": bias})
    for name, a, r, lp in zip(("out", "dq", "dk", "dv", "dbias"), ours, ref, lowp):
        assert a.shape == r.shape, name
        assert_close_to_reference(name, a, r, lp)


def test_bias_gradient_bitwise_repeatable():
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(3, S, S, 2, 2, D, D, dtype)
    bias = torch.randn(1, 2, S, S, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype).requires_grad_()
    first = None
    for _ in range(3):
        out = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.3, deterministic=True, core_attention_bias=bias)
        g = torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
        if first is None:
            first = g
        assert all(torch.equal(a, b) for a, b in zip(g, first))


@pytest.mark.parametrize("slopes_shape,masking", grid(
    "slopes_shape,masking", ["h", "bh"],
    {"no_mask": ("no_mask", S, S), "causal": ("causal", S, S),
     "causal_bottom_right": ("causal_bottom_right", S - 7, S + 4)}))
def test_alibi(slopes_shape, masking):
    mask, sq, sk = masking
    dtype = DTYPES[0]
    b, h = 2, 4
    q, k, v, _ = make_qkv(b, sq, sk, h, 1, D, D, dtype)
    gen = torch.Generator().manual_seed(3)
    slopes = torch.rand((h,) if slopes_shape == "h" else (b, h), generator=gen).to(DEVICE) * 0.5
    ours, ref, lowp = _grads_and_ref(q, k, v, [], mask, D ** -0.5, {"alibi_slopes": slopes},
                                     {"alibi_slopes": slopes})
    for name, a, r, lp in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_close_to_reference(name, a, r, lp)


def test_dropout_keep_rate():
    p = 0.25
    rng = torch.tensor([20261130, 7], dtype=torch.int64, device=DEVICE)
    keep = dropout_keep_mask(rng, 2, 4, 64, 64, p)
    rate = keep.float().mean().item()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma, (rate, 1 - p, sigma)
    # A different offset draws a different mask; the same state draws the same one.
    other = dropout_keep_mask(torch.tensor([20261130, 8], dtype=torch.int64, device=DEVICE), 2, 4, 64, 64, p)
    assert not torch.equal(keep, other)
    assert torch.equal(keep, dropout_keep_mask(rng.clone(), 2, 4, 64, 64, p))


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_dropout_matches_reference_with_the_same_mask(mask):
    dtype = DTYPES[0]
    b, h, p = 2, 4, 0.2
    q, k, v, _ = make_qkv(b, S, S, h, 2, D, D, dtype)
    rng = torch.tensor([1234, 0], dtype=torch.int64, device=DEVICE)
    keep = dropout_keep_mask(rng, b, h, S, S, p)
    ours, ref, lowp = _grads_and_ref(q, k, v, [], mask, D ** -0.5, {"dropout_keep": keep, "dropout_p": p},
                                     {"dropout_p": p, "rng_state": rng})
    for name, a, r, lp in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_close_to_reference(name, a, r, lp)


def test_dropout_reproducible_and_state_returned():
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(2, S, S, 2, 2, D, D, dtype)
    torch.manual_seed(0)
    out1, (lse1, rng1) = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.25, deterministic=True,
                                         dropout_p=0.3, return_softmax_aux=True)
    g1 = torch.autograd.grad(out1, (q, k, v), torch.ones_like(out1))
    torch.manual_seed(0)
    out2, (lse2, rng2) = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.25, deterministic=True,
                                         dropout_p=0.3, return_softmax_aux=True)
    g2 = torch.autograd.grad(out2, (q, k, v), torch.ones_like(out2))
    assert torch.equal(rng1, rng2) and rng1.dtype == torch.int64 and rng1.shape == (2,)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    out3 = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.25, deterministic=True, dropout_p=0.3,
                           rng_state=new_rng_state(q.device))
    assert not torch.equal(out1, out3)


def test_dropout_thd_equals_padded_bitwise():
    dtype = DTYPES[0]
    lengths = [S // 2, 5, S]
    h, p = 2, 0.3
    total = sum(lengths)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(total, h, D, generator=g).to(DEVICE, dtype).requires_grad_() for _ in range(3))
    cu = cu_from_lengths(lengths)
    rng = torch.tensor([99, 3], dtype=torch.int64, device=DEVICE)
    out = fused_attn_func(q, k, v, "thd", "padding_causal", (-1, -1), 0.3, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=S, max_seqlen_kv=S, deterministic=True, dropout_p=p, rng_state=rng)
    d_out = torch.randn(out.shape, generator=g).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    def pad(t):
        z = torch.zeros(len(lengths), S, *t.shape[1:], dtype=t.dtype, device=DEVICE)
        for i, n in enumerate(lengths):
            z[i, :n] = t.detach()[int(cu[i]):int(cu[i]) + n]
        return z.requires_grad_()
    qp, kp, vp = pad(q), pad(k), pad(v)
    outp = fused_attn_func(qp, kp, vp, "bshd", "padding_causal", (-1, -1), 0.3, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           deterministic=True, dropout_p=p, rng_state=rng)
    gp = torch.autograd.grad(outp, (qp, kp, vp), pad(d_out).detach())
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i]) + n)
        assert torch.equal(out[sl], outp[i, :n])
        for a, b in zip(grads, gp):
            assert torch.equal(a[sl], b[i, :n])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(cu_seqlens_q="int64"), "must be int32"),
        (dict(cu_seqlens_q="short"), "length batch \\+ 1"),
        (dict(dropout_p=1.0), "dropout_p"),
        (dict(alibi_slopes="bad"), "alibi_slopes"),
        (dict(core_attention_bias="bad"), "core_attention_bias"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    q, k, v, _ = make_qkv(2, 16, 16, 2, 2, D, D, DTYPES[0])
    call = dict(cu_seqlens_q=cu_from_lengths([16, 10]), cu_seqlens_kv=cu_from_lengths([16, 10]))
    mask = "padding"
    for key, val in kwargs.items():
        if val == "int64":
            call[key] = call[key].to(torch.int64)
        elif val == "short":
            call[key] = call[key][:2]
            call["cu_seqlens_kv"] = call["cu_seqlens_kv"][:2]
        elif key == "alibi_slopes":
            call[key] = torch.ones(3, device=DEVICE)
        elif key == "core_attention_bias":
            call[key] = torch.ones(2, 3, 16, 16, device=DEVICE, dtype=q.dtype)
        else:
            call[key] = val
    with pytest.raises(ValueError, match=match):
        fused_attn_func(q, k, v, "bshd", mask, (-1, -1), 0.2, **call)


@pytest.mark.parametrize(
    "lengths_q,total,max_s,match",
    [
        ([0, 5, 3, 9], 9, 8, "non-decreasing"),        # not monotonic
        ([0, 5, 9], 12, 8, "last entry"),             # last entry != token count
        ([0, 9, 12], 12, 8, "max_seqlen"),            # a sequence longer than max_seqlen
        ([1, 5, 12], 12, 8, "start at 0"),
    ],
)
def test_bad_cu_seqlens_values(lengths_q, total, max_s, match):
    dtype = DTYPES[0]
    q, k, v = (torch.randn(total, 2, D).to(DEVICE, dtype) for _ in range(3))
    cu = torch.tensor(lengths_q, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fused_attn_func(q, k, v, "thd", "padding", (-1, -1), 0.2, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                        max_seqlen_q=max_s, max_seqlen_kv=max_s)


def test_mismatched_dtypes_and_head_counts():
    q, k, v, _ = make_qkv(1, 16, 16, 4, 2, D, D, DTYPES[0])
    with pytest.raises(ValueError, match="dtype"):
        fused_attn_func(q, k.float(), v, "bshd", "no_mask", (-1, -1), 0.2)
    q3 = torch.randn(1, 16, 3, D).to(DEVICE, DTYPES[0])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fused_attn_func(q3, k, v, "bshd", "no_mask", (-1, -1), 0.2)


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_double_backward_is_refused_by_name(with_bias):
    """Gradients taken with create_graph=True are the first-order gradients (bitwise those of a plain
    backward); differentiating them again raises NotImplementedError naming the fused op, instead of torch's
    "element 0 of tensors does not require grad"."""
    dtype = DTYPES[0]
    q, k, v, _ = make_qkv(2, 17, 17, 2, 2, D, D, dtype, seed=31)
    bias = (torch.randn(1, 2, 17, 17, generator=torch.Generator().manual_seed(32)).to(DEVICE, dtype)
            .requires_grad_() if with_bias else None)
    leaves = (q, k, v) + ((bias,) if with_bias else ())

    def grads(create_graph):
        out = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), 0.3, core_attention_bias=bias)
        return torch.autograd.grad(out.float().square().sum(), leaves, create_graph=create_graph)

    first, recorded = grads(False), grads(True)
    for a, b in zip(first, recorded):
        assert torch.equal(a, b.detach())
        assert b.requires_grad
    for g in recorded:
        named = r"double backward.*FusedAttnFunc.*transformer_engine::fused_attn_bwd"
        with pytest.raises(NotImplementedError, match=named):
            torch.autograd.grad(g.float().square().sum(), leaves, allow_unused=True, retain_graph=True)
