"""Test helpers for transformer_engine.jax: input builders and an independent fp32 reference.

The reference is written from the mask semantics (TransformerEngine's), not from the library's
code: per-token segment ids and positions come from plain numpy loops, the mask from explicit
rules, the softmax from ``jax.nn.softmax`` over a finite fill value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVFormat, QKVLayout
from transformer_engine.jax import attention as te_attention
from transformer_engine.common.attention.backends import backend_named
from transformer_engine.common.log import selected_backends as recording_backend_selections  # noqa: F401
from transformer_engine.jax import attention_math
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.enums import to_common  # the tests pass enum members or their strings

LAYOUTS = list(QKVLayout)
MASKS = [m for m in AttnMaskType if m != AttnMaskType.ARBITRARY_MASK]
BACKENDS = ["fused", "unfused"]


# ------------------------------------------------------------------------------------------------
# Segments (which tokens belong to which sequence)
# ------------------------------------------------------------------------------------------------


@dataclass
class Segments:
    """Per-row sequences of one side (q or kv): lengths [b, m] and starts [b, m]."""

    lens: np.ndarray
    starts: np.ndarray
    seqlen: int

    @property
    def ids(self) -> np.ndarray:
        """[b, s] segment numbers 1..m, 0 for padding."""
        b, m = self.lens.shape
        ids = np.zeros((b, self.seqlen), np.int32)
        for r in range(b):
            for k in range(m):
                ids[r, self.starts[r, k]: self.starts[r, k] + self.lens[r, k]] = k + 1
        return ids

    @property
    def pos(self) -> np.ndarray:
        b, m = self.lens.shape
        pos = np.zeros((b, self.seqlen), np.int32)
        for r in range(b):
            for k in range(m):
                pos[r, self.starts[r, k]: self.starts[r, k] + self.lens[r, k]] = np.arange(self.lens[r, k])
        return pos

    @property
    def token_len(self) -> np.ndarray:
        """[b, s] length of each token's sequence (0 for padding)."""
        b, m = self.lens.shape
        out = np.zeros((b, self.seqlen), np.int32)
        for r in range(b):
            for k in range(m):
                out[r, self.starts[r, k]: self.starts[r, k] + self.lens[r, k]] = self.lens[r, k]
        return out

    @property
    def offsets(self) -> np.ndarray:
        """[b, m + 1] starts plus a trailing end (TransformerEngine's seq_offsets shape)."""
        end = (self.starts[:, -1:] + self.lens[:, -1:])
        return np.concatenate([self.starts, end], axis=1).astype(np.int32)


def full_segments(b: int, s: int) -> Segments:
    return Segments(np.full((b, 1), s, np.int32), np.zeros((b, 1), np.int32), s)


def padded_segments(rng: np.random.Generator, b: int, s: int, min_len: int = 1) -> Segments:
    """One sequence per row, starting at 0, random length in [min_len, s]; row 0 is full."""
    lens = rng.integers(min_len, s + 1, size=(b, 1)).astype(np.int32)
    lens[0, 0] = s
    return Segments(lens, np.zeros((b, 1), np.int32), s)


def packed_segments(rng: np.random.Generator, b: int, s: int, m: int, gaps: bool = False,
                    lens: Optional[np.ndarray] = None) -> Segments:
    """Up to ``m`` sequences per row, packed from 0 (or with random gaps between them), padding at
    the end. ``lens`` fixes the lengths (e.g. kv lengths matching q's segment count)."""
    starts = np.zeros((b, m), np.int32)
    if lens is None:
        lens = np.zeros((b, m), np.int32)
        for r in range(b):
            budget = s - (m if gaps else 0)
            cuts = np.sort(rng.integers(0, budget + 1, size=m))
            lens[r] = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
            if r == 0:
                lens[r, -1] = 0  # an empty trailing segment
    for r in range(b):
        t = 0
        for k in range(m):
            if gaps:
                t += int(rng.integers(0, 2))
            starts[r, k] = t
            t += lens[r, k]
        assert t <= s
    return Segments(lens.astype(np.int32), starts, s)


def descriptor(kind: str, q: Segments, kv: Segments) -> SequenceDescriptor:
    """The same segments through each SequenceDescriptor constructor."""
    if kind == "seqlens":
        if q.lens.shape[1] == 1:
            return SequenceDescriptor.from_seqlens((jnp.asarray(q.lens[:, 0]), jnp.asarray(kv.lens[:, 0])))
        return SequenceDescriptor.from_seqlens((jnp.asarray(q.lens), jnp.asarray(kv.lens)))
    if kind == "offsets":
        return SequenceDescriptor.from_seqlens_and_offsets(
            (jnp.asarray(q.lens), jnp.asarray(kv.lens)), (jnp.asarray(q.offsets), jnp.asarray(kv.offsets))
        )
    if kind == "segment_ids":
        return SequenceDescriptor.from_segment_ids_and_pos(
            (jnp.asarray(q.ids), jnp.asarray(kv.ids)), (jnp.asarray(q.pos), jnp.asarray(kv.pos))
        )
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def reference_mask(q: Segments, kv: Segments, mask: AttnMaskType, window: Tuple[int, int],
                   bottom_right_diagonal: Optional[bool] = None) -> np.ndarray:
    """[b, 1, s_q, s_kv] bool from the semantics: same sequence, and the (left, right) window around
    the diagonal. TransformerEngine-JAX's diagonal (its make_swa_mask): bottom-right for the
    bottom-right causal masks, top-left for every other mask; ``bottom_right_diagonal`` moves it for
    the non-causal masks, TransformerEngine-PyTorch's rule."""
    mask = to_common(mask, AttnMaskType, "mask")
    left, right = window
    if mask.is_causal():
        right = 0
    if mask.is_causal():
        top_left = mask in (AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK)
    else:
        top_left = not bottom_right_diagonal
    ids_q, ids_kv = q.ids, kv.ids
    pos_q, pos_kv = q.pos, kv.pos
    len_q, len_kv = q.token_len, kv.token_len
    b = ids_q.shape[0]
    out = np.zeros((b, 1, q.seqlen, kv.seqlen), bool)
    for r in range(b):  # the rules below hold for every (query i, key j) pair of row r at once
        i_id, j_id = ids_q[r][:, None], ids_kv[r][None, :]
        visible = (i_id != 0) & (j_id == i_id)
        diag = 0 if top_left else len_kv[r][None, :] - len_q[r][:, None]
        centre = pos_q[r][:, None] + diag
        if left >= 0:
            visible &= pos_kv[r][None, :] >= centre - left
        if right >= 0:
            visible &= pos_kv[r][None, :] <= centre + right
        out[r, 0] = visible
    return out


def _rounder(dtype):
    """x -> x rounded to ``dtype`` and back to float64 (identity for float32 references)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return lambda x: x
    np_dtype = np.float16 if dtype == jnp.float16 else jnp.bfloat16  # ml_dtypes' bfloat16 via jnp
    return lambda x: np.asarray(x).astype(np_dtype).astype(np.float64)


def reference_attention(q, k, v, bias, dout, visible, scale, bias_type=AttnBiasType.NO_BIAS, keep=None, rate=0.0,
                        compute_dtype=jnp.float32):
    """Forward and backward of softmax(QK^T * scale + bias) V over ``visible`` keys, BSHD, in numpy
    float64 with the backward derived by hand (softmax Jacobian). Rows with no visible key give 0.

    ``compute_dtype`` float32 is the reference; a 16-bit dtype rounds every matmul result and the
    probabilities to it, the framework's own low-precision error that tolerances are measured by.
    Returns (out, dq, dk, dv, dbias) as float64 arrays (dbias None without bias).
    """
    rnd = _rounder(compute_dtype)
    f64 = lambda x: None if x is None else rnd(np.asarray(jnp.asarray(x, jnp.float32), np.float64))  # noqa: E731
    q, k, v, bias, dout = f64(q), f64(k), f64(v), f64(bias), f64(dout)
    g = q.shape[2] // k.shape[2]
    k_rep, v_rep = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    # Batched matmuls over [b, h] (BLAS) in [b, h, s, d]; the same products as the einsums
    # "bqhd,bkhd->bhqk" etc., but fast enough for the long-sequence (GPU) determinism checks.
    heads = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))  # noqa: E731  [b, s, h, d] <-> [b, h, s, d]
    mT = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    q_h, k_h, v_h, dout_h = heads(q), heads(k_rep), heads(v_rep), heads(dout)
    raw = rnd(q_h @ mT(k_h))
    if bias_type == AttnBiasType.PRE_SCALE_BIAS:
        logits = (raw + bias) * scale
    elif bias_type == AttnBiasType.POST_SCALE_BIAS:
        logits = raw * scale + bias
    else:
        logits = raw * scale
    visible = np.broadcast_to(np.asarray(visible), logits.shape)
    row_max = np.where(visible, logits, -np.inf).max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(visible, np.exp(np.where(visible, logits, 0.0) - row_max), 0.0)
    denom = e.sum(-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1.0)
    drop = np.where(np.asarray(keep), 1.0 / (1.0 - rate), 0.0) if keep is not None else 1.0
    p_used = rnd(p * drop)
    out = heads(rnd(p_used @ v_h))

    dv_rep = heads(rnd(mT(p_used) @ dout_h))
    dp = rnd(dout_h @ mT(v_h)) * drop
    dlogits = rnd(p * (dp - (p * dp).sum(-1, keepdims=True)))
    draw = dlogits * scale
    dq = heads(rnd(draw @ k_h))
    dk_rep = heads(rnd(mT(draw) @ q_h))
    b, s_kv, h_kv = k.shape[:3]
    dk = dk_rep.reshape(b, s_kv, h_kv, g, -1).sum(3)
    dv = dv_rep.reshape(b, s_kv, h_kv, g, -1).sum(3)
    dbias = None
    if bias is not None:
        dbias = draw if bias_type == AttnBiasType.PRE_SCALE_BIAS else dlogits
        for axis in (0, 1):
            if bias.shape[axis] == 1:
                dbias = dbias.sum(axis, keepdims=True)
    return out, dq, dk, dv, dbias


# ------------------------------------------------------------------------------------------------
# Inputs in each layout
# ------------------------------------------------------------------------------------------------


def random_qkv(key, b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, s_q, h_q, d_qk), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s_kv, h_kv, d_qk), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s_kv, h_kv, d_v), jnp.float32).astype(dtype)
    return q, k, v


def pack(q, k, v, layout: QKVLayout):
    """BSHD q, k, v -> the ``qkv`` tuple of ``layout``."""
    layout = to_common(layout, QKVLayout, "layout")
    sbhd = layout.qkv_format == QKVFormat.SBHD
    tr = (lambda x: jnp.swapaxes(x, 0, 1)) if sbhd else (lambda x: x)
    if layout.packing == "qkv":
        return (tr(jnp.stack([q, k, v], axis=2)),)
    if layout.packing == "kv":
        return (tr(q), tr(jnp.stack([k, v], axis=2)))
    return (tr(q), tr(k), tr(v))


def unpack_grads(grads, layout: QKVLayout):
    """Gradients w.r.t. the ``qkv`` tuple -> BSHD (dq, dk, dv)."""
    layout = to_common(layout, QKVLayout, "layout")
    sbhd = layout.qkv_format == QKVFormat.SBHD
    tr = (lambda x: jnp.swapaxes(x, 0, 1)) if sbhd else (lambda x: x)
    grads = [tr(g) for g in grads]
    if layout.packing == "qkv":
        return grads[0][:, :, 0], grads[0][:, :, 1], grads[0][:, :, 2]
    if layout.packing == "kv":
        return grads[0], grads[1][:, :, 0], grads[1][:, :, 1]
    return tuple(grads)


# ------------------------------------------------------------------------------------------------
# Running a backend and comparing
# ------------------------------------------------------------------------------------------------


def skip_unless_backend_runs(backend: str, **config_kwargs):
    """On CPU both backends run (the fused primitive lowers to jnp). On a GPU the fused backend
    runs only where the kernels support the config: skip with the backend's own reasons."""
    if backend != "fused" or jax.devices()[0].platform == "cpu":
        return
    reasons = te_attention._fused_reasons(**config_kwargs)  # what forcing fused can run
    if reasons:
        pytest.skip("fused backend cannot run this config: " + "; ".join(reasons))


def attn_fn(backend: str, **kwargs):
    """``qkv, bias -> output`` through one backend ('fused' or 'unfused', forced), or through
    ``fused_attn``'s own selection ('selected'), with the other arguments fixed."""

    def f(qkv, bias):
        if backend == "selected":
            return te_attention.fused_attn(tuple(qkv), bias, **kwargs)
        return fused_attn_with_backend(backend, tuple(qkv), bias, **kwargs)

    return f


def _f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def max_abs(x) -> float:
    return float(np.max(np.abs(_f64(x)))) if np.size(x) else 0.0


def assert_close_to_reference(name, actual, ref32, ref_lowp, atol=2e-5):
    """|actual - ref32| <= 2 |ref_lowp - ref32| + atol * max(1, |ref32|), FlashAttention's rule: a
    kernel may be at most twice as far from the fp32 reference as the framework's own math in the
    input dtype."""
    actual, ref32, ref_lowp = _f64(actual), _f64(ref32), _f64(ref_lowp)
    err = max_abs(actual - ref32)
    base = max_abs(ref_lowp - ref32)
    bound = 2 * base + atol * max(1.0, max_abs(ref32))
    assert np.isfinite(err), f"{name}: non-finite values"
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (low-precision error {base:.3g})"


# ------------------------------------------------------------------------------------------------
# One configuration: build, run (output and gradients), check against the reference
# ------------------------------------------------------------------------------------------------


def _segments(rng, fmt, mask, b, s_q, s_kv, m, desc_kind):
    if fmt == QKVFormat.THD:
        gaps = desc_kind != "seqlens"  # from_seqlens alone means packed from position 0
        return packed_segments(rng, b, s_q, m, gaps), packed_segments(rng, b, s_kv, m, gaps)
    if mask.is_padding():
        return padded_segments(rng, b, s_q), padded_segments(rng, b, s_kv)
    return full_segments(b, s_q), full_segments(b, s_kv)


@dataclass
class Case:
    """One attention configuration with its inputs; ``run()`` gives output and gradients (BSHD)."""

    backend: str
    layout: QKVLayout
    mask: AttnMaskType
    dtype: object
    seg_q: Segments
    seg_kv: Segments
    q: jax.Array
    k: jax.Array
    v: jax.Array
    bias: Optional[jax.Array]
    dout: jax.Array
    scale: float
    window: Optional[Tuple[int, int]]
    bias_type: AttnBiasType
    dropout: float
    dropout_key: jax.Array
    kwargs: dict

    def function(self):
        """A freshly jitted ``(q, k, v, bias, dout) -> (out, (dq, dk, dv), dbias)``."""
        layout = self.layout
        f = attn_fn(self.backend, **self.kwargs)
        sbhd = layout.qkv_format == QKVFormat.SBHD
        to_bshd = (lambda x: jnp.swapaxes(x, 0, 1)) if sbhd else (lambda x: x)

        def run(q, k, v, bias, dout):
            out, vjp = jax.vjp(f, pack(q, k, v, layout), bias)
            dqkv, dbias = vjp(to_bshd(dout))
            return to_bshd(out), unpack_grads(dqkv, layout), dbias

        return jax.jit(run)

    def run(self, fn=None):
        out, (dq, dk, dv), dbias = (fn or self.function())(self.q, self.k, self.v, self.bias, self.dout)
        return dict(out=out, dq=dq, dk=dk, dv=dv, dbias=dbias)

    @property
    def visible(self) -> np.ndarray:
        return reference_mask(self.seg_q, self.seg_kv, self.mask, (-1, -1) if self.window is None else self.window,
                              self.kwargs.get("bottom_right_diagonal"))

    def check_reference(self, results: dict) -> None:
        b, s_q, h_q, _ = self.q.shape
        keep = None
        if self.dropout:
            seeds = attention_math.head_seeds(attention_math.seed_words(self.dropout_key), b, h_q)
            keep = attention_math.dropout_keep_mask(seeds, s_q, self.k.shape[1], self.dropout)
        args = (self.q, self.k, self.v, self.bias, self.dout, self.visible, self.scale, self.bias_type, keep,
                self.dropout)
        ref = reference_attention(*args, jnp.float32)
        low = reference_attention(*args, self.dtype)
        out = results["out"]
        assert out.shape == (b, s_q, h_q, self.v.shape[3]) and out.dtype == self.dtype
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            assert_close_to_reference(name, results[name], ref[i], low[i])
        if self.bias is not None:
            dbias = results["dbias"]
            assert dbias.shape == self.bias.shape and dbias.dtype == self.bias.dtype
            assert_close_to_reference("dbias", dbias, ref[4], low[4])


def make_case(
    backend,
    layout=QKVLayout.BSHD_BSHD_BSHD,
    mask=AttnMaskType.NO_MASK,
    dtype=jnp.float32,
    b=2,
    s_q=32,
    s_kv=32,
    h_q=4,
    h_kv=4,
    d_qk=16,
    d_v=16,
    window=None,
    bias_type=AttnBiasType.NO_BIAS,
    bias_shape=None,
    dropout=0.0,
    desc_kind="seqlens",
    m=1,
    seed=0,
    segments=None,
    bottom_right_diagonal=None,
) -> Case:
    """Inputs for one configuration (skips when ``backend`` cannot run it here)."""
    layout, mask = to_common(layout, QKVLayout, "layout"), to_common(mask, AttnMaskType, "mask")
    fmt = layout.qkv_format
    skip_unless_backend_runs(
        backend, is_training=True, q_dtype=dtype, kv_dtype=dtype, qkv_layout=layout, attn_bias_type=bias_type,
        attn_mask_type=mask, dropout_probability=dropout, q_num_heads=h_q, kv_num_heads=h_kv, q_max_seqlen=s_q,
        kv_max_seqlen=s_kv, head_dim_qk=d_qk, head_dim_v=d_v, window_size=window, bias_shape=bias_shape,
    )
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    seg_q, seg_kv = segments or _segments(rng, fmt, mask, b, s_q, s_kv, m, desc_kind)
    desc = descriptor(desc_kind, seg_q, seg_kv) if (mask.is_padding() or fmt == QKVFormat.THD) else None
    q, k, v = random_qkv(key, b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype)
    bias = None
    if bias_type != AttnBiasType.NO_BIAS:
        bias = jax.random.normal(jax.random.fold_in(key, 7), bias_shape, jnp.float32).astype(dtype)
    dout = jax.random.normal(jax.random.fold_in(key, 9), (b, s_q, h_q, d_v), jnp.float32).astype(dtype)
    scale = d_qk**-0.5
    dropout_key = jax.random.PRNGKey(seed + 1000)
    kwargs = dict(
        sequence_descriptor=desc, seed=dropout_key if dropout else None, attn_bias_type=bias_type,
        attn_mask_type=mask, qkv_layout=layout, scaling_factor=scale, dropout_probability=dropout,
        is_training=True, max_segments_per_seq=m, window_size=window,
    )
    if bottom_right_diagonal is not None:
        kwargs["bottom_right_diagonal"] = bottom_right_diagonal
    return Case(backend, layout, mask, dtype, seg_q, seg_kv, q, k, v, bias, dout, scale, window, bias_type, dropout,
                dropout_key, kwargs)


def run_case(backend, **config) -> dict:
    """Run one configuration through ``backend``, check it against the reference, return results."""
    case = make_case(backend, **config)
    results = case.run()
    case.check_reference(results)
    results["visible"] = case.visible
    return results


# The positional order of fused_attn_with_backend: fused_attn's without softmax_type (the tests' own order).
_BACKEND_POSITIONAL = ("qkv", "bias", "sequence_descriptor", "seed", "attn_bias_type", "attn_mask_type", "qkv_layout",
                       "scaling_factor", "dropout_probability", "is_training", "max_segments_per_seq", "window_size")


def fused_attn_with_backend(backend: str, *args, **kwargs) -> jax.Array:
    """``fused_attn`` on a named backend ('fused', 'unfused' or 'flash'), skipping selection; on CPU 'fused'
    runs the fused primitives' jnp lowering. Positional arguments follow ``_BACKEND_POSITIONAL``
    (``fused_attn``'s order without ``softmax_type``); pass the rest by keyword."""
    from transformer_engine.jax.enums import AttnSoftmaxType

    bound = dict(zip(_BACKEND_POSITIONAL, args))
    bound.update(kwargs)
    bound.setdefault("softmax_type", AttnSoftmaxType.VANILLA_SOFTMAX)
    call = te_attention._parse_call(te_attention._FusedAttnArgs(**bound))
    return te_attention._run(call, backend_named(backend, te_attention._CANDIDATES))
