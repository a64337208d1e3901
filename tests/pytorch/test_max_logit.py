"""``return_max_logit=True`` on the fused backend: the forward kernel writes each row's max logit and a max over
rows gives each head's. Checked against the fp64 definition (the max of the visible scaled scores), bitwise
across runs, batch composition (a sequence's rows alone or among others) and thd packing, and the output and
gradients bitwise those of the same call without it (fp32 and fp16 here: the Triton forward; bf16 at d=128 on Hopper:
the Gluon forward, with and without the max logit). Under Triton's interpreter on CPU, compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from case_grid import grid

from dpa_helpers import DEVICE, requires_fused
from transformer_engine.common.attention import AttnMaskType
from transformer_engine.common.attention.explain import explain_plan
from transformer_engine.common.attention.config import PlanKey
from transformer_engine.pytorch import DotProductAttention

pytestmark = requires_fused
H, HK, D = 4, 2, 16
LENS = (23, 9, 40)


def _dpa(mask, window=None, max_logit=True, fmt="thd"):
    return DotProductAttention(H, D, num_gqa_groups=HK, qkv_format=fmt, attn_mask_type=mask, window_size=window,
                               return_max_logit=max_logit).to(DEVICE)


def _seqs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple((torch.randn(n, h, D, generator=g) * s).to(DEVICE, dtype).requires_grad_()
                  for h, s in ((H, 2.0), (HK, 1.0), (HK, 1.0))) for n in LENS]


def _packed(dpa, seqs):
    lens = [s[0].shape[0] for s in seqs]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.cat([s[j] for s in seqs]) for j in range(3))
    return dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))


def _reference(seqs, mask, window, scale):
    """fp64 max over every sequence's visible (query, key) pairs of each head's scaled score."""
    best = torch.full((H,), float("-inf"), dtype=torch.float64)
    for q, k, _ in seqs:
        n = q.shape[0]
        s = torch.einsum("qhd,khd->hqk", q.detach().double().cpu(),
                         k.detach().double().cpu().repeat_interleave(H // HK, dim=1)) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = torch.ones(n, n, dtype=torch.bool)
        if "causal" in mask:
            keep &= j <= i
        if window is not None:
            keep &= (j >= i - window[0]) & (j <= i + window[1])
        best = torch.maximum(best, s.masked_fill(~keep, float("-inf")).amax(dim=(1, 2)))
    return best


@pytest.mark.parametrize("dtype,masking", grid(
    "dtype,masking", {"fp32": torch.float32, "fp16": torch.float16},
    {"causal": ("padding_causal", None), "no_causal": ("padding", None), "window": ("padding_causal", (5, 0))}))
def test_max_logit_is_the_definition_and_invariant(monkeypatch, dtype, masking):
    mask, window = masking
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    seqs = _seqs(dtype)
    dpa = _dpa(mask, window)
    out, max_logit = _packed(dpa, seqs)
    assert dpa.last_backend == "FusedAttention"
    assert max_logit.shape == (H,) and max_logit.dtype == dtype and not max_logit.requires_grad
    expected = _reference(seqs, mask, window, D ** -0.5)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(max_logit.double().cpu(), expected, **tol)
    # Bitwise: run after run, and whatever else is in the batch (a max over rows is order-free).
    assert torch.equal(_packed(dpa, seqs)[1], max_logit)
    assert torch.equal(_packed(dpa, seqs[::-1])[1], max_logit)
    parts = [_packed(dpa, [s])[1] for s in seqs]
    assert torch.equal(torch.stack(parts).amax(0), max_logit)
    # The output and gradients are the call's without the max logit.
    plain = _dpa(mask, window, max_logit=False)
    ref = _packed(plain, seqs)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [t for s in seqs for t in s], g)
    ref_grads = torch.autograd.grad(ref, [t for s in seqs for t in s], g)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_rows_that_see_nothing_do_not_count(monkeypatch):
    """A bshd batch with padded sequences: the padding rows and keys never enter the max."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    seqs = _seqs(torch.float32, seed=3)
    width = max(LENS)
    q, k, v = (torch.stack([torch.nn.functional.pad(s[j].detach(), (0, 0, 0, 0, 0, width - s[j].shape[0]),
                                                    value=100.0) for s in seqs]) for j in range(3))
    cu = torch.tensor([0, 23, 32, 72], dtype=torch.int32, device=DEVICE)
    dpa = _dpa("padding_causal", fmt="bshd")
    _, max_logit = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    torch.testing.assert_close(max_logit.double().cpu(), _reference(seqs, "causal", None, D ** -0.5),
                               rtol=1e-6, atol=1e-6)


def test_the_plan_keeps_the_gluon_forward_with_the_max_logit():
    """Hopper's warp-specialized forward writes the row maxima too: return_max_logit changes no kernel choice."""
    key = PlanKey(128, 128, "bfloat16", AttnMaskType.CAUSAL_MASK, compute_capability=(9, 0), return_max_logit=True)
    text = str(explain_plan(key))
    assert "forward: attn_fwd_ws_kernel (Gluon" in text and "return_max_logit" not in text


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the warp-specialized Gluon forward runs on Hopper (sm_90) only")
@pytest.mark.parametrize("mask,window", [("padding_causal", None), ("padding", None)], ids=["causal", "no_causal"])
def test_gluon_forward_max_logit(monkeypatch, mask, window):
    """bf16 at d=128 on Hopper (the Gluon forward): the definition in fp64 to bf16 rounding of the scores, bitwise
    across runs and batch composition, and the output and gradients those of the call without it."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    g = torch.Generator().manual_seed(5)
    seqs = [tuple((torch.randn(n, h, 128, generator=g) * s).to(DEVICE, torch.bfloat16).requires_grad_()
                  for h, s in ((H, 2.0), (HK, 1.0), (HK, 1.0))) for n in (300, 77, 520)]
    dpa = DotProductAttention(H, 128, num_gqa_groups=HK, qkv_format="thd", attn_mask_type=mask,
                              return_max_logit=True).to(DEVICE)
    out, max_logit = _packed(dpa, seqs)
    # Reference: _reference's definition at d=128 (the helpers above are written for D=16).
    best = torch.full((H,), float("-inf"), dtype=torch.float64)
    for q, k, _ in seqs:
        n = q.shape[0]
        sc = torch.einsum("qhd,khd->hqk", q.detach().double().cpu(),
                          k.detach().double().cpu().repeat_interleave(H // HK, dim=1)) * 128 ** -0.5
        keep = torch.arange(n)[None, :] <= torch.arange(n)[:, None] if "causal" in mask else torch.ones(n, n, dtype=bool)
        best = torch.maximum(best, sc.masked_fill(~keep, float("-inf")).amax(dim=(1, 2)))
    # max_logit comes in q's dtype: the kernel's fp32 max (sums of exact products) within one bf16 step of the
    # definition rounded to bf16.
    assert max_logit.dtype == torch.bfloat16
    torch.testing.assert_close(max_logit.double().cpu(), best.to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)
    assert torch.equal(_packed(dpa, seqs)[1], max_logit)
    assert torch.equal(_packed(dpa, seqs[::-1])[1], max_logit)
    assert torch.equal(torch.stack([_packed(dpa, [s])[1] for s in seqs]).amax(0), max_logit)
    plain = DotProductAttention(H, 128, num_gqa_groups=HK, qkv_format="thd", attn_mask_type=mask).to(DEVICE)
    ref = _packed(plain, seqs)
    assert torch.equal(out, ref)
    grad = torch.randn_like(out)
    leaves = [t for s in seqs for t in s]
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, leaves, grad),
                                                  torch.autograd.grad(ref, leaves, grad)))


def _dpa_with(mask, max_logit=True, **kwargs):
    return DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="thd", attn_mask_type=mask,
                               return_max_logit=max_logit, **kwargs).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_equals_unfused_to_rounding(monkeypatch, dtype):
    """The same call on both backends: the fused kernel's base-2 max and the unfused math's scores agree within
    the dtype's rounding (each is that close to the fp64 definition, test above)."""
    seqs = _seqs(dtype, seed=4)
    got = {}
    for backend in ("fused", "unfused"):
        monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
        dpa = _dpa_with("padding_causal", window_size=(7, 0))
        got[backend] = _packed(dpa, seqs)[1]
        assert dpa.last_backend == ("FusedAttention" if backend == "fused" else "UnfusedDotProductAttention")
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got["fused"], got["unfused"], **tol)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_the_sink_is_not_a_logit(monkeypatch, backend):
    """Learnable sink softmax with sink logits far above every score: the max logit is still the keys' (the
    unfused definition's), and the output and gradients are the call's without it."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    seqs = _seqs(torch.float32, seed=5)
    dpa = _dpa_with("padding_causal", softmax_type="learnable")
    with torch.no_grad():
        dpa.softmax_offset.fill_(100.0)
    out, max_logit = _packed(dpa, seqs)
    torch.testing.assert_close(max_logit.double().cpu(), _reference(seqs, "causal", None, D ** -0.5),
                               rtol=2e-6, atol=2e-6)
    plain = _dpa_with("padding_causal", max_logit=False, softmax_type="learnable")
    with torch.no_grad():
        plain.softmax_offset.fill_(100.0)
    assert torch.equal(out, _packed(plain, seqs))


def test_fp16_alibi_and_bias_in_the_fused_kernel(monkeypatch):
    """A post-scale bias plus ALiBi (one FMA in the kernel, in base 2) against the fp64 definition, fp16 inputs:
    within fp16's rounding of the result, and bitwise the same run after run."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "fused")
    g = torch.Generator().manual_seed(6)
    b, s = 2, 21
    q = (torch.randn(b, s, H, D, generator=g) * 2).to(DEVICE, torch.float16)
    k, v = ((torch.randn(b, s, HK, D, generator=g)).to(DEVICE, torch.float16) for _ in range(2))
    bias = torch.randn(1, H, s, s, generator=g).to(DEVICE, torch.float16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    dpa = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="bshd", attn_mask_type="causal",
                              return_max_logit=True).to(DEVICE)
    run = lambda: dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)  # noqa: E731
    _, max_logit = run()
    assert dpa.last_backend == "FusedAttention"
    assert torch.equal(run()[1], max_logit)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(), k.double().cpu().repeat_interleave(H // HK, dim=2))
    scores = scores * D ** -0.5 + bias.double().cpu()
    keep = torch.ones(s, s, dtype=torch.bool).tril()
    expected = scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logit.double().cpu(), expected, rtol=1e-3, atol=1e-3)
    dpa_alibi = DotProductAttention(H, D, num_gqa_groups=HK, qkv_format="bshd", attn_mask_type="causal",
                                    return_max_logit=True).to(DEVICE)
    _, with_alibi = dpa_alibi(q, k, v, core_attention_bias_type="alibi", alibi_slopes=slopes)
    rel = (torch.arange(s)[None, :] - torch.arange(s)[:, None]).abs()
    alibi_scores = scores - bias.double().cpu() - slopes.double().cpu()[:, None, None] * rel
    expected = alibi_scores.masked_fill(~keep, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(with_alibi.double().cpu(), expected, rtol=1e-3, atol=1e-3)
