"""Sink softmax (``off-by-one``, ``learnable``): fused kernels and the unfused path against an fp64
reference, its gradient for ``softmax_offset``, and determinism (bitwise repeats, batch and packing
invariance) of the fused path.

The reference below states the definition directly: per sequence, softmax over the visible keys
plus one sink logit (0 or ``softmax_offset[h]``) that has no value vector. Errors are judged
against the same math in the inputs' dtype (``assert_close_to_reference``).
"""

from __future__ import annotations

import pytest
import torch

from dpa_helpers import (
    DEVICE,
    SelectionSpy,
    assert_close_to_reference,
    cu_seqlens,
    deterministic_algorithms,
    gen,
    requires_fused,
    visible,
)
from fused_helpers import DTYPES
from transformer_engine.common.attention import AttnConfig, AttnSoftmaxType, FlashAttention, FusedAttention
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import kernel_runner
from te_torch_testing import dropout_keep_mask
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func
from transformer_engine.pytorch.attention.unfused import unfused_attention

S = 24  # small: the fused kernels run under Triton's interpreter on the CPU
SCALE = 0.3


def sink_reference(q, k, v, sink, mask="no_mask", window=(-1, -1), lens_q=None, lens_kv=None, keep=None,
                   dropout_p=0.0, dtype=torch.float64):
    """[b, sq, h, dv] in ``dtype``: padded bshd q/k/v, ``sink`` [h] logits; rows past a length are zero.
    ``keep``: bool [b, h, sq, skv] dropout mask (kept probabilities are scaled by 1 / (1 - dropout_p))."""
    b, sq, h, _ = q.shape
    skv, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    outs = []
    for n in range(b):
        lq = lens_q[n] if lens_q is not None else sq
        lk = lens_kv[n] if lens_kv is not None else skv
        qi = q[n, :lq].to(dtype)
        ki = k[n, :lk].to(dtype).repeat_interleave(h // hk, dim=1)
        vi = v[n, :lk].to(dtype).repeat_interleave(h // hk, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * SCALE
        s = s.masked_fill(~visible(lq, lk, mask, window).to(s.device), float("-inf"))
        column = sink.to(dtype).view(h, 1, 1).expand(h, lq, 1)
        p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
        if keep is not None:
            p = p * keep[n][:, :lq, :lk].to(dtype) / (1.0 - dropout_p)
        o = torch.einsum("hqk,khd->qhd", p, vi)
        outs.append(torch.cat([o, o.new_zeros(sq - lq, h, dv)], dim=0))
    return torch.stack(outs)


def _sink(softmax_type, h, seed=3):
    if softmax_type == "off-by-one":
        return None, torch.zeros(h, dtype=torch.float64, device=DEVICE)
    offset = (torch.randn(h, generator=gen(seed)) * 1.5).to(DEVICE).requires_grad_()
    return offset, offset.detach().double()


def _qkv(b, sq, skv, h, hk, d, dtype, seed=0):
    g = gen(seed)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_()
            for shape in ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, d))]


def _check_against_reference(q, k, v, offset, sink64, out, grads, d_out, **ref_kwargs):
    """out, dq, dk, dv (and d softmax_offset when learnable) within twice the inputs' dtype's own error."""
    leaves = [q, k, v] + ([offset] if offset is not None else [])
    results = []
    for dtype in (torch.float64, q.dtype):
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
        sink = ref_leaves[3] if offset is not None else sink64.to(dtype)
        o = sink_reference(*ref_leaves[:3], sink, dtype=dtype, **ref_kwargs)
        results.append([o] + list(torch.autograd.grad(o, ref_leaves, d_out.to(dtype))))
    names = ("out", "dq", "dk", "dv", "d_softmax_offset")
    for name, ours, ref, lowp in zip(names, [out] + list(grads), *results):
        assert_close_to_reference(name, ours, ref, lowp)


def _fused(q, k, v, softmax_type, offset, mask="no_mask", window=(-1, -1), deterministic=True, **kwargs):
    out = fused_attn_func(q, k, v, kwargs.pop("fmt", "bshd"), mask, window, SCALE, deterministic=deterministic,
                          softmax_type=softmax_type, softmax_offset=offset, **kwargs)
    d_out = torch.randn(out.shape, generator=gen(1)).to(out.device, out.dtype)
    leaves = [q, k, v] + ([offset] if offset is not None else [])
    return out, torch.autograd.grad(out, leaves, d_out), d_out


# -- fused kernels against the reference ---------------------------------------------------------


@requires_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("mask,heads", [("no_mask", (4, 4)), ("causal", (4, 2))], ids=["nomask-mha", "causal-gqa"])
def test_fused_matches_reference(dtype, softmax_type, mask, heads):
    h, hk = heads
    q, k, v = _qkv(2, S + 5, S + 5, h, hk, 16, dtype)
    offset, sink64 = _sink(softmax_type, h)
    out, grads, d_out = _fused(q, k, v, softmax_type, offset, mask)
    _check_against_reference(q, k, v, offset, sink64, out, grads, d_out, mask=mask)


@requires_fused
def test_fused_padding_window_and_rows_without_keys():
    """padding_causal_bottom_right with s_q > s_kv: the first rows of a sequence see no key; with a sink
    they output zeros and give zero gradients (their share of d softmax_offset is zero too)."""
    dtype = DTYPES[0]
    lens_q, lens_kv = [S + 6, S - 3], [S - 4, S - 9]
    q, k, v = _qkv(2, S + 6, S, 4, 1, 24, dtype, seed=4)
    offset, sink64 = _sink("learnable", 4)
    out, grads, d_out = _fused(q, k, v, "learnable", offset, "padding_causal_bottom_right", (7, 0),
                               cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    blind = lens_q[0] - lens_kv[0]
    assert torch.equal(out[0, :blind], torch.zeros_like(out[0, :blind]))
    assert torch.equal(grads[0][0, :blind], torch.zeros_like(grads[0][0, :blind]))
    _check_against_reference(q, k, v, offset, sink64, out, grads, d_out, mask="padding_causal_bottom_right",
                             window=(7, 0), lens_q=lens_q, lens_kv=lens_kv)


@requires_fused
def test_fused_thd_gqa_matches_padded_reference():
    dtype = DTYPES[0]
    lens_q, lens_kv = [S - 3, 5, S], [S, 9, S - 6]
    h, hk, d = 4, 2, 16
    g = gen(7)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(sum(lens_kv), hk, d, generator=g).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(sum(lens_kv), hk, d, generator=g).to(DEVICE, dtype).requires_grad_()
    offset, sink64 = _sink("learnable", h)
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_kv)
    out, grads, d_out = _fused(q, k, v, "learnable", offset, "padding_causal", fmt="thd", cu_seqlens_q=cq,
                               cu_seqlens_kv=ck)
    # The same sequences padded: the reference runs on them, the fused results are scattered back.
    def pad(t, lens, cu):
        rows = [torch.cat([t[cu[i]:cu[i + 1]], t.new_zeros((max(lens) - lens[i],) + t.shape[1:])])
                for i in range(len(lens))]
        return torch.stack(rows)

    qp, kp, vp = (pad(t.detach(), ln, cu).requires_grad_() for t, ln, cu in
                  ((q, lens_q, cq), (k, lens_kv, ck), (v, lens_kv, ck)))
    ours = [pad(out, lens_q, cq), pad(grads[0], lens_q, cq), pad(grads[1], lens_kv, ck), pad(grads[2], lens_kv, ck),
            grads[3]]
    _check_against_reference(qp, kp, vp, offset, sink64, ours[0], ours[1:], pad(d_out, lens_q, cq),
                             mask="padding_causal", lens_q=lens_q, lens_kv=lens_kv)


@requires_fused
def test_fused_dropout_normalises_with_the_sink():
    """Dropout drops the keys' probabilities after the sink took its share of the normaliser."""
    dtype = DTYPES[0]
    q, k, v = _qkv(1, S, S, 2, 2, 16, dtype, seed=5)
    offset, sink64 = _sink("learnable", 2)
    rng_state = torch.tensor([1234, 0], dtype=torch.int64, device=DEVICE)
    out, grads, d_out = _fused(q, k, v, "learnable", offset, "causal", dropout_p=0.25, rng_state=rng_state)
    keep = dropout_keep_mask(rng_state, 1, 2, S, S, 0.25)
    _check_against_reference(q, k, v, offset, sink64, out, grads, d_out, mask="causal", keep=keep, dropout_p=0.25)


@requires_fused
def test_off_by_one_is_a_zero_learnable_sink_bitwise():
    q, k, v = _qkv(2, S, S, 2, 1, 16, DTYPES[0], seed=6)
    a = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="off-by-one")
    zero = torch.zeros(2, dtype=torch.float32, device=DEVICE)
    b = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="learnable", softmax_offset=zero)
    vanilla = fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE)
    assert torch.equal(a, b)
    assert not torch.equal(a, vanilla)


# -- determinism of the fused path -----------------------------------------------------------------


def _parts_run(seqs, offset, mask="padding_causal"):
    """(out, dq, dk, dv, d_offset) of one padded bshd batch made of ``seqs`` (each (q, k, v, d_out) of
    one sequence with its own length), deterministic mode."""
    lens = [s[0].shape[0] for s in seqs]
    smax = max(lens)

    def stack(i):
        return torch.stack([torch.cat([s[i], s[i].new_zeros((smax - s[i].shape[0],) + s[i].shape[1:])])
                            for s in seqs]).requires_grad_(i < 3)

    q, k, v, d_out = (stack(i) for i in range(4))
    off = offset.detach().clone().requires_grad_()
    cu = cu_seqlens(lens)
    out = fused_attn_func(q, k, v, "bshd", mask, (-1, -1), SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          deterministic=True, softmax_type="learnable", softmax_offset=off)
    grads = torch.autograd.grad(out, (q, k, v, off), d_out)
    return (out,) + grads, lens


def _sequences(lens, h=4, hk=2, d=16, dtype=None, seed=11):
    g = gen(seed)
    dtype = dtype or DTYPES[0]
    return [tuple(torch.randn(n, heads, d, generator=g).to(DEVICE, dtype) for heads in (h, hk, hk, h))
            for n in lens]


@requires_fused
def test_deterministic_sink_gradients_are_bitwise_repeatable_and_batch_invariant():
    offset = (torch.randn(4, generator=gen(12))).to(DEVICE)
    seqs = _sequences([S - 1, 9, S + 3])
    full, lens = _parts_run(seqs, offset)
    again, _ = _parts_run(seqs, offset)
    for a, b in zip(full, again):
        assert torch.equal(a, b)
    # Each sequence alone: the same out/dq/dk/dv rows, and its own part of d softmax_offset ...
    parts = []
    for i, seq in enumerate(seqs):
        alone, _ = _parts_run([seq], offset)
        n = lens[i]
        for a, b in zip(alone[:4], full[:4]):
            if a.shape[1] == n:  # q-side and kv-side tensors alike have the sequence's own length
                assert torch.equal(a[0, :n], b[i, :n])
        parts.append(alone[4])
    # ... and the batch's d softmax_offset is the documented fixed-order sum of those parts, bit for bit.
    assert torch.equal(full[4], kernel_runner.fixed_order_sum(torch.stack(parts)))
    assert not torch.equal(full[4], parts[0])


@requires_fused
def test_deterministic_sink_thd_equals_padded_bitwise():
    offset = (torch.randn(4, generator=gen(13))).to(DEVICE)
    seqs = _sequences([S - 5, 7, S])
    padded, lens = _parts_run(seqs, offset)
    cu = cu_seqlens(lens)
    q, k, v, d_out = (torch.cat([s[i] for s in seqs]).requires_grad_(i < 3) for i in range(4))
    off = offset.detach().clone().requires_grad_()
    out = fused_attn_func(q, k, v, "thd", "padding_causal", (-1, -1), SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          deterministic=True, softmax_type="learnable", softmax_offset=off)
    thd = (out,) + torch.autograd.grad(out, (q, k, v, off), d_out)
    for i, n in enumerate(lens):
        for a, b in zip(thd[:4], padded[:4]):
            assert torch.equal(a[int(cu[i]):int(cu[i + 1])], b[i, :n])
    assert torch.equal(thd[4], padded[4])


# -- unfused path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_unfused_matches_reference(softmax_type, fmt):
    dtype = torch.float16
    lens = [S, S - 7]
    h, hk = 4, 2
    q, k, v = _qkv(2, S, S, h, hk, 16, dtype, seed=8)
    offset, sink64 = _sink(softmax_type, h)
    cu = cu_seqlens(lens)
    if fmt == "thd":
        pack = [torch.cat([t.detach()[i, :n] for i, n in enumerate(lens)]).requires_grad_() for t in (q, k, v)]
        out = unfused_attention(*pack, "thd", "padding_causal", None, SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                softmax_type=softmax_type, softmax_offset=offset)
        d_out = torch.randn(out.shape, generator=gen(1)).to(DEVICE, dtype)
        grads = torch.autograd.grad(out, pack + ([offset] if offset is not None else []), d_out)

        def pad(t):
            return torch.stack([torch.cat([t[int(cu[i]):int(cu[i + 1])], t.new_zeros((S - n,) + t.shape[1:])])
                                for i, n in enumerate(lens)])

        out, d_out = pad(out), pad(d_out)
        grads = [pad(g) for g in grads[:3]] + list(grads[3:])
    else:
        out = unfused_attention(q, k, v, "bshd", "padding_causal", None, SCALE, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                softmax_type=softmax_type, softmax_offset=offset)
        d_out = torch.randn(out.shape, generator=gen(1)).to(DEVICE, dtype)
        grads = torch.autograd.grad(out, [q, k, v] + ([offset] if offset is not None else []), d_out)
    _check_against_reference(q, k, v, offset, sink64, out, grads, d_out, mask="padding_causal", lens_q=lens,
                             lens_kv=lens)


# -- DotProductAttention and selection ---------------------------------------------------------------


def test_dpa_owns_the_learnable_offset_as_transformer_engine_does():
    dpa = DotProductAttention(8, 16, num_gqa_groups=2, tp_size=2, softmax_type="learnable")
    params = dict(dpa.named_parameters())
    assert list(params) == ["softmax_offset"]
    offset = params["softmax_offset"]
    assert offset.shape == (4,) and offset.dtype == torch.float32 and torch.equal(offset, torch.zeros_like(offset))
    assert "softmax_offset" in dpa.state_dict()
    plain = DotProductAttention(8, 16, softmax_type="vanilla")
    assert list(plain.parameters()) == [] and plain.softmax_offset is None
    with pytest.raises(ValueError, match="softmax_type"):
        DotProductAttention(8, 16, softmax_type="sink")


def test_off_by_one_keeps_a_zero_offset_tensor_as_transformer_engine_does():
    """TransformerEngine keeps fp32 zeros [heads // tp] in ``softmax_offset`` for off-by-one: a plain tensor
    attribute (no parameter, no buffer, not in the state dict, not cast by .to()), whose requires_grad its
    tests set to read the sink's gradient."""
    dpa = DotProductAttention(8, 16, num_gqa_groups=2, tp_size=2, softmax_type="off-by-one")
    offset = dpa.softmax_offset
    assert isinstance(offset, torch.Tensor) and not isinstance(offset, torch.nn.Parameter)
    assert offset.shape == (4,) and offset.dtype == torch.float32 and not offset.requires_grad
    assert torch.equal(offset, torch.zeros_like(offset))
    # The state dict holds only the FP8 attention's extra state (empty: FP8 never ran), as TransformerEngine's.
    assert list(dpa.parameters()) == [] and list(dpa.buffers()) == [] and list(dpa.state_dict()) == ["_extra_state"]
    assert dpa.state_dict()["_extra_state"].numel() == 0
    dpa.to(torch.float16)
    assert dpa.softmax_offset is offset and offset.dtype == torch.float32


@pytest.mark.parametrize("backend", ["unfused", pytest.param("fused", marks=requires_fused)])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_off_by_one_offset_gradient_as_transformer_engine_tests_read_it(monkeypatch, backend, fmt):
    """``block.softmax_offset.requires_grad = True``, forward, backward, then ``block.softmax_offset.grad``
    (TransformerEngine's attention tests): the gradient of the zero sink logit, against the fp64 reference;
    the output and q, k, v gradients are those of off-by-one softmax. Without requires_grad nothing changes."""
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dtype = DTYPES[0] if backend == "fused" else torch.float16
    lens, h, hk = [S, S - 7], 4, 2
    q, k, v = _qkv(2, S, S, h, hk, 16, dtype, seed=21)
    block = DotProductAttention(h, 16, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type="padding_causal",
                                softmax_scale=SCALE, softmax_type="off-by-one").to(dtype)
    block.softmax_offset.requires_grad = True
    cu = cu_seqlens(lens)
    if fmt == "thd":
        inputs = [torch.cat([t.detach()[i, :n] for i, n in enumerate(lens)]).requires_grad_() for t in (q, k, v)]
    else:
        inputs = [q, k, v]
    out = block(*inputs, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
    assert block.last_backend == {"fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}[backend]
    out = out.view(*out.shape[:-1], h, 16)
    d_out = torch.randn(out.shape, generator=gen(22)).to(DEVICE, dtype)
    out.backward(d_out)
    d_offset = block.softmax_offset.grad
    assert d_offset is not None and d_offset.shape == (h,) and d_offset.dtype == torch.float32
    assert d_offset.abs().sum() > 0
    grads = [t.grad for t in inputs]
    if fmt == "thd":
        def pad(t):
            return torch.stack([torch.cat([t[int(cu[i]):int(cu[i + 1])], t.new_zeros((S - n,) + t.shape[1:])])
                                for i, n in enumerate(lens)])
        out, d_out, grads = pad(out), pad(d_out), [pad(g) for g in grads]
    # The reference differentiates the sink logit as a leaf of value 0.
    zero = torch.zeros(h, dtype=torch.float32, device=DEVICE, requires_grad=True)
    _check_against_reference(q, k, v, zero, None, out, grads + [d_offset], d_out, mask="padding_causal",
                             lens_q=lens, lens_kv=lens)
    plain = DotProductAttention(h, 16, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type="padding_causal",
                                softmax_scale=SCALE, softmax_type="off-by-one")
    again = plain(*[t.detach() for t in inputs], cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
    assert plain.softmax_offset.grad is None and not again.requires_grad


@requires_fused
def test_dpa_keeps_the_fused_backend_for_sinks_in_deterministic_mode(monkeypatch):
    monkeypatch.delenv("NVTE_FUSED_ATTN_BACKEND", raising=False)
    spy = SelectionSpy(monkeypatch)
    dtype = DTYPES[0]
    dpa = DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal",
                              softmax_type="learnable").to(DEVICE)
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.randn(4, generator=gen(14)))
    q, k, v = _qkv(2, S, S, 4, 2, 16, dtype, seed=9)
    with deterministic_algorithms(True):
        out = dpa(q, k, v)
        out.float().square().sum().backward()
    assert spy.names == ["FusedAttention"] and spy.configs[-1].deterministic
    assert spy.configs[-1].softmax_type == AttnSoftmaxType.LEARNABLE_SOFTMAX
    assert dpa.softmax_offset.grad is not None and dpa.softmax_offset.grad.abs().sum() > 0
    ref = unfused_attention(q, k, v, "bshd", "causal", None, dpa.softmax_scale, softmax_type="learnable",
                            softmax_offset=dpa.softmax_offset)
    torch.testing.assert_close(out, ref.flatten(-2), atol=2e-3, rtol=2e-3)


def test_flash_attention_refuses_sinks_and_fused_takes_them():
    for softmax_type in (AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, AttnSoftmaxType.LEARNABLE_SOFTMAX):
        cfg = AttnConfig.of(batch_size=2, num_heads_q=8, num_heads_kv=8, head_dim_qk=128, head_dim_v=128,
                         max_seqlen_q=1024, max_seqlen_kv=1024, dtype="bfloat16", softmax_type=softmax_type,
                         deterministic=True, device_type="cuda", compute_capability=(9, 0))
        assert any(f"softmax_type={softmax_type.value}" in r for r in FlashAttention.not_supported_reasons(cfg))
        assert not any("softmax_type" in r for r in FusedAttention.not_supported_reasons(cfg))


def test_softmax_type_and_offset_errors():
    q, k, v = _qkv(1, 8, 8, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="softmax_type"):
        fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="sink")
    with pytest.raises(ValueError, match="softmax_offset"):
        fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="learnable")
    with pytest.raises(ValueError, match="softmax_offset"):
        fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="learnable",
                        softmax_offset=torch.zeros(3))
    with pytest.raises(ValueError, match="softmax_offset"):
        fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="learnable",
                        softmax_offset=torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="softmax_offset"):
        fused_attn_func(q, k, v, "bshd", "causal", (-1, -1), SCALE, softmax_type="off-by-one",
                        softmax_offset=torch.zeros(2))
