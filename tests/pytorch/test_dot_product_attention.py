"""DotProductAttention: fused and unfused against an fp64 reference, bad input, selection, call-time settings.

Modelled on TransformerEngine's test_attention. Fused cases run on a GPU, or on the CPU under
``TRITON_INTERPRET=1`` (set before triton is imported) at tiny shapes with fp16; unfused cases
run everywhere. Each backend is forced with NVTE_FUSED_ATTN_BACKEND so that a case tests the
backend it names.
"""

from __future__ import annotations

import logging
import math

import pytest
from case_grid import grid
import torch

from dpa_helpers import (
    ALL_MASKS,
    DEVICE,
    LOWP_DTYPES,
    ON_GPU,
    SelectionSpy,
    assert_close_to_reference,
    cu_seqlens,
    deterministic_algorithms,
    gen,
    make_qkv,
    randn,
    reference,
    reference_and_lowp,
    requires_fused,
    to_bshd,
)
from transformer_engine.common import log as te_log
from transformer_engine.common.attention.backends import FlashAttention, NoBackendError
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backends as attn_backends
from transformer_engine.pytorch.attention import dot_product_attention as dpa_module
from transformer_engine.pytorch.attention import flash_backend
import te_torch_testing as attn_testing
from transformer_engine.pytorch.attention.backends import FusedAttentionBackend, UnfusedAttentionBackend
from transformer_engine.pytorch.attention.unfused import default_alibi_slopes

BACKENDS = ["unfused", pytest.param("fused", marks=requires_fused)]
UNFUSED_DTYPES = [torch.float32] + LOWP_DTYPES
# Sizes: odd and unequal on purpose; several tiles per sequence on a GPU, small enough for the
# Triton interpreter on CPU.
B, SQ, SKV, D = (3, 197, 261, 64) if ON_GPU else (3, 21, 29, 16)
THD_LENS_Q, THD_LENS_KV = ([130, 1, 0, 170], [170, 5, 0, 110]) if ON_GPU else ([13, 1, 0, 17], [17, 5, 0, 11])
HEADS = [(2, 2), (4, 2) if ON_GPU else (2, 1)]
HEAD_IDS = ["mha", "gqa"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Each test starts from the default settings (and a fresh warn-once memory)."""
    for name in ("NVTE_FUSED_ATTN_BACKEND", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_FLASH_ATTN",
                 "NVTE_DEBUG", "NVTE_DEBUG_LEVEL", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(te_log, "_warned_once", set())


def dtypes_for(backend):
    return UNFUSED_DTYPES if backend == "unfused" else LOWP_DTYPES


def run(monkeypatch, backend, q, k, v, h, hk, fmt, mask, window=None, scale=None, seed=7, dv=None, **fwd):
    """Forward + backward through DotProductAttention with ``backend`` forced; out is [.., h, dv]."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    d = q.shape[-1]
    dv = v.shape[-1] if dv is None else dv
    dpa = DotProductAttention(h, (d, dv), num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask,
                              window_size=window, softmax_scale=scale)
    out = dpa(q, k, v, **fwd)
    out = out.view(*out.shape[:-1], h, dv)
    d_out = randn(out.shape, out.dtype, gen(seed), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert dpa.last_backend == {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}[backend]
    return out, grads, d_out


def check_bshd(name_prefix, ours, d_out, inputs, fmt, ref_fn):
    """ours = (out, dq, dk, dv) in ``fmt``; compared in bshd against ``ref_fn`` on bshd inputs."""
    bshd_inputs = [to_bshd(t, fmt) for t in inputs]
    ref, lowp = reference_and_lowp(bshd_inputs, to_bshd(d_out, fmt), ref_fn)
    for name, o, r, lp in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_close_to_reference(f"{name_prefix}{name}", to_bshd(o, fmt), r, lp)


# -- numerics: every format, mask, MHA/GQA, both backends ------------------------------------------


def _thd_inputs(lengths_q, lengths_kv, h, hk, d, dtype, gap=0, seed=3):
    """Packed q, k, v with ``gap`` unused tokens after each sequence, and their cu_seqlens (and padded)."""
    g = gen(seed)

    def starts(lengths):
        out, pos = [], 0
        for n in lengths:
            out.append(pos)
            pos += n + gap
        return out + [pos]

    sq, sk = starts(lengths_q), starts(lengths_kv)
    q = randn((sq[-1], h, d), dtype, g)
    k = randn((sk[-1], hk, d), dtype, g)
    v = randn((sk[-1], hk, d), dtype, g)
    padded = (
        (torch.tensor(sq, dtype=torch.int32, device=DEVICE), torch.tensor(sk, dtype=torch.int32, device=DEVICE))
        if gap else (None, None)
    )
    return q, k, v, sq, sk, padded


def _pad(t, starts, lengths, max_len):
    """Packed [t, ...] -> padded [b, max_len, ...] (zeros past each length); keeps autograd."""
    rows = []
    for s, n in zip(starts, lengths):
        piece = t[s:s + n]
        rows.append(torch.cat([piece, piece.new_zeros((max_len - n,) + tuple(t.shape[1:]))]))
    return torch.stack(rows)


@pytest.mark.parametrize("backend,heads,mask,fmt", grid("backend,heads,mask,fmt", BACKENDS[::-1],
                                                       dict(zip(HEAD_IDS, HEADS)), ALL_MASKS, ["bshd", "sbhd"]))
def test_formats_masks_against_reference(monkeypatch, backend, fmt, mask, heads):
    h, hk = heads
    for dtype in dtypes_for(backend):
        q, k, v = make_qkv(fmt, B, SQ, SKV, h, hk, D, D, dtype, seed=1)
        fwd, lens_q, lens_kv = {}, None, None
        if "padding" in mask:
            # Real lengths, including a query shorter than its keys and one that sees no key when bottom-right.
            lens_q, lens_kv = [SQ, 7, 1], [SKV, 3, 12]
            fwd = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
        out, grads, d_out = run(monkeypatch, backend, q, k, v, h, hk, fmt, mask, **fwd)

        def ref_fn(q_, k_, v_, dtype):
            return reference(q_, k_, v_, mask, lens_q=lens_q, lens_kv=lens_kv, dtype=dtype)

        check_bshd(f"{dtype} ", (out,) + grads, d_out, (q, k, v), fmt, ref_fn)
        if lens_q is not None:  # padded query rows: zero output and zero gradient
            o, dq = to_bshd(out, fmt), to_bshd(grads[0], fmt)
            for i, n in enumerate(lens_q):
                assert torch.equal(o[i, n:], torch.zeros_like(o[i, n:]))
                assert torch.equal(dq[i, n:], torch.zeros_like(dq[i, n:]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("mask", ALL_MASKS)
def test_thd_against_reference(monkeypatch, backend, mask, heads):
    """Packed sequences (with a length-0 and a length-1 one); non-padding masks act per sequence."""
    h, hk = heads
    lens_q, lens_kv = THD_LENS_Q, THD_LENS_KV
    dtype = dtypes_for(backend)[-1]
    q, k, v, sq, sk, _ = _thd_inputs(lens_q, lens_kv, h, hk, D, dtype)
    cu_q, cu_kv = cu_seqlens(lens_q), cu_seqlens(lens_kv)
    out, grads, d_out = run(monkeypatch, backend, q, k, v, h, hk, "thd", mask, cu_seqlens_q=cu_q,
                            cu_seqlens_kv=cu_kv, max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv))
    assert out.shape == (sum(lens_q), h, D)
    mq, mk = max(lens_q), max(lens_kv)
    padded_in = [_pad(q, sq, lens_q, mq), _pad(k, sk, lens_kv, mk), _pad(v, sk, lens_kv, mk)]
    ours = [_pad(out, sq, lens_q, mq), _pad(grads[0], sq, lens_q, mq), _pad(grads[1], sk, lens_kv, mk),
            _pad(grads[2], sk, lens_kv, mk)]

    def ref_fn(q_, k_, v_, dtype):
        return reference(q_, k_, v_, mask, lens_q=lens_q, lens_kv=lens_kv, dtype=dtype)

    check_bshd("", ours, _pad(d_out, sq, lens_q, mq), padded_in, "bshd", ref_fn)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gap", [0, 3])
def test_thd_padded_offsets(monkeypatch, backend, gap):
    """cu_seqlens_*_padded: sequences start at padded offsets; the gap tokens get zero output and gradient."""
    lens = [90, 1, 0, 141] if ON_GPU else [9, 1, 0, 14]
    h, hk = 2, 1
    dtype = dtypes_for(backend)[-1]
    q, k, v, starts, _, (pad_q, pad_kv) = _thd_inputs(lens, lens, h, hk, D, dtype, gap=gap, seed=4)
    cu = cu_seqlens(lens)
    out, grads, d_out = run(monkeypatch, backend, q, k, v, h, hk, "thd", "padding_causal", cu_seqlens_q=cu,
                            cu_seqlens_kv=cu, cu_seqlens_q_padded=pad_q, cu_seqlens_kv_padded=pad_kv,
                            max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    for i, n in enumerate(lens):
        gap_rows = slice(starts[i] + n, starts[i + 1])
        for t in (out,) + grads:
            assert torch.equal(t[gap_rows], torch.zeros_like(t[gap_rows]))
    m = max(lens)
    padded_in = [_pad(t, starts, lens, m) for t in (q, k, v)]
    ours = [_pad(t, starts, lens, m) for t in (out,) + grads]

    def ref_fn(q_, k_, v_, dtype):
        return reference(q_, k_, v_, "padding_causal", lens_q=lens, lens_kv=lens, dtype=dtype)

    check_bshd("", ours, _pad(d_out, starts, lens, m), padded_in, "bshd", ref_fn)


WINDOW_CASES = [
    ("no_mask", (5, 3)),
    ("no_mask", (0, 0)),
    ("no_mask", (-1, 2)),
    ("causal", (4, 0)),
    ("causal_bottom_right", (6, -1)),
    ("padding", (3, 3)),
    ("padding_causal", (2, 0)),
    ("padding_causal_bottom_right", (5, 0)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask,window", WINDOW_CASES)
def test_sliding_windows(monkeypatch, backend, mask, window):
    h, hk = 2, 1
    dtype = dtypes_for(backend)[-1]
    q, k, v = make_qkv("bshd", 2, SQ, SKV, h, hk, D, D, dtype, seed=5)
    lens_q = lens_kv = None
    fwd = {}
    if "padding" in mask:
        lens_q, lens_kv = [SQ - 4, 9], [SKV, 14]
        fwd = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    out, grads, d_out = run(monkeypatch, backend, q, k, v, h, hk, "bshd", mask, window=window, **fwd)

    def ref_fn(q_, k_, v_, dtype):
        return reference(q_, k_, v_, mask, window, lens_q=lens_q, lens_kv=lens_kv, dtype=dtype)

    check_bshd("", (out,) + grads, d_out, (q, k, v), "bshd", ref_fn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_qkv_views_and_head_dims(monkeypatch, backend):
    """q, k, v as strided views of one projection (as TransformerEngine's layers pass them); d_qk != d_v."""
    h, hk, d, dv = 2, 1, 16, 24
    dtype = dtypes_for(backend)[-1]
    g = gen(6)
    proj = randn((2, SQ, h * d + hk * d + hk * dv), dtype, g)
    q, k, v = proj.split([h * d, hk * d, hk * dv], dim=-1)
    q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, dv))
    scale = 0.3
    out, grads, d_out = run(monkeypatch, backend, q, k, v, h, hk, "bshd", "causal", scale=scale, dv=dv)

    def ref_fn(q_, k_, v_, dtype):
        return reference(q_, k_, v_, "causal", scale=scale, dtype=dtype)

    check_bshd("", (out,) + grads, d_out, (q, k, v), "bshd", ref_fn)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_give_zeros_not_nan(monkeypatch, backend):
    """Bottom-right causal with s_q > s_kv: the first s_q - s_kv rows see nothing."""
    dtype = dtypes_for(backend)[-1]
    q, k, v = make_qkv("bshd", 2, 20, 12, 2, 2, D, D, dtype, seed=8)
    out, (dq, dk, dv), _ = run(monkeypatch, backend, q, k, v, 2, 2, "bshd", "causal_bottom_right")
    assert torch.equal(out[:, :8], torch.zeros_like(out[:, :8]))
    assert torch.equal(dq[:, :8], torch.zeros_like(dq[:, :8]))
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_attention_mask_equals_cu_seqlens(monkeypatch, backend):
    """A bool attention_mask (True = padded) gives bitwise the same result as the equivalent cu_seqlens."""
    dtype = dtypes_for(backend)[-1]
    h, s = 2, 16
    lens_q, lens_kv = [16, 5], [16, 9]
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dpa = DotProductAttention(h, D, qkv_format="bshd", attn_mask_type="padding_causal_bottom_right",
                              attention_type="cross")
    q, k, v = (t.detach() for t in make_qkv("bshd", 2, s, s, h, h, D, D, dtype, seed=9))
    pos = torch.arange(s, device=DEVICE)
    mask_q = (pos[None, :] >= torch.tensor(lens_q, device=DEVICE)[:, None]).view(2, 1, 1, s)
    mask_kv = (pos[None, :] >= torch.tensor(lens_kv, device=DEVICE)[:, None]).view(2, 1, 1, s)
    by_mask = dpa(q, k, v, attention_mask=(mask_q, mask_kv))
    by_cu = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    assert torch.equal(by_mask, by_cu)
    # Self attention: one mask for both.
    self_mask = dpa(q, k, v, attention_mask=mask_kv)
    self_cu = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens_kv), cu_seqlens_kv=cu_seqlens(lens_kv))
    assert torch.equal(self_mask, self_cu)


def test_padding_without_lengths_is_unpadded(monkeypatch):
    q, k, v = (t.detach() for t in make_qkv("bshd", 2, 12, 12, 2, 2, D, D, torch.float32, seed=10))
    padded = DotProductAttention(2, D, qkv_format="bshd", attn_mask_type="padding_causal")(q, k, v)
    plain = DotProductAttention(2, D, qkv_format="bshd", attn_mask_type="causal")(q, k, v)
    assert torch.equal(padded, plain)


def test_output_shapes_flattened_like_transformer_engine():
    h, hk, d, dv = 4, 2, 16, 8
    for fmt, shape_q, shape_kv, expect in (
        ("bshd", (2, 5, h, d), (2, 7, hk, d), (2, 5, h * dv)),
        ("sbhd", (5, 2, h, d), (7, 2, hk, d), (5, 2, h * dv)),
    ):
        dpa = DotProductAttention(h, (d, dv), num_gqa_groups=hk, qkv_format=fmt, attn_mask_type="no_mask")
        q, k = torch.randn(shape_q), torch.randn(shape_kv)
        v = torch.randn(shape_kv[:-1] + (dv,))
        assert dpa(q, k, v).shape == expect
    dpa = DotProductAttention(h, (d, dv), num_gqa_groups=hk, qkv_format="thd", attn_mask_type="padding")
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    out = dpa(torch.randn(9, h, d), torch.randn(9, hk, d), torch.randn(9, hk, dv), cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert out.shape == (9, h * dv)


# -- features only the unfused backend has ---------------------------------------------------------


@pytest.mark.parametrize("dtype", UNFUSED_DTYPES, ids=str)
def test_arbitrary_mask(dtype):
    h, hk = 4, 2
    q, k, v = make_qkv("sbhd", 2, 11, 13, h, hk, D, D, dtype, seed=11)
    g = gen(12)
    for shape in ((2, 1, 11, 13), (2, h, 11, 13)):
        hidden = (torch.rand(*shape, generator=g) < 0.4).to(DEVICE)
        hidden[0, :, 3, :] = True  # a row that sees nothing
        dpa = DotProductAttention(h, D, num_gqa_groups=hk, qkv_format="sbhd", attn_mask_type="arbitrary")
        out = dpa(q, k, v, attention_mask=hidden)
        assert dpa.last_backend == "UnfusedDotProductAttention"
        out = out.view(11, 2, h, D)
        d_out = randn(out.shape, dtype, gen(13), requires_grad=False)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        assert torch.equal(out[3, 0], torch.zeros_like(out[3, 0]))
        assert torch.equal(grads[0][3, 0], torch.zeros_like(grads[0][3, 0]))

        def ref_fn(q_, k_, v_, dtype):
            return reference(q_, k_, v_, "arbitrary", hidden=hidden, dtype=dtype)

        check_bshd(f"{shape} ", (out,) + grads, d_out, (q, k, v), "sbhd", ref_fn)


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("shape", ["1hss", "b1ss", "bhss", "11ss"])
def test_bias_shapes_and_gradient(bias_type, shape):
    h, b, sq, skv = 2, 2, 9, 14
    dtype = UNFUSED_DTYPES[-1]
    q, k, v = make_qkv("bshd", b, sq, skv, h, h, D, D, dtype, seed=14)
    dims = {"1hss": (1, h), "b1ss": (b, 1), "bhss": (b, h), "11ss": (1, 1)}[shape]
    bias = randn(dims + (sq, skv), dtype, gen(15))
    spy_dpa = DotProductAttention(h, D, qkv_format="bshd", attn_mask_type="causal_bottom_right")
    out = spy_dpa(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
    if bias_type == "pre_scale_bias":  # only the unfused backend has it: selection says so
        assert spy_dpa.last_backend == "UnfusedDotProductAttention"
    out = out.view(b, sq, h, D)
    d_out = randn(out.shape, dtype, gen(16), requires_grad=False)
    grads = torch.autograd.grad(out, (q, k, v, bias), d_out)

    def ref_fn(q_, k_, v_, bias_, dtype):
        return reference(q_, k_, v_, "causal_bottom_right", bias=bias_, pre_scale_bias=bias_type == "pre_scale_bias",
                         dtype=dtype)

    ref, lowp = reference_and_lowp((q, k, v, bias), d_out, ref_fn)
    for name, o, r, lp in zip(("out", "dq", "dk", "dv", "dbias"), (out,) + grads, ref, lowp):
        assert_close_to_reference(name, o, r, lp)


@pytest.mark.parametrize("slopes_shape", [None, "h", "bh"])
@pytest.mark.parametrize("mask", ["causal", "no_mask", "padding_causal_bottom_right"])
def test_alibi(slopes_shape, mask):
    h, b = 4, 2
    dtype = torch.float32
    q, k, v = make_qkv("bshd", b, 10, 13, h, h, D, D, dtype, seed=17)
    slopes = {
        None: None,
        "h": torch.rand(h, generator=gen(18)).to(DEVICE),
        "bh": torch.rand(b, h, generator=gen(18)).to(DEVICE),
    }[slopes_shape]
    fwd, lens_q, lens_kv = {}, None, None
    if "padding" in mask:
        lens_q, lens_kv = [10, 4], [13, 8]
        fwd = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    dpa = DotProductAttention(h, D, qkv_format="bshd", attn_mask_type=mask)
    out = dpa(q, k, v, core_attention_bias_type="alibi", alibi_slopes=slopes, **fwd).view(b, 10, h, D)
    used = slopes if slopes is not None else default_alibi_slopes(h, DEVICE)
    ref = reference(q, k, v, mask, lens_q=lens_q, lens_kv=lens_kv, alibi_slopes=used)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_default_alibi_slopes():
    assert torch.equal(default_alibi_slopes(8), torch.tensor([2.0 ** -k for k in range(1, 9)]))
    # 6 heads: the 4-head slopes, then every other slope of the 8-head sequence.
    expect = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert torch.allclose(default_alibi_slopes(6), torch.tensor(expect))


class _FakeTracker:
    """Megatron-style RNG tracker: fork() runs a block on its own generator state."""

    def __init__(self, seed):
        self.state = torch.Generator().manual_seed(seed).get_state()
        self.forks = 0

    def fork(self):
        tracker = self

        class _Fork:
            def __enter__(self):
                tracker.forks += 1
                self.saved = torch.get_rng_state()
                torch.set_rng_state(tracker.state)

            def __exit__(self, *exc):
                tracker.state = torch.get_rng_state()
                torch.set_rng_state(self.saved)

        return _Fork()


@pytest.mark.skipif(ON_GPU, reason="the fake RNG tracker forks the CPU generator")
def test_dropout_statistics_reproducibility_and_tracker():
    h, s, p = 2, 256, 0.25
    q = torch.zeros(2, 8, h, D)  # uniform attention: every probability is 1/s
    k = torch.zeros(2, s, h, D)
    v = torch.ones(2, s, h, D)
    dpa = DotProductAttention(h, D, qkv_format="bshd", attn_mask_type="no_mask", attention_dropout=p)
    torch.manual_seed(0)
    out = dpa(q, k, v)  # whichever backend runs (fused under the interpreter/GPU, else unfused)
    # Each output is (kept count) / (s (1 - p)): mean 1, and the kept fraction is about 1 - p.
    kept = out * s * (1 - p)
    assert abs(out.mean().item() - 1.0) < 0.02
    assert abs(kept.mean().item() / s - (1 - p)) < 0.02
    torch.manual_seed(0)
    assert torch.equal(dpa(q, k, v), out)  # same seed, same mask
    assert not torch.equal(dpa(q, k, v), out)
    dpa.eval()
    assert torch.equal(dpa(q, k, v), torch.ones_like(out))  # no dropout in eval mode
    tracker = _FakeTracker(5)
    tracked = DotProductAttention(h, D, qkv_format="bshd", attn_mask_type="no_mask", attention_dropout=p,
                                  get_rng_state_tracker=lambda: tracker)
    torch.manual_seed(0)
    first = tracked(q, k, v)
    assert tracker.forks == 1
    tracker2 = _FakeTracker(5)
    tracked.get_rng_state_tracker = lambda: tracker2
    torch.manual_seed(1)  # the global seed does not matter: the tracker's does
    assert torch.equal(tracked(q, k, v), first)


def test_checkpoint_core_attention_same_gradients():
    q, k, v = make_qkv("bshd", 2, 12, 12, 2, 1, D, D, torch.float32, seed=19)
    dpa = DotProductAttention(2, D, num_gqa_groups=1, qkv_format="bshd", attn_mask_type="causal")
    plain = torch.autograd.grad(dpa(q, k, v).square().sum(), (q, k, v))
    ckpt = torch.autograd.grad(dpa(q, k, v, checkpoint_core_attention=True).square().sum(), (q, k, v))
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


# -- bad input ---------------------------------------------------------------------------------------


def _inputs(fmt="bshd", dtype=torch.float32):
    shapes = {"bshd": [(2, 6, 4, 16), (2, 6, 2, 16)], "sbhd": [(6, 2, 4, 16), (6, 2, 2, 16)],
              "thd": [(12, 4, 16), (12, 2, 16)]}[fmt]
    return torch.randn(shapes[0], dtype=dtype), torch.randn(shapes[1], dtype=dtype), torch.randn(shapes[1], dtype=dtype)


CU = torch.tensor([0, 5, 12], dtype=torch.int32)  # thd: 12 tokens in 2 sequences
CU6 = torch.tensor([0, 4, 10], dtype=torch.int32)  # bshd/sbhd with s = 6: lengths 4 and 6
BAD_FORWARD = [
    (dict(qkv_format="bhsd"), "qkv_format"),
    (dict(attn_mask_type="sliding"), "attn_mask_type"),
    (dict(core_attention_bias_type="gaussian"), "core_attention_bias_type"),
    (dict(window_size=(3, 2), attn_mask_type="causal"), "window_size"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(attn_mask_type="arbitrary"), "attention_mask"),
    (dict(attn_mask_type="arbitrary", attention_mask=torch.zeros(2, 1, 6, 6)), "attention_mask"),
    (dict(attn_mask_type="arbitrary", attention_mask=torch.zeros(2, 3, 6, 6, dtype=torch.bool)), "attention_mask"),
    (dict(attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool)), "attention_mask"),
    (dict(attn_mask_type="padding", attention_mask=torch.tensor([[1, 0, 0, 0, 0, 0]] * 2, dtype=torch.bool)),
     "attention_mask"),
    # A [b, 1, s, s] mask (Megatron's causal mask) with a padding type: refused by shape, not misread.
    (dict(attn_mask_type="padding_causal", attention_mask=torch.ones(2, 1, 6, 6, dtype=torch.bool).triu(1)),
     r"attention_mask.*\[2, 1, 1, 6\].*\(2, 1, 6, 6\)"),
    (dict(attn_mask_type="padding", attention_mask=torch.zeros(2, 1, 1, 6)), "attention_mask.*bool"),
    (dict(attn_mask_type="padding", cu_seqlens_q=CU.long(), cu_seqlens_kv=CU.long()), "cu_seqlens_q"),
    (dict(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
          cu_seqlens_kv=torch.tensor([0, 6], dtype=torch.int32)), "cu_seqlens_q"),
    (dict(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)), "cu_seqlens_kv"),
    (dict(core_attention_bias_type="post_scale_bias"), "core_attention_bias"),
    (dict(core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(2, 4, 6)),
     "core_attention_bias"),
    (dict(core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(3, 4, 6, 6)),
     "core_attention_bias"),
    (dict(core_attention_bias=torch.zeros(1, 4, 6, 6)), "core_attention_bias"),
    (dict(core_attention_bias_type="alibi", alibi_slopes=torch.zeros(3)), "alibi_slopes"),
    (dict(alibi_slopes=torch.zeros(4)), "alibi_slopes"),
]


@pytest.mark.parametrize("kwargs,argument", BAD_FORWARD, ids=lambda x: x if isinstance(x, str) else None)
def test_bad_forward_arguments_raise_value_error(kwargs, argument):
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    with pytest.raises(ValueError, match=argument):
        dpa(*_inputs(), **kwargs)


def _causal_mask(b, s):
    """[b, 1, s, s] bool, True above the diagonal: the causal mask Megatron's GPT dataset builds."""
    return torch.ones(b, 1, s, s, dtype=torch.bool, device=DEVICE).triu(1)


@pytest.mark.parametrize("backend,fmt,mask", grid("backend,fmt,mask", BACKENDS[::-1], ["bshd", "sbhd", "thd"],
                                                  ["no_mask", "causal", "causal_bottom_right"]))
def test_non_padding_masks_ignore_attention_mask(monkeypatch, backend, fmt, mask):
    """As in TransformerEngine, the mask type decides: no_mask and the causal types ignore attention_mask,
    whatever it holds (Megatron passes its [b, 1, s, s] causal mask with attn_mask_type='causal')."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = LOWP_DTYPES[0] if backend == "fused" else torch.float32
    b, s = 2, 11
    shape = {"bshd": (b, s), "sbhd": (s, b), "thd": (b * s,)}[fmt]
    g = gen(23)
    q = randn(shape + (4, 16), dtype, g)
    k, v = randn(shape + (2, 16), dtype, g), randn(shape + (2, 16), dtype, g)
    fwd = {}
    if fmt == "thd":
        fwd = dict(cu_seqlens_q=cu_seqlens([s, s]), cu_seqlens_kv=cu_seqlens([s, s]), max_seqlen_q=s,
                   max_seqlen_kv=s)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask)
    d_out = randn(q.shape[:-2] + (64,), dtype, gen(24), requires_grad=False)
    results = []
    for attention_mask in (None, _causal_mask(b, s), ~_causal_mask(b, s), torch.zeros(3, 5)):
        out = dpa(q, k, v, attention_mask=attention_mask, **fwd)
        results.append([out] + list(torch.autograd.grad(out, (q, k, v), d_out)))
    assert dpa.last_backend == {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}[backend]
    for other in results[1:]:
        for a, r in zip(other, results[0]):
            assert torch.equal(a, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_arbitrary_masks_still_use_attention_mask(monkeypatch, backend):
    """The padding types read attention_mask (as cu_seqlens) and 'arbitrary' applies it: same results as
    the cu_seqlens call / the reference with the mask, and different from the call without it."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = LOWP_DTYPES[0] if backend == "fused" else torch.float32
    b, s, lens = 2, 11, [7, 11]
    q, k, v = make_qkv("bshd", b, s, s, 4, 2, 16, 16, dtype, seed=25)
    pad = (torch.arange(s, device=DEVICE)[None, :] >= torch.tensor(lens, device=DEVICE)[:, None])[:, None, None]
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding_causal")
    by_mask = dpa(q, k, v, attention_mask=pad)
    by_cu = dpa(q, k, v, cu_seqlens_q=cu_seqlens(lens), cu_seqlens_kv=cu_seqlens(lens))
    assert torch.equal(by_mask, by_cu)
    assert not torch.equal(by_mask, dpa(q, k, v))
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")  # the fused kernels take no arbitrary mask
    arbitrary = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="arbitrary")
    hidden = _causal_mask(b, s)
    out = arbitrary(q, k, v, attention_mask=hidden).view(b, s, 4, 16)
    torch.testing.assert_close(out.double(), reference(q, k, v, "causal", scale=0.25),
                               atol=1e-3 if dtype == torch.float16 else 1e-5, rtol=0)
    assert not torch.equal(out, arbitrary(q, k, v, attention_mask=~hidden).view(b, s, 4, 16))


def test_bad_tensors_raise_value_error():
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="query_layer"):
        dpa(q[0], k, v)  # 3-D for bshd
    with pytest.raises(ValueError, match="query_layer"):
        dpa(torch.randn(2, 6, 3, 16), k, v)  # wrong head count
    with pytest.raises(ValueError, match="key_layer"):
        dpa(q, torch.randn(2, 6, 2, 8), v)  # wrong head dim
    with pytest.raises(ValueError, match="dtype"):
        dpa(q, k.half(), v)
    with pytest.raises(ValueError, match="query_layer"):
        dpa(q.int(), k, v)
    with pytest.raises(ValueError, match="batch"):
        dpa(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="sequence length"):
        dpa(q, k, v[:, :5])
    thd = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        thd(*_inputs("thd"))
    with pytest.raises(ValueError, match="attention_mask"):
        thd(*_inputs("thd"), cu_seqlens_q=CU, cu_seqlens_kv=CU, attention_mask=torch.zeros(2, 1, 1, 6, dtype=torch.bool))


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(kv_channels=(16,)), "kv_channels"),
        (dict(kv_channels=-16), "kv_channels"),
        (dict(num_gqa_groups=3), "num_gqa_groups"),
        (dict(tp_size=3), "tp_size"),
        (dict(attention_dropout=1.0), "attention_dropout"),
        (dict(attention_type="encoder"), "attention_type"),
        (dict(qkv_format="bsd"), "qkv_format"),
        (dict(attn_mask_type="full"), "attn_mask_type"),
        (dict(attn_mask_type="causal", window_size=(2, 2)), "window_size"),
        (dict(softmax_type="off_by_two"), "softmax_type"),
    ],
)
def test_bad_constructor_arguments_raise_value_error(kwargs, argument):
    base = dict(num_attention_heads=4, kv_channels=16)
    with pytest.raises(ValueError, match=argument):
        DotProductAttention(**{**base, **kwargs})


def test_unsupported_features_raise_not_implemented():
    # Context parallelism is supported (test_context_parallel.py); a group without torch.distributed is not one.
    with pytest.raises(ValueError, match="`cp_group` must be a group of an initialized torch.distributed"):
        DotProductAttention(4, 16, cp_group=object())
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd")
    with pytest.raises(NotImplementedError, match="FP8"):
        dpa(*_inputs(), fp8_output=True)
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(NotImplementedError, match="FP8"):
            dpa(*(t.to(torch.float8_e4m3fn) for t in _inputs()))
    thd = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="thd", attn_mask_type="arbitrary")
    with pytest.raises(NotImplementedError, match="arbitrary"):
        thd(*_inputs("thd"), cu_seqlens_q=CU, cu_seqlens_kv=CU)


# -- backend selection and its reasons ---------------------------------------------------------------


def _config_on(monkeypatch, dtype="float16", capability=(9, 0), **kwargs):
    """An AttnConfig for a (pretend) CUDA device of the given compute capability, via the frontend."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    metas = [dpa_module._TensorMeta(s, dtype, "cuda") for s in ((2, 128, 8, 64), (2, 128, 2, 64), (2, 128, 2, 64))]
    return attn_testing.attn_config(*metas, qkv_format="bshd", **kwargs)


def test_selection_with_flash_attention_absent(monkeypatch):
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: "flash-attn-4 is not installed (test)")
    selection = attn_backends.select(_config_on(monkeypatch, attn_mask_type="causal"))
    assert selection.name == "FusedAttention"
    assert any("flash-attn-4 is not installed (test)" in r for r in selection.rejected["FlashAttention"])


def test_selection_with_flash_attention_present(monkeypatch):
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: None)
    # As once flash-attn-4's deterministic mode has passed the invariance tests on Hopper.
    monkeypatch.setattr(FlashAttention, "DETERMINISTIC_INVARIANT_ARCHS", frozenset({9}))
    assert attn_backends.select(_config_on(monkeypatch, attn_mask_type="causal")).name == "FlashAttention"
    assert attn_backends.select(_config_on(monkeypatch, attn_mask_type="causal", deterministic=True)).name == \
        "FlashAttention"
    # Where flash-attn-4 cannot run, the next backend runs and the reasons say why.
    sel = attn_backends.select(_config_on(monkeypatch, dtype="float32"))
    assert sel.name == "FusedAttention"
    assert any("dtype=float32" in r for r in sel.rejected["FlashAttention"])
    sel = attn_backends.select(_config_on(monkeypatch, capability=(8, 0)))
    assert sel.name == "FusedAttention"
    assert any("compute capability" in r for r in sel.rejected["FlashAttention"])
    sel = attn_backends.select(_config_on(monkeypatch, dropout=0.1))
    assert sel.name == "FusedAttention"  # our kernels have dropout; flash-attn-4 has not
    assert any("dropout" in r for r in sel.rejected["FlashAttention"])
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    sel = attn_backends.select(_config_on(monkeypatch))
    assert sel.name == "FusedAttention"
    assert sel.rejected["FlashAttention"] == ["disabled by NVTE_FLASH_ATTN=0"]


class _FakeFused:
    """Stands in for the fused runner (so selection tests need no kernels): records calls, runs unfused math."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(FusedAttentionBackend, "run", staticmethod(self))
        # Make the fused backend available to selection on a CPU without the interpreter, and keep
        # flash-attn-4 (if installed on a GPU machine) out of the way.
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setenv("NVTE_FLASH_ATTN", "0")

    def __call__(self, q, k, v, call):
        p = call.params
        self.calls.append(dict(deterministic=p.deterministic, mask=p.attn_mask_type.value, window=p.window_size))
        return UnfusedAttentionBackend.run(q, k, v, call)


def test_env_switches_read_at_call_time(monkeypatch):
    fake = _FakeFused(monkeypatch)
    spy = SelectionSpy(monkeypatch)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = _inputs(dtype=torch.float16)
    dpa(q, k, v)
    assert dpa.last_backend == "FusedAttention" and len(fake.calls) == 1
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")  # the next call, same module, switches
    dpa(q, k, v)
    assert dpa.last_backend == "UnfusedDotProductAttention" and len(fake.calls) == 1
    assert spy.rejected()["FusedAttention"] == ["disabled by NVTE_FUSED_ATTN=0"]
    monkeypatch.delenv("NVTE_FUSED_ATTN")
    dpa(q, k, v)
    assert dpa.last_backend == "FusedAttention" and len(fake.calls) == 2
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "unfused")
    dpa(q, k, v)
    assert dpa.last_backend == "UnfusedDotProductAttention"
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    with pytest.raises(NoBackendError, match="NVTE_UNFUSED_ATTN=0"):
        dpa(q, k, v)


@pytest.mark.parametrize(
    "forced,kwargs,reason",
    [
        ("fused", dict(attn_mask_type="arbitrary", attention_mask=torch.zeros(1, 1, 6, 6, dtype=torch.bool)),
         "attn_mask_type=arbitrary"),
        ("fused", dict(core_attention_bias_type="pre_scale_bias", core_attention_bias=torch.zeros(1, 4, 6, 6)),
         "attn_bias_type=pre_scale_bias"),
        ("flash", dict(), "FlashAttention"),
    ],
)
def test_forcing_a_backend_that_cannot_run_raises_with_reasons(monkeypatch, forced, kwargs, reason):
    _FakeFused(monkeypatch)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", forced)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, v = _inputs(dtype=torch.float16)
    kwargs = {key: (val.half() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
              for key, val in kwargs.items()}
    with pytest.raises(NoBackendError, match=reason) as info:
        dpa(q, k, v, **kwargs)
    assert "was forced" in str(info.value)


def test_forcing_flash_with_dropout_raises(monkeypatch):
    _FakeFused(monkeypatch)
    monkeypatch.setattr(flash_backend, "unavailable_reason", lambda: None)
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", "flash")
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attention_dropout=0.1)
    with pytest.raises(NoBackendError, match="dropout"):
        dpa(*_inputs(dtype=torch.float16))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def te_records():
    handler = _Records()
    logger = logging.getLogger("transformer_engine")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


def test_debug_logging_from_selection(monkeypatch, te_records):
    _FakeFused(monkeypatch)
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    dpa(*_inputs(dtype=torch.float16))
    messages = [r.getMessage() for r in te_records]
    assert any(m.startswith("Running with config") for m in messages)
    assert any("Disabling FlashAttention" in m and "NVTE_FLASH_ATTN=0" in m for m in messages)
    assert any(m == "Selected backend = FusedAttention" for m in messages)
    te_records.clear()
    monkeypatch.setenv("NVTE_DEBUG", "0")  # read at the next call too
    dpa(*_inputs(dtype=torch.float16))
    assert not [r for r in te_records if r.levelno < logging.WARNING]


# -- determinism is read at every call -----------------------------------------------------------------


def test_torch_deterministic_flag_read_at_call_time(monkeypatch):
    fake = _FakeFused(monkeypatch)
    spy = SelectionSpy(monkeypatch)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = _inputs(dtype=torch.float16)
    with deterministic_algorithms(False):
        dpa(q, k, v)
        with deterministic_algorithms(True):  # toggled after the module was built
            dpa(q, k, v)
        dpa(q, k, v)
    assert [c.deterministic for c in spy.configs] == [False, True, False]
    assert [c["deterministic"] for c in fake.calls] == [False, True, False]
    # Deterministic training keeps the fused backend.
    assert spy.names == ["FusedAttention"] * 3


def test_nondeterministic_algo_env_read_at_call_time(monkeypatch):
    fake = _FakeFused(monkeypatch)
    spy = SelectionSpy(monkeypatch)
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = _inputs(dtype=torch.float16)
    dpa(q, k, v)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dpa(q, k, v)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    dpa(q, k, v)
    assert [c.deterministic for c in spy.configs] == [False, True, False]
    assert [c["deterministic"] for c in fake.calls] == [False, True, False]


def test_deterministic_fallback_warns_once(monkeypatch, te_records):
    _FakeFused(monkeypatch)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    pre_scale = dict(core_attention_bias_type="pre_scale_bias", core_attention_bias=torch.zeros(1, 4, 6, 6))
    for _ in range(3):  # fused has no pre-scale bias: unfused runs
        dpa(*_inputs(dtype=torch.float16), **{k: (v.half() if torch.is_tensor(v) else v) for k, v in pre_scale.items()})
        assert dpa.last_backend == "UnfusedDotProductAttention"
    warnings = [r.getMessage() for r in te_records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "Deterministic" in warnings[0] and "pre_scale_bias" in warnings[0]
    # Not deterministic: no warning.
    monkeypatch.setattr(te_log, "_warned_once", set())
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    te_records.clear()
    dpa(*_inputs(dtype=torch.float16), core_attention_bias_type="pre_scale_bias",
        core_attention_bias=torch.zeros(1, 4, 6, 6, dtype=torch.float16))
    assert not [r for r in te_records if r.levelno == logging.WARNING]


def test_selection_sees_the_call(monkeypatch):
    """The AttnConfig that reaches selection describes this call: layout, mask, window, bias, dropout, sizes."""
    spy = SelectionSpy(monkeypatch)
    dpa = DotProductAttention(4, (16, 8), num_gqa_groups=2, qkv_format="sbhd", attn_mask_type="padding_causal",
                              window_size=(3, 0))
    q, k = torch.randn(6, 2, 4, 16), torch.randn(6, 2, 2, 16)
    base = torch.randn(6, 2, 2, 2, 8)
    dpa(q, k, base[:, :, 0], cu_seqlens_q=CU6, cu_seqlens_kv=CU6, core_attention_bias_type="post_scale_bias",
        core_attention_bias=torch.zeros(1, 4, 6, 6))
    c = spy.configs[-1]
    assert (c.batch_size, c.num_heads_q, c.num_heads_kv, c.head_dim_qk, c.head_dim_v) == (2, 4, 2, 16, 8)
    assert (c.max_seqlen_q, c.max_seqlen_kv, c.dtype) == (6, 6, "float32")
    assert c.qkv_layout.value == "sbhd_sbhd_sbhd" and c.attn_mask_type.value == "padding_causal"
    assert c.window_size == (3, 0) and c.attn_bias_type.value == "post_scale_bias" and c.bias_shape == "1hss"
    assert c.is_training and c.dropout_probability == 0.0
    dpa.eval()
    dpa(q, k, base[:, :, 0], cu_seqlens_q=CU6, cu_seqlens_kv=CU6)
    assert not spy.configs[-1].is_training
    assert math.isclose(dpa.softmax_scale, 16 ** -0.5)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_selection_and_the_backend_read_one_params_value(monkeypatch, backend):
    """One AttnParams per call: the AttnConfig that selection reads holds the very value the chosen backend runs
    (no second description of the call's scalars), with the module's max-logit request and dropout in it."""
    from transformer_engine.pytorch.attention import backends as pt_backends

    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    spy = SelectionSpy(monkeypatch)
    ran = []
    for cls in pt_backends.BACKENDS:
        monkeypatch.setattr(cls, "run", staticmethod(
            lambda q, k, v, call, _run=cls.run: (ran.append(call.params), _run(q, k, v, call))[1]))
    dpa = DotProductAttention(2, 16, attention_dropout=0.25, attn_mask_type="causal", window_size=(3, 0),
                              return_max_logit=True).eval()
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in range(3))
    out, max_logit = dpa(q, k, v)
    assert len(spy.configs) == len(ran) == 1 and ran[0] is spy.configs[0].params
    p = ran[0]
    assert (p.window_size, p.return_max_logit, p.dropout_probability, p.is_training) == ((3, 0), True, 0.25, False)
    assert p.kernel_dropout == 0.0 and spy.configs[0].plan_key.kernel_dropout == 0.0
    assert out.shape == (1, 8, 32) and max_logit.shape == (2,)


def test_pytorch_backends_are_the_registry_with_runners():
    """The PyTorch backends are the common registry's PyTorch backends, in its order, each with its runner."""
    from transformer_engine.common.attention.backends import backends_for

    common = backends_for("pytorch")
    assert [b.NAME for b in attn_backends.BACKENDS] == [b.NAME for b in common]
    for frontend, base in zip(attn_backends.BACKENDS, common):
        assert issubclass(frontend, base) and callable(frontend.run)
        assert attn_backends.backend_named(base.SHORT_NAME) is frontend


def test_unfused_supports_double_backward():
    """The way out the fused backend's double-backward error names: the unfused math has second-order
    gradients (checked numerically in fp64)."""
    from transformer_engine.pytorch.attention.unfused import unfused_attention

    g = gen(41)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
               for shape in ((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4)))
    assert torch.autograd.gradgradcheck(
        lambda q_, k_, v_: unfused_attention(q_, k_, v_, "bshd", "causal_bottom_right", None, 0.4), (q, k, v))
