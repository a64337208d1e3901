"""DotProductAttention in deterministic training (qa/L3_determinism runs this with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0).

Each test also sets the variable itself, so the CPU run (L0, Triton interpreter, tiny shapes)
checks the same contract: FusedAttention stays selected in deterministic training; outputs and
dQ/dK/dV are bitwise equal across repeated runs; a sequence gets bitwise the same results alone
and inside a batch, and packed (thd) as padded (bshd); gradients match the unfused reference.
"""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import (
    DEVICE,
    LOWP_DTYPES,
    ON_GPU,
    SelectionSpy,
    assert_close_to_reference,
    cu_seqlens,
    gen,
    randn,
    reference,
    reference_and_lowp,
    requires_fused,
    to_bshd,
)
from transformer_engine.pytorch import DotProductAttention

pytestmark = pytest.mark.determinism

RUNS = 20 if ON_GPU else 3
S = 1024 if ON_GPU else 32
D = 128 if ON_GPU else 16
HEADS = [(8, 8), (8, 2)] if ON_GPU else [(2, 2), (2, 1)]
HEAD_IDS = ["mha", "gqa"]
BACKENDS = [pytest.param("fused", marks=requires_fused), "unfused"]


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"):
        monkeypatch.delenv(name, raising=False)


def _module(h, hk, fmt, mask="causal"):
    return DotProductAttention(h, D, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask)


def _leaves(shapes, dtype, seed):
    g = gen(seed)
    return [randn(s, dtype, g) for s in shapes]


def _fwd_bwd(dpa, q, k, v, d_out=None, **kwargs):
    out = dpa(q, k, v, **kwargs)
    if d_out is None:
        d_out = randn(out.shape, out.dtype, gen(99), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    return out, grads, d_out


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@requires_fused
def test_fused_attention_stays_selected_in_deterministic_training(monkeypatch, heads, dtype):
    spy = SelectionSpy(monkeypatch)
    h, hk = heads
    dpa = _module(h, hk, "bshd")
    q, k, v = _leaves([(2, S, h, D), (2, S, hk, D), (2, S, hk, D)], dtype, 0)
    _fwd_bwd(dpa, q, k, v)
    config = spy.configs[-1]
    assert config.deterministic and config.is_training
    assert spy.names[-1] == "FusedAttention", spy.rejected()
    assert dpa.last_backend == "FusedAttention"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_repeated_runs_bitwise_equal(monkeypatch, backend, fmt, heads, dtype):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    h, hk = heads
    kwargs = {}
    if fmt == "thd":
        lengths = [S // 2 + 3, 1, S, S // 3]
        cu = cu_seqlens(lengths)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        t = sum(lengths)
        shapes = [(t, h, D), (t, hk, D), (t, hk, D)]
    else:
        shapes = [(2, S, h, D), (2, S, hk, D), (2, S, hk, D)]
        if fmt == "sbhd":
            shapes = [(s[1], s[0]) + s[2:] for s in shapes]
    dpa = _module(h, hk, fmt)
    q, k, v = _leaves(shapes, dtype, 1)
    first_out, first_grads, d_out = _fwd_bwd(dpa, q, k, v, **kwargs)
    for _ in range(RUNS - 1):
        out, grads, _ = _fwd_bwd(dpa, q, k, v, d_out, **kwargs)
        assert torch.equal(out, first_out)
        for name, a, b in zip(("dq", "dk", "dv"), grads, first_grads):
            assert torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_batch_invariance(monkeypatch, backend, heads):
    """A sequence's outputs and gradients are bitwise the same alone and inside a larger batch."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    h, hk = heads
    dtype = LOWP_DTYPES[-1]
    dpa = _module(h, hk, "bshd")
    q, k, v = _leaves([(3, S, h, D), (3, S, hk, D), (3, S, hk, D)], dtype, 2)
    out, grads, d_out = _fwd_bwd(dpa, q, k, v)
    one = [t.detach()[1:2].clone().requires_grad_() for t in (q, k, v)]
    out1, grads1, _ = _fwd_bwd(dpa, *one, d_out[1:2])
    assert torch.equal(out1, out[1:2])
    for a, b in zip(grads1, grads):
        assert torch.equal(a, b[1:2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gap", [0, 2])
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_packed_thd_equals_padded_bshd(monkeypatch, backend, mask, gap):
    """The same sequences packed (thd, optionally with gaps) and padded (bshd): bitwise equal per sequence."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    h, hk = HEADS[-1]
    dtype = LOWP_DTYPES[0]
    lengths = [S // 2 + 3, 1, 0, S, 7]
    starts, pos = [], 0
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    starts.append(pos)
    q, k, v = _leaves([(pos, h, D), (pos, hk, D), (pos, hk, D)], dtype, 3)
    cu = cu_seqlens(lengths)
    padded_cu = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if gap else None
    thd = _module(h, hk, "thd", mask)
    out, grads, d_out = _fwd_bwd(thd, q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded_cu,
                                 cu_seqlens_kv_padded=padded_cu, max_seqlen_q=S, max_seqlen_kv=S)

    b = len(lengths)

    def pad(t):
        p = torch.zeros((b, S) + tuple(t.shape[1:]), dtype=t.dtype, device=DEVICE)
        for i, n in enumerate(lengths):
            p[i, :n] = t.detach()[starts[i]:starts[i] + n]
        return p

    qp, kp, vp = (pad(t).requires_grad_() for t in (q, k, v))
    bshd = _module(h, hk, "bshd", mask)
    outp, gradsp, _ = _fwd_bwd(bshd, qp, kp, vp, pad(d_out), cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for i, n in enumerate(lengths):
        rows = slice(starts[i], starts[i] + n)
        assert torch.equal(out[rows], outp[i, :n]), f"sequence {i}: output"
        for name, a, ap in zip(("dq", "dk", "dv"), grads, gradsp):
            assert torch.equal(a[rows], ap[i, :n]), f"sequence {i}: {name}"


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@requires_fused
def test_deterministic_gradients_match_reference(monkeypatch, heads, dtype):
    """Deterministic fused gradients are as accurate as PyTorch's own low-precision attention."""
    h, hk = heads
    dpa = _module(h, hk, "sbhd")
    q, k, v = _leaves([(S + 5, 2, h, D), (S + 5, 2, hk, D), (S + 5, 2, hk, D)], dtype, 4)
    out, grads, d_out = _fwd_bwd(dpa, q, k, v)
    assert dpa.last_backend == "FusedAttention"
    out = out.view(*out.shape[:-1], h, D)

    def ref_fn(q_, k_, v_, dtype):
        return reference(q_, k_, v_, "causal", dtype=dtype)

    ref, lowp = reference_and_lowp([to_bshd(t, "sbhd") for t in (q, k, v)], to_bshd(d_out.view(out.shape), "sbhd"),
                                   ref_fn)
    for name, o, r, lp in zip(("out", "dq", "dk", "dv"), (out,) + grads, ref, lowp):
        assert_close_to_reference(name, to_bshd(o, "sbhd"), r, lp)
