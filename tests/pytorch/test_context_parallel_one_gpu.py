# qa: no xdist workers (every case fills the GPU; workers sharing it stall each other)
"""Context parallelism on one GPU: every rank's "p2p"/"all_gather" step in one process (all ranks' chunks on
the GPU, the exchanges as tensor copies), at bf16 and long sequences, bitwise equal to the single call on the
whole sequence and over a repeat.

Run on one GPU: ``pytest tests/pytorch/test_context_parallel_one_gpu.py`` (the 128k case is marked slow:
``-m "not slow"`` leaves it out). Skipped without CUDA.
"""

import pytest
import torch

from te_torch_testing import run_ranks_in_one_process
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func

pytestmark = [pytest.mark.gpu, pytest.mark.determinism,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def _check(fmt, causal, cp, h, hk, d, s=None, lengths=None, padded=None, b=1, dtype=torch.bfloat16, stripe=None):
    g = torch.Generator(device="cuda").manual_seed(11)
    kwargs, extra = {}, {}
    if fmt == "thd":
        cu, cup = _cu(lengths), _cu(padded)
        lead = (sum(padded),)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup, cu_seqlens_kv_padded=cup,
                      max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        extra = dict(cu_seqlens=cu, cu_seqlens_padded=cup)
        mask = "padding_causal" if causal else "padding"
    else:
        lead = (b, s) if fmt == "bshd" else (s, b)
        mask = "causal" if causal else "no_mask"
    q, k, v, d_out = (torch.randn(*lead, hh, d, generator=g, device="cuda", dtype=dtype) for hh in (h, hk, hk, h))
    if fmt == "thd":  # zero dO at padding tokens (their output is zero; the single call ignores them too)
        real = torch.zeros(lead[0], dtype=torch.bool, device="cuda")
        at = 0
        for n, p in zip(lengths, padded):
            real[at:at + n] = True
            at += p
        d_out = torch.where(real[:, None, None], d_out, torch.zeros_like(d_out))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused_attn_func(*leaves, fmt, mask, None, d ** -0.5, deterministic=True, **kwargs)
    want = (out.detach(),) + torch.autograd.grad(out, leaves, d_out)
    del out, leaves
    first = run_ranks_in_one_process(q, k, v, d_out, fmt, cp, causal, d ** -0.5, stripe=stripe, **extra)
    for name, a, w in zip(("out", "dq", "dk", "dv"), first, want):
        assert torch.equal(a, w), f"{name} cp={cp}: max diff {(a.float() - w.float()).abs().max().item()}"
    again = run_ranks_in_one_process(q, k, v, d_out, fmt, cp, causal, d ** -0.5, stripe=stripe, **extra)
    assert all(torch.equal(a, b_) for a, b_ in zip(first, again)), "not bitwise over a repeat"


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_bshd_causal_gqa_32k(cp):
    _check("bshd", True, cp, h=16, hk=4, d=128, s=32768)


@pytest.mark.parametrize("cp", [2, 4])
def test_bshd_no_mask_32k_d64(cp):
    _check("bshd", False, cp, h=8, hk=8, d=64, s=32768)


def test_sbhd_causal_32k_fp16_unaligned_chunks():
    # 32760 / (2 * 4) = 4095-token chunks: no chunk start is a multiple of the kernels' tiles.
    _check("sbhd", True, 4, h=8, hk=2, d=128, s=32760, dtype=torch.float16)


@pytest.mark.parametrize("causal", [True, False], ids=["padding_causal", "padding"])
def test_thd_32k_padded_sequences(causal):
    _check("thd", causal, 4, h=8, hk=2, d=128, lengths=(19995, 8990, 2999), padded=(20000, 9000, 3000))


@pytest.mark.slow
def test_bshd_causal_128k():
    _check("bshd", True, 8, h=8, hk=2, d=128, s=131072)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_batch_of_two_16k(fmt):
    _check(fmt, True, 4, h=8, hk=2, d=128, s=16384, b=2)


# The Striped order (cp_stripe_size): stripes on the H200's 128-row tiles and off them (thd over the packed row).
@pytest.mark.parametrize("cp,stripe", [(4, 512), (8, 200)])
def test_bshd_causal_striped_32k(cp, stripe):
    _check("bshd", True, cp, h=16, hk=4, d=128, s=32000 if stripe == 200 else 32768, stripe=stripe)


def test_thd_striped_32k_padded_sequences():
    _check("thd", True, 4, h=8, hk=2, d=128, lengths=(19995, 8990, 2999), padded=(20000, 9000, 3000), stripe=250)
