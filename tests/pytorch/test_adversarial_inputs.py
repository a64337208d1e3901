"""Bad and edge inputs, handled alike on every PyTorch path: the unfused function, the fused function
(the Triton kernels; under TRITON_INTERPRET=1 on CPU, fp16/fp32 only) and DotProductAttention on each.

Each bad input must raise a ValueError (or NotImplementedError) naming the argument; each unusual
but valid one (softmax_scale 0 or negative, s = 0, NaN in padding, NaN inside a sequence) must give
the fp64 reference's answer. Property tests draw random valid configurations.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dpa_helpers import DEVICE, INTERPRET, ON_GPU, cu_seqlens, max_err, reference, requires_fused, requires_gpu
from transformer_engine.common.attention import AttnConfig, AttnMaskType
from transformer_engine.common.attention.validation import check_cu_seqlens_values
from transformer_engine.pytorch import DotProductAttention
from transformer_engine.pytorch.attention import backends as attn_backends
import te_torch_testing as attn_testing
from transformer_engine.pytorch.attention.fused_attn import fused_attn_func
from transformer_engine.pytorch.attention.unfused import unfused_attention

FUNCS = {
    "unfused": unfused_attention,
    "fused": pytest.param(fused_attn_func, marks=requires_fused),
}
# fp32 by default (the interpreter gets bf16 wrong); the NaN and scale tests also run at bf16 on the
# GPU, at head dims 64 (Triton kernels) and 128 (the Gluon kernels on Hopper), with longer sequences.
DTYPE = torch.float32
B, S, H, D = 2, 6, 2, 8


class Precision:
    """dtype, head dim and a length multiplier (sequences m times longer span several kernel blocks)."""

    def __init__(self, dtype, d, m):
        self.dtype, self.d, self.m, self.s = dtype, d, m, S * m

    def lens(self, lengths):
        return [n * self.m for n in lengths]

    def qkv(self, **kw):
        kw = dict(dict(sq=self.s, skv=self.s, d=self.d, dtype=self.dtype), **kw)
        return _qkv(**kw)

    def tolerances(self, ref, lowp):
        """fp32: a fixed bound. bf16: 2 x PyTorch's own bf16 error on the same inputs, plus 1e-3."""
        if self.dtype == torch.float32:
            return [2e-5] * len(ref)
        out = []
        for r, x in zip(ref, lowp):
            ok = ~torch.isnan(r) & ~torch.isnan(x)
            out.append(2 * max_err(x[ok], r[ok]) + 1e-3)
        return out


PRECISIONS = [pytest.param(Precision(torch.float32, D, 1), id="fp32"),
              pytest.param(Precision(torch.bfloat16, 64, 40), id="bf16-d64", marks=requires_gpu),
              pytest.param(Precision(torch.bfloat16, 128, 40), id="bf16-d128", marks=requires_gpu)]


def _qkv(b=B, sq=S, skv=S, h=H, hk=H, d=D, seed=0, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(DEVICE, dtype)
            for shape in ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, d))]


def _grads(fn, inputs, d_out=None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    d_out = torch.ones_like(out) if d_out is None else d_out
    return [out.detach()] + list(torch.autograd.grad(out, leaves, d_out))


def _assert_matches(ours, ref, atol=2e-5):
    atols = atol if isinstance(atol, list) else [atol] * len(ref)
    for i, (a, r, atol) in enumerate(zip(ours, ref, atols)):
        assert a.shape == r.shape, f"result {i}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        assert torch.equal(torch.isnan(a), torch.isnan(r)), f"result {i}: NaN pattern differs from the reference"
        ok = ~torch.isnan(r)
        err = (a.double()[ok] - r.double()[ok]).abs().max().item() if ok.any() else 0.0
        assert err <= atol, f"result {i}: max error {err:.3e} > {atol}"


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# -- the shared validator ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(cu_seqlens=[1, 3, 5]), "must start at 0"),
    (dict(cu_seqlens=[0, 4, 2]), "non-decreasing"),
    (dict(cu_seqlens=[0, -2, 3]), "non-decreasing"),
    (dict(cu_seqlens=[0, 3, 9], max_seqlen=5), "padded sequence length 5"),
    (dict(cu_seqlens=[0, 3, 9], max_seqlen=5, max_seqlen_arg="max_seqlen_q"), "`max_seqlen_q` must be at least"),
    (dict(cu_seqlens=[0, 3, 9], tokens=8), "last entry must equal the token count 8"),
    (dict(cu_seqlens=[0, 3, 5], padded=[0, 2, 6], tokens=8), "must not overlap"),
    (dict(cu_seqlens=[0, 3, 5], padded=[0, 4, 9], tokens=8), "within the token count 8"),
    (dict(cu_seqlens=[0, 3, 5], padded=[0, 4, 3], tokens=8), "non-decreasing"),
    (dict(cu_seqlens=[0, 3, 5], padded=[0, 4], tokens=8), "shape"),
])
def test_validator_rejects_bad_extents(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens_values("cu_seqlens_q", **kwargs)


def test_validator_accepts_empty_sequences_and_gaps():
    check_cu_seqlens_values("cu_seqlens_q", [0, 0, 3, 3], padded=[0, 1, 5, 7], tokens=8, max_seqlen=3,
                            max_seqlen_arg="max_seqlen_q")


# -- bad sequence arguments: the same error on every path -------------------------------------------


def _bshd_call(fn, cu_q, cu_kv=None):
    q, k, v = _qkv()
    return fn(q, k, v, "bshd", "padding", None, 0.3, cu_seqlens_q=_i32(cu_q),
              cu_seqlens_kv=_i32(cu_kv if cu_kv is not None else cu_q))


def _thd_call(fn, cu, pad=None, max_seqlen=None, tokens=8):
    q, k, v = (t[0] for t in _qkv(b=1, sq=tokens, skv=tokens))
    kw = dict(cu_seqlens_q=_i32(cu), cu_seqlens_kv=_i32(cu), max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    if pad is not None:
        kw.update(cu_seqlens_q_padded=_i32(pad), cu_seqlens_kv_padded=_i32(pad))
    return fn(q, k, v, "thd", "padding", None, 0.3, **kw)


BAD_SEQUENCES = {
    "non_monotone": (lambda fn: _bshd_call(fn, [0, 4, 2]), "`cu_seqlens_q` must be non-decreasing"),
    "negative_entry": (lambda fn: _bshd_call(fn, [0, 3, 5], [0, -1, 5]), "`cu_seqlens_kv` must be non-decreasing"),
    "length_beyond_padded": (lambda fn: _bshd_call(fn, [0, 3, 10]), "padded sequence length 6"),
    "last_beyond_tokens": (lambda fn: _thd_call(fn, [0, 3, 9]), "token count 8"),
    "padded_overlap": (lambda fn: _thd_call(fn, [0, 3, 6], pad=[0, 2, 8]), "must not overlap"),
    "max_seqlen_too_small": (lambda fn: _thd_call(fn, [0, 5, 8], max_seqlen=3), "`max_seqlen_q` must be at least"),
    "wrong_dtype": (lambda fn: fn(
        *_qkv(), "bshd", "padding", None, 0.3, cu_seqlens_q=torch.tensor([0, 3, 5]),
        cu_seqlens_kv=torch.tensor([0, 3, 5])), "`cu_seqlens_q` must be int32"),
}


@pytest.mark.parametrize("case", list(BAD_SEQUENCES))
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_bad_sequences_raise_on_every_function(fn, case):
    call, match = BAD_SEQUENCES[case]
    with pytest.raises(ValueError, match=match):
        call(fn)


@pytest.mark.parametrize("backend", ["unfused", pytest.param("fused", marks=requires_fused)])
def test_bad_sequences_raise_in_the_module(backend, monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN_BACKEND", backend)
    dpa = DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="`cu_seqlens_q` must be non-decreasing"):
        dpa(q, k, v, cu_seqlens_q=_i32([0, 4, 2]), cu_seqlens_kv=_i32([0, 4, 6]))
    dpa_thd = DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding")
    t = [x[0] for x in _qkv(b=1, sq=8, skv=8)]
    with pytest.raises(ValueError, match="`max_seqlen_q` must be at least"):
        dpa_thd(*t, cu_seqlens_q=_i32([0, 5, 8]), cu_seqlens_kv=_i32([0, 5, 8]), max_seqlen_q=3, max_seqlen_kv=5)


# -- softmax_scale -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), "0.1", None])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_non_finite_scale_is_a_value_error(fn, scale):
    with pytest.raises(ValueError, match="`softmax_scale` must be a finite number"):
        fn(*_qkv(), "bshd", "no_mask", None, scale)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_module_rejects_non_finite_scale(scale):
    with pytest.raises(ValueError, match="`softmax_scale` must be a finite number"):
        DotProductAttention(H, D, softmax_scale=scale)


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("scale", [0.0, -0.7, 0.35])
@pytest.mark.parametrize("mask", ["causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_zero_and_negative_scales_match_the_reference(fn, mask, scale, prec):
    lens_q, lens_kv = prec.lens([4, 6]), prec.lens([5, 3])
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv)) if "padding" in mask else {}
    lq, lk = (lens_q, lens_kv) if "padding" in mask else (None, None)
    inputs = prec.qkv(seed=3)
    ours = _grads(lambda q, k, v: fn(q, k, v, "bshd", mask, None, scale, **kw), inputs)

    def ref_in(dtype):
        return _grads(lambda q, k, v: reference(q, k, v, mask, scale=scale, lens_q=lq, lens_kv=lk, dtype=dtype),
                      [t.to(dtype) for t in inputs])
    ref = ref_in(torch.float64)
    _assert_matches(ours, ref, prec.tolerances(ref, ref_in(prec.dtype)))


# -- s = 0 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", ["s_q", "s_kv", "both"])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_zero_length_sequences(fn, empty):
    sq = 0 if empty in ("s_q", "both") else 5
    skv = 0 if empty in ("s_kv", "both") else 4
    inputs = _qkv(sq=sq, skv=skv)
    out, dq, dk, dv = _grads(lambda q, k, v: fn(q, k, v, "bshd", "no_mask", None, 0.3), inputs)
    assert out.shape == (B, sq, H, D)
    for t in (out, dq, dk, dv):  # no key: zero output and zero gradients; no query: nothing at all
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_thd_batch_of_empty_sequences(fn):
    q, k, v = (t[0] for t in _qkv(b=1, sq=4, skv=4))
    cu = _i32([0, 0, 0])
    out = fn(q, k, v, "thd", "padding", None, 0.3, cu_seqlens_q=cu, cu_seqlens_kv=cu,
             cu_seqlens_q_padded=_i32([0, 2, 4]), cu_seqlens_kv_padded=_i32([0, 2, 4]))
    assert torch.equal(out, torch.zeros_like(out))


# -- NaN in padding must not leak; NaN inside a sequence must not vanish ------------------------------


def _fill_padding(t, lengths, value):
    t = t.clone()
    for n, length in enumerate(lengths):
        t[n, length:] = value
    return t


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_nan_padding_bshd_contributes_nothing(fn, mask, prec):
    lens_q, lens_kv = prec.lens([4, 6]), prec.lens([3, 5])
    cu = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    q, k, v = prec.qkv(seed=5)
    d_out = torch.randn(B, prec.s, H, prec.d, generator=torch.Generator().manual_seed(6)).to(DEVICE, prec.dtype)
    call = lambda q_, k_, v_: fn(q_, k_, v_, "bshd", mask, None, 0.3, **cu)  # noqa: E731
    clean = _grads(call, [_fill_padding(q, lens_q, 0.0)] + [_fill_padding(t, lens_kv, 0.0) for t in (k, v)],
                   _fill_padding(d_out, lens_q, 0.0))
    dirty = _grads(call, [_fill_padding(q, lens_q, float("nan"))] + [_fill_padding(t, lens_kv, float("nan"))
                                                                     for t in (k, v)],
                   _fill_padding(d_out, lens_q, float("nan")))
    for name, a, b in zip(("out", "dq", "dk", "dv"), dirty, clean):
        assert torch.equal(a, b), f"{name}: NaN (or a different value) leaked from the padding"


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_nan_gaps_thd_contribute_nothing(fn, prec):
    m = prec.m
    lens, starts, tokens = [3 * m, 2 * m], [0, 5 * m, 8 * m], 9 * m  # gaps after each sequence
    q, k, v = (t[0] for t in prec.qkv(b=1, sq=tokens, skv=tokens, seed=7))
    gap = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    gap[0:lens[0]] = gap[starts[1]:starts[1] + lens[1]] = False
    kw = dict(cu_seqlens_q=cu_seqlens(lens), cu_seqlens_kv=cu_seqlens(lens), cu_seqlens_q_padded=_i32(starts),
              cu_seqlens_kv_padded=_i32(starts), max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    call = lambda q_, k_, v_: fn(q_, k_, v_, "thd", "padding_causal", None, 0.3, **kw)  # noqa: E731
    d_out = torch.ones(tokens, H, prec.d, device=DEVICE, dtype=prec.dtype)

    def filled(value):
        return [t.masked_fill(gap[:, None, None], value) for t in (q, k, v)], d_out.masked_fill(gap[:, None, None],
                                                                                               value)
    clean, dirty = _grads(call, *filled(0.0)), _grads(call, *filled(float("nan")))
    for name, a, b in zip(("out", "dq", "dk", "dv"), dirty, clean):
        assert torch.equal(a, b), f"{name}: NaN leaked from the gaps between sequences"


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_nan_inside_a_sequence_propagates_like_the_reference(fn, value, prec):
    lens = prec.lens([5, 4])
    cu = dict(cu_seqlens_q=cu_seqlens(lens), cu_seqlens_kv=cu_seqlens(lens))
    q, k, v = prec.qkv(seed=8)
    q[0, 2, 1, 3] = value  # one query row of sequence 0, head 1
    ours = _grads(lambda q_, k_, v_: fn(q_, k_, v_, "bshd", "padding_causal", None, 0.3, **cu), [q, k, v])

    def ref_in(dtype):
        return _grads(lambda q_, k_, v_: reference(q_, k_, v_, "padding_causal", scale=0.3, lens_q=lens,
                                                   lens_kv=lens, dtype=dtype), [t.to(dtype) for t in (q, k, v)])
    ref, lowp = ref_in(torch.float64), ref_in(prec.dtype)
    assert torch.isnan(ours[0][0, 2, 1]).all(), "the affected row must be NaN, not hidden as an empty row"
    assert not torch.isnan(ours[0][1]).any() and not torch.isnan(ours[0][0, :, 0]).any()
    assert torch.isnan(ours[1][0, 2, 1]).any(), "dq of the affected row must carry the NaN"
    _assert_matches(ours[:1], ref[:1], prec.tolerances(ref[:1], lowp[:1]))
    # dk of keys the row does not see may get 0 * NaN from dS^T q (q's NaN is in the product); the
    # other sequence and the other head must be untouched.
    for res in (ours, ref, lowp):
        res[2] = torch.cat([res[2][1].flatten(), res[2][0, :, 0].flatten()])
    tols = prec.tolerances(ref[1:], lowp[1:])
    for name, g, r, tol in zip(("dq", "dk", "dv"), ours[1:], ref[1:], tols):
        # Where the reference is a number ours is the same number (no NaN leaks beyond it).
        ok = ~torch.isnan(r)
        assert not torch.isnan(g[ok]).any(), f"{name}: NaN where the reference has none"
        assert (g.double()[ok] - r[ok]).abs().max().item() <= tol, name
    # dv = P^T dO: NaN exactly at the keys the affected row sees (keys 0-2 of sequence 0, head 1). The
    # reference's softmax spreads the NaN over the row's masked keys too; those get none here.
    seen = torch.zeros(B, prec.s, H, dtype=torch.bool, device=ours[3].device)
    seen[0, :3, 1] = True
    dv = ours[3]
    reached = torch.isnan(dv).any(-1)
    assert not (reached & ~seen).any(), "dv: NaN reached keys the row does not see"
    if math.isnan(value):  # (an inf gives some of the seen keys p = 0 / inf = 0)
        assert torch.equal(reached, seen), "dv: NaN must reach every key the row sees"


@pytest.mark.parametrize("prec", PRECISIONS)
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_fully_masked_row_is_still_zero(fn, prec):
    # s_q > s_kv with a bottom-right causal mask: the first s_q - s_kv queries see no key.
    q, k, v = prec.qkv(sq=prec.s, skv=prec.s // 2, seed=9)
    half = prec.s // 2
    out, dq, _, _ = _grads(lambda q_, k_, v_: fn(q_, k_, v_, "bshd", "causal_bottom_right", None, 0.3), [q, k, v])
    assert torch.equal(out[:, :half], torch.zeros_like(out[:, :half]))
    assert torch.equal(dq[:, :half], torch.zeros_like(dq[:, :half]))
    assert not torch.isnan(out).any() and not torch.isnan(dq).any()


# -- dtypes and windows on the functional entry points -----------------------------------------------


@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
@pytest.mark.parametrize("window, match", [((-5, 3), "`window_size` entries must be >= -1"),
                                           ((1, 2, 3), "`window_size` must be a pair"),
                                           ("ab", "`window_size` must be a pair")])
def test_bad_window_is_a_value_error(fn, window, match):
    with pytest.raises(ValueError, match=match):
        fn(*_qkv(), "bshd", "no_mask", window, 0.3)


@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_window_none_means_unbounded(fn):
    inputs = _qkv()
    assert torch.equal(fn(*inputs, "bshd", "causal", None, 0.3), fn(*inputs, "bshd", "causal", (-1, 0), 0.3))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
def test_integer_inputs_are_a_value_error(fn, dtype):
    with pytest.raises(ValueError, match="`query_layer` must be a floating-point tensor"):
        fn(*[t.to(dtype) for t in _qkv()], "bshd", "no_mask", None, 0.3)


@requires_fused
def test_fused_function_refuses_float64():
    with pytest.raises(NotImplementedError, match="`query_layer` must be .* for the fused kernels, got float64"):
        fused_attn_func(*[t.double() for t in _qkv()], "bshd", "no_mask", None, 0.3)


def test_unfused_float64_is_the_reference():
    inputs = [t.double() for t in _qkv(seed=2)]
    _assert_matches([unfused_attention(*inputs, "bshd", "causal", None, 0.3)],
                    [reference(*inputs, "causal", scale=0.3)], atol=1e-12)


# -- bf16 under the interpreter is not a path to select ----------------------------------------------


@pytest.mark.skipif(not INTERPRET or ON_GPU, reason="Triton interpreter on CPU only")
def test_bf16_under_the_interpreter_is_not_selected():
    q, k, v = _qkv(dtype=torch.bfloat16)
    config = attn_testing.attn_config(q, k, v, attn_mask_type="causal", deterministic=True)
    selection = attn_backends.select(config)
    assert selection.name == "UnfusedDotProductAttention"
    assert any("bfloat16 under TRITON_INTERPRET=1" in r for r in selection.rejected["FusedAttention"])
    with pytest.raises(NotImplementedError, match="bfloat16 for the fused kernels under TRITON_INTERPRET=1"):
        fused_attn_func(q, k, v, "bshd", "causal", None, 0.3)


def test_bf16_reason_is_data_of_the_backend():
    from transformer_engine.common.attention import FusedAttention

    cfg = dict(batch_size=1, num_heads_q=2, num_heads_kv=2, head_dim_qk=64, head_dim_v=64, max_seqlen_q=8,
               max_seqlen_kv=8, device_type="cpu", attn_mask_type=AttnMaskType.CAUSAL_MASK)
    assert any("bfloat16" in r for r in FusedAttention.not_supported_reasons(
        AttnConfig.of(dtype="bfloat16", triton_interpret=True, **cfg)))
    assert not any("bfloat16" in r for r in FusedAttention.not_supported_reasons(
        AttnConfig.of(dtype="float16", triton_interpret=True, **cfg)))


# -- properties: random valid configurations ---------------------------------------------------------

_FAST = settings(max_examples=6, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def _configs(draw):
    b = draw(st.integers(1, 3))
    h_kv = draw(st.sampled_from([1, 2]))
    h = h_kv * draw(st.sampled_from([1, 2]))
    s = draw(st.integers(1, 7))
    lens_q = draw(st.lists(st.integers(0, s), min_size=b, max_size=b))
    lens_kv = draw(st.lists(st.integers(0, s), min_size=b, max_size=b))
    mask = draw(st.sampled_from(["padding", "padding_causal", "padding_causal_bottom_right"]))
    left = draw(st.sampled_from([-1, 0, 2]))
    right = 0 if "causal" in mask else draw(st.sampled_from([-1, 0, 1]))
    scale = draw(st.sampled_from([0.0, -0.4, 0.2, 1.3]))
    return b, h, h_kv, s, lens_q, lens_kv, mask, (left, right), scale, draw(st.integers(0, 2 ** 16))


@pytest.mark.parametrize("fn", list(FUNCS.values()), ids=list(FUNCS))
@_FAST
@given(cfg=_configs())
def test_property_random_configs_match_the_reference(fn, cfg):
    b, h, h_kv, s, lens_q, lens_kv, mask, window, scale, seed = cfg
    inputs = _qkv(b=b, sq=s, skv=s, h=h, hk=h_kv, seed=seed)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_kv=cu_seqlens(lens_kv))
    ours = _grads(lambda q, k, v: fn(q, k, v, "bshd", mask, window, scale, **kw), inputs)
    ref = _grads(lambda q, k, v: reference(q, k, v, mask, window, scale=scale, lens_q=lens_q, lens_kv=lens_kv),
                 [t.double() for t in inputs])
    _assert_matches(ours, ref)


@requires_fused
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 9), min_size=2, max_size=3), seed=st.integers(0, 2 ** 16),
       scale=st.sampled_from([0.3, -0.3]))
def test_property_packed_padded_and_batch_invariance_bitwise(dtype, lens, seed, scale):
    """In deterministic mode a sequence's outputs and gradients do not depend on its batch or on packing."""
    s = max(lens)
    q, k, v = _qkv(b=len(lens), sq=s, skv=s, seed=seed, dtype=dtype)
    cu = cu_seqlens(lens)
    kw = dict(deterministic=True)
    padded = _grads(lambda q_, k_, v_: fused_attn_func(q_, k_, v_, "bshd", "padding_causal", None, scale,
                                                        cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw), [q, k, v])
    pack = lambda t: torch.cat([t[n, :length] for n, length in enumerate(lens)])  # noqa: E731
    packed = _grads(lambda q_, k_, v_: fused_attn_func(q_, k_, v_, "thd", "padding_causal", None, scale,
                                                        cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s,
                                                        max_seqlen_kv=s, **kw), [pack(t) for t in (q, k, v)])
    for name, a, p in zip(("out", "dq", "dk", "dv"), padded, packed):
        assert torch.equal(pack(a), p), f"{name}: packed and padded differ"
    # The last sequence alone, in a batch of one.
    n = len(lens) - 1
    one = _i32([0, lens[n]])
    alone = _grads(lambda q_, k_, v_: fused_attn_func(q_, k_, v_, "bshd", "padding_causal", None, scale,
                                                       cu_seqlens_q=one, cu_seqlens_kv=one, **kw),
                   [t[n:n + 1] for t in (q, k, v)])
    for name, a, x in zip(("out", "dq", "dk", "dv"), padded, alone):
        assert torch.equal(a[n:n + 1], x), f"{name}: the sequence's bits depend on its batch"


def test_scale_check_keeps_ordinary_numbers():
    from transformer_engine.common.attention.validation import check_softmax_scale, kernel_scale

    assert check_softmax_scale(1) == 1.0 and check_softmax_scale(torch.tensor(0.5)) == 0.5
    assert kernel_scale(0.25) == (1.0, 0.25) and kernel_scale(-0.25) == (-1.0, 0.25) and kernel_scale(0.0) == (0.0, 1.0)
    assert math.isfinite(DotProductAttention(H, D, softmax_scale=-0.5).softmax_scale)
