"""Bad and edge inputs in TE-JAX, handled alike by both backends (the fused primitives' CPU lowering
and the unfused jnp path), eager and under jit: clear errors naming the argument, or the fp64
reference's answer (scaling_factor 0 or negative, s = 0, NaN in padding, NaN inside a sequence)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from transformer_engine.common.attention.validation import check_segments
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    QKVLayout,
    SequenceDescriptor,
)
from te_jax_testing import fused_attn_with_backend

BACKENDS = ["fused", "unfused"]
B, S, H, D = 2, 6, 2, 8


def _qkv(b=B, sq=S, skv=S, seed=0, dtype=np.float32, d=D):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
            for shape in ((b, sq, H, d), (b, skv, H, d), (b, skv, H, d))]


def _call(backend, qkv, sd=None, mask=AttnMaskType.NO_MASK, scale=0.3, layout=QKVLayout.BSHD_BSHD_BSHD,
          window=None, segments=1):
    return fused_attn_with_backend(backend, tuple(qkv), None, sd, None, AttnBiasType.NO_BIAS, mask, layout, scale,
                                    0.0, True, max_segments_per_seq=segments, window_size=window)


def _reference(q, k, v, lens_q, lens_kv, causal, scale):
    """fp64 numpy, one sequence at a time (top-left causal); padded rows and rows with no key are 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for n in range(q.shape[0]):
        lq, lk = lens_q[n], lens_kv[n]
        s = np.einsum("qhd,khd->hqk", q[n, :lq], k[n, :lk]) * scale
        keep = np.ones((lq, lk), bool)
        if causal:
            keep &= np.arange(lk)[None, :] <= np.arange(lq)[:, None]
        s = np.where(keep, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        p = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
        den = p.sum(-1, keepdims=True)
        p = p / np.where(den > 0, den, 1.0)
        out[n, :lq] = np.einsum("hqk,khd->qhd", p, v[n, :lk])
    return out


# -- the shared validator on JAX's segments ----------------------------------------------------------


@pytest.mark.parametrize("lens, offsets, match", [
    ([[3, -1]], [[0, 3, 6]], "non-negative sequence lengths"),
    ([[3, 2]], [[0, 2, 6]], "do not overlap"),
    ([[3, 4]], [[0, 3, 6]], "within the row's sequence length"),
    ([[3, 2]], [[-1, 3, 6]], "non-negative sequence starts"),
])
def test_segment_validator(lens, offsets, match):
    with pytest.raises(ValueError, match=match):
        check_segments(np.array(lens), np.array(offsets), 6, seqlens_arg="seqlens", offsets_arg="seq_offsets",
                       side="q")


def test_segment_validator_ignores_unused_segments():
    check_segments(np.array([[3, 0]]), np.array([[0, -1, 6]]), 6, seqlens_arg="seqlens", offsets_arg="seq_offsets")


# -- bad inputs: errors naming the argument, on both backends ----------------------------------------

BAD = {
    "seqlen_beyond_row": (dict(sd=SequenceDescriptor.from_seqlens(jnp.array([3, 7], jnp.int32)),
                               mask=AttnMaskType.PADDING_MASK), "`seqlens` \\(q\\) must keep every sequence"),
    "overlapping_offsets": (dict(sd=SequenceDescriptor.from_seqlens_and_offsets(
        jnp.array([[3, 3], [2, 2]], jnp.int32), jnp.array([[0, 2, 6], [0, 2, 6]], jnp.int32)),
        mask=AttnMaskType.PADDING_MASK, layout=QKVLayout.THD_THD_THD, segments=2), "`seq_offsets` \\(q\\)"),
    "too_many_segment_runs": (dict(sd=SequenceDescriptor.from_segment_ids_and_pos(
        jnp.array([[1, 1, 2, 2, 3, 0], [1, 1, 1, 2, 2, 0]], jnp.int32)), mask=AttnMaskType.PADDING_MASK,
        layout=QKVLayout.THD_THD_THD, segments=2), "`max_segments_per_seq` must be at least"),
    "nan_scale": (dict(scale=float("nan")), "`scaling_factor` must be a finite number"),
    "inf_scale": (dict(scale=float("inf")), "`scaling_factor` must be a finite number"),
    "string_scale": (dict(scale="0.3"), "`scaling_factor` must be a finite number"),
    "negative_window": (dict(window=(-5, 3)), "`window_size` entries must be >= -1"),
    "malformed_window": (dict(window=(1, 2, 3)), "`window_size` must be a pair"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise(backend, case):
    kwargs, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        _call(backend, _qkv(), **kwargs)


@pytest.mark.parametrize("dtype", [np.float64, np.int32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_dtypes_raise(backend, dtype):
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        qkv = [x.astype(jnp.int32) for x in _qkv()]  # without x64 there is no float64 array: ints instead
    else:
        qkv = [jnp.asarray(np.asarray(x).astype(dtype)) for x in _qkv()]
    with pytest.raises(ValueError, match="`q` must be float16, bfloat16 or float32"):
        _call(backend, qkv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_one_seqlen_is_an_unused_slot(backend):
    # TransformerEngine fills unused seqlens slots with -1: an empty sequence, zero output, no error.
    out = _call(backend, _qkv(), SequenceDescriptor.from_seqlens(jnp.array([-1, 3], jnp.int32)),
                AttnMaskType.PADDING_MASK)
    assert not np.any(np.asarray(out[0]))


def test_traced_descriptor_values_are_not_checked_under_jit():
    # Documented: under jit the values are tracers; a valid call must still run.
    lens = jnp.array([4, 3], jnp.int32)
    f = jax.jit(lambda q, k, v, lens: _call("unfused", (q, k, v), SequenceDescriptor.from_seqlens(lens),
                                            AttnMaskType.PADDING_MASK))
    assert f(*_qkv(), lens).shape == (B, S, H, D)


# -- unusual valid inputs: the reference's answer -----------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale", [0.0, -0.6])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_and_negative_scale(backend, scale, jit):
    q, k, v = _qkv(seed=1)
    lens = [4, 6]
    sd = SequenceDescriptor.from_seqlens(jnp.array(lens, jnp.int32))

    def f(q, k, v):
        return _call(backend, (q, k, v), sd, AttnMaskType.PADDING_CAUSAL_MASK, scale)

    f = jax.jit(f) if jit else f
    np.testing.assert_allclose(np.asarray(f(q, k, v)), _reference(q, k, v, lens, lens, True, scale), atol=2e-6)
    grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: _call("unfused", a, sd, AttnMaskType.PADDING_CAUSAL_MASK, scale).sum(),
                   argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6)
    if scale == 0.0:
        assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))  # scores do not depend on q, k


@pytest.mark.parametrize("empty", ["s_q", "s_kv"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length(backend, empty):
    sq, skv = (0, 4) if empty == "s_q" else (5, 0)
    qkv = _qkv(sq=sq, skv=skv)
    out = _call(backend, qkv)
    assert out.shape == (B, sq, H, D) and not np.any(np.asarray(out))
    grads = jax.grad(lambda *a: _call(backend, a).sum(), argnums=(0, 1, 2))(*qkv)
    assert all(not np.any(np.asarray(g)) for g in grads)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_padding_contributes_nothing(backend, jit):
    lens = jnp.array([4, 3], jnp.int32)
    pad = (jnp.arange(S)[None, :] >= lens[:, None])[:, :, None, None]
    sd = SequenceDescriptor.from_seqlens(lens)

    def run(fill):
        qkv = [jnp.where(pad, fill, x) for x in _qkv(seed=2)]
        f = lambda *a: _call(backend, a, sd, AttnMaskType.PADDING_CAUSAL_MASK)  # noqa: E731
        f = jax.jit(f) if jit else f
        out, vjp = jax.vjp(f, *qkv)
        return [out] + list(vjp(jnp.where(pad, fill, jnp.ones_like(out))))

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(jnp.nan), run(0.0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}: NaN leaked from the padding")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_inside_a_sequence_propagates(backend):
    q, k, v = _qkv(seed=3)
    q = q.at[0, 2, 1, 3].set(jnp.nan)
    out = np.asarray(_call(backend, (q, k, v), mask=AttnMaskType.CAUSAL_MASK))
    assert np.isnan(out[0, 2, 1]).all()
    nan_rows = np.isnan(out).any(-1)
    assert nan_rows.sum() == 1, "only the affected row is NaN"
    dq = np.asarray(jax.grad(lambda a: _call(backend, (a, k, v), mask=AttnMaskType.CAUSAL_MASK).sum())(q))
    assert np.isnan(dq[0, 2, 1]).any() and not np.isnan(dq[1]).any()


# -- properties --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(lens_q=st.lists(st.integers(0, S), min_size=B, max_size=B),
       lens_kv=st.lists(st.integers(0, S), min_size=B, max_size=B),
       causal=st.booleans(), scale=st.sampled_from([0.0, -0.5, 0.25, 1.5]), seed=st.integers(0, 2 ** 16))
def test_property_random_configs_match_the_reference(backend, lens_q, lens_kv, causal, scale, seed):
    q, k, v = _qkv(seed=seed)
    sd = SequenceDescriptor.from_seqlens((jnp.array(lens_q, jnp.int32), jnp.array(lens_kv, jnp.int32)))
    mask = AttnMaskType.PADDING_CAUSAL_MASK if causal else AttnMaskType.PADDING_MASK
    out = _call(backend, (q, k, v), sd, mask, scale)
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, lens_q, lens_kv, causal, scale), atol=3e-6)


# -- the NaN and scale items at bf16 on the GPU (d=64: Triton kernels; d=128: Gluon kernels on Hopper) --

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="the fused bf16 kernels run on the GPU only")
GPU_S = 240  # several kernel blocks; sequences of 160 and 240 tokens


def _bf16_case(d, seed, mask, scale, lens, qkv=None):
    """Fused outputs and input gradients at bf16, with the unfused jnp path at fp32 (reference) and bf16
    (JAX's own low-precision error) on the same inputs and output gradient, and the output gradient."""
    qkv = _qkv(sq=GPU_S, skv=GPU_S, seed=seed, dtype=jnp.bfloat16, d=d) if qkv is None else qkv
    sd = SequenceDescriptor.from_seqlens(jnp.array(lens, jnp.int32))
    d_out = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((B, GPU_S, H, d)), jnp.bfloat16)

    def run(backend, dtype):
        f = jax.jit(lambda *a: _call(backend, a, sd, mask, scale))
        out, vjp = jax.vjp(f, *[x.astype(dtype) for x in qkv])
        return [np.asarray(x.astype(jnp.float32)) for x in [out, *vjp(d_out.astype(dtype))]]
    return qkv, d_out, run("fused", jnp.bfloat16), run("unfused", jnp.float32), run("unfused", jnp.bfloat16)


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _rounded_where_fused_kernels_round(qkv, d_out, lens, scale):
    """Top-left causal attention and its input gradients in fp32 numpy, rounded to bf16 only where a fused
    (FlashAttention-2 style) kernel rounds: the probabilities before P @ V and P^T @ dO, the stored output
    that delta = rowsum(dO * O) reads, and dS before dS @ K and dS^T @ Q. Its error against the fp32
    reference is what that algorithm costs on these inputs, apart from summation order: in a peaked softmax
    (|scale| well above 1/sqrt(d)) rounding dS dominates and can exceed JAX's unfused bf16 error, which keeps
    dS in fp32."""
    q, k, v = (np.asarray(x.astype(jnp.float32)) for x in qkv)
    do = np.asarray(d_out.astype(jnp.float32))
    out, dq, dk, dv = (np.zeros_like(x) for x in (q, q, k, v))
    for n, length in enumerate(lens):
        qn, kn, vn, don = q[n, :length], k[n, :length], v[n, :length], do[n, :length]
        s = np.einsum("qhd,khd->hqk", qn, kn) * scale
        s = np.where(np.tril(np.ones((length, length), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        p16 = _bf16(p)
        o = _bf16(np.einsum("hqk,khd->qhd", p16, vn))
        ds = _bf16(p * (np.einsum("qhd,khd->hqk", don, vn) - np.einsum("qhd,qhd->hq", don, o)[..., None]))
        out[n, :length] = o
        dq[n, :length] = _bf16(np.einsum("hqk,khd->qhd", ds, kn) * scale)
        dk[n, :length] = _bf16(np.einsum("hqk,qhd->khd", ds, qn) * scale)
        dv[n, :length] = _bf16(np.einsum("hqk,qhd->khd", p16, don))
    return [out, dq, dk, dv]


def _assert_bf16_close(ours, ref, lowp, rounded=(None,) * 4, names=("out", "dq", "dk", "dv")):
    """Max error within 2x JAX's own bf16 error or, where ``rounded`` gives one, 2x the larger of that and the
    fused algorithm's rounding error."""
    for name, a, r, x, alg in zip(names, ours, ref, lowp, rounded):
        ok = ~np.isnan(r)
        assert np.array_equal(np.isnan(a), np.isnan(r)), f"{name}: NaN pattern differs from the reference"
        err = float(np.abs(a[ok] - r[ok]).max(initial=0.0))
        base = float(np.abs(x[ok] - r[ok]).max(initial=0.0))
        alg = float(np.abs(alg[ok] - r[ok]).max(initial=0.0)) if alg is not None else 0.0
        assert err <= 2 * max(base, alg) + 1e-3, (
            f"{name}: max error {err:.3e} > 2 x max(JAX's bf16 error {base:.3e}, the fused algorithm's "
            f"rounding error {alg:.3e}) + 1e-3")


@requires_gpu
@pytest.mark.parametrize("scale", ["zero", "negative", "negative_peaked"])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_zero_and_negative_scale_on_the_gpu(d, scale):
    """A zero scale, the default magnitude negated, and a negative scale 0.6 (about 7x 1/sqrt(128): a peaked
    softmax, where dq and dk are judged against what rounding dS to bf16 costs, as every fused kernel does)."""
    lens = [160, 240]
    value = {"zero": 0.0, "negative": -1.0 / np.sqrt(d), "negative_peaked": -0.6}[scale]
    qkv, d_out, ours, ref, lowp = _bf16_case(d, 11, AttnMaskType.PADDING_CAUSAL_MASK, value, lens)
    rounded = [None] * 4
    if scale == "negative_peaked":
        out, dq, dk, dv = _rounded_where_fused_kernels_round(qkv, d_out, lens, value)
        rounded = [None, dq, dk, None]
    _assert_bf16_close(ours, ref, lowp, rounded)
    exact = _reference(*[np.asarray(x.astype(jnp.float32)) for x in qkv], lens, lens, True, value)
    assert float(np.abs(ours[0] - exact).max()) <= 2 * float(np.abs(lowp[0] - exact).max()) + 1e-3
    if value < 0:  # a negative scale is attention of -q at the positive scale, bit for bit
        q, k, v = qkv
        _, _, flipped, _, _ = _bf16_case(d, 11, AttnMaskType.PADDING_CAUSAL_MASK, -value, lens, qkv=(-q, k, v))
        for name, a, b in zip(("out", "dq", "dk", "dv"), ours, [flipped[0], -flipped[1], *flipped[2:]]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: scale {value} is not -q at scale {-value}")


@requires_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_nan_padding_contributes_nothing_on_the_gpu(d):
    lens = jnp.array([160, 100], jnp.int32)
    pad = (jnp.arange(GPU_S)[None, :] >= lens[:, None])[:, :, None, None]
    sd = SequenceDescriptor.from_seqlens(lens)

    def run(fill):
        qkv = [jnp.where(pad, fill, x) for x in _qkv(sq=GPU_S, skv=GPU_S, seed=12, dtype=jnp.bfloat16, d=d)]
        f = jax.jit(lambda *a: _call("fused", a, sd, AttnMaskType.PADDING_CAUSAL_MASK))
        out, vjp = jax.vjp(f, *qkv)
        return [out] + list(vjp(jnp.where(pad, fill, jnp.ones_like(out))))

    for name, a, b in zip(("out", "dq", "dk", "dv"), run(jnp.nan), run(0.0)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                      err_msg=f"{name}: NaN leaked from the padding")


@requires_gpu
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_nan_inside_a_sequence_propagates_on_the_gpu(d, value):
    q, k, v = _qkv(sq=GPU_S, skv=GPU_S, seed=13, dtype=jnp.bfloat16, d=d)
    q = q.at[0, 2, 1, 3].set(value)
    f = jax.jit(lambda *a: _call("fused", a, mask=AttnMaskType.CAUSAL_MASK))
    out = np.asarray(f(q, k, v).astype(jnp.float32))
    assert np.isnan(out[0, 2, 1]).all(), "the affected row must be NaN, not hidden as an empty row"
    assert np.isnan(out).any(-1).sum() == 1, "only the affected row is NaN"
    dq = np.asarray(jax.grad(lambda a: f(a, k, v).astype(jnp.float32).sum())(q).astype(jnp.float32))
    assert np.isnan(dq[0, 2, 1]).any() and not np.isnan(dq[1]).any() and not np.isnan(dq[0, :, 0]).any()
