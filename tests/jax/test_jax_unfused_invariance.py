"""Batch, padding and packing invariance of the JAX unfused attention path (jnp math, CPU).

The promise: the same sequence gives the same outputs and gradients, bit for bit, alone, inside a
batch padded to any length, or packed (THD) next to other sequences at any offset, and run after
run. ``attention_math.unfused_attention`` keeps it through the fixed reduction structure of
``transformer_engine/common/attention/reduction.py`` (the PyTorch unfused path's): each sequence in
a slot of its own from position 0, 64 x 64 block products, adjacent-pair trees. Each test runs one
target sequence alone, padded next to longer sequences at several padded lengths (across block and
tree-level boundaries), and packed, and compares the target's output and q/k/v gradients with
``np.testing.assert_array_equal``. Accuracy is checked against an fp64 reference written here.
Mirrors ``tests/pytorch/test_unfused_invariance.py``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from case_grid import grid

from reduction_reference import tree_sum_order
from transformer_engine.common.attention.reduction import KEY_BLOCK
from transformer_engine.jax import attention_math
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVLayout,
    SequenceDescriptor,
)
from te_jax_testing import fused_attn_with_backend

SCALE = 0.25
D = 16
L = 70  # the target sequence: more than one key/query block, not a multiple of one
OTHERS = (150, 3, 97)  # its neighbours: longer (more blocks, deeper trees) and shorter
PADS = (L + 29, 150, 4 * KEY_BLOCK + 9)
DTYPES = ("float32", "float16", "bfloat16")

# (name, mask alone, mask in a padded/packed batch, window)
MASKS = (
    ("no_mask", AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK, None),
    ("causal", AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK, None),
    ("causal_bottom_right", AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
     None),
    ("sliding_window", AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK, (17, 0)),
    ("two_sided_window", AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK, (9, 5)),
)


def _seq(n, seed, hq, hk, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    mk = lambda h: (rng.standard_normal((n, h, D)) * scale).astype(np.float32)  # noqa: E731
    return tuple(jnp.asarray(x, dtype) for x in (mk(hq), mk(hk), mk(hk), mk(hq)))  # q, k, v, dO


def _batch(hq, hk, dtype, scale=1.0):
    target = _seq(L, 1, hq, hk, dtype, scale)
    others = [_seq(n, 10 + i, hq, hk, dtype, scale) for i, n in enumerate(OTHERS)]
    return target, others


@functools.lru_cache(maxsize=None)
def _attention(layout, mask, window, bias_type, softmax_type, dropout, max_segments):
    """One jitted (output, dq, dk, dv[, dbias, dsink]) function per configuration."""

    def run(q, k, v, dout, descriptor, bias, offset):
        def f(q, k, v, bias, offset):
            return fused_attn_with_backend(
                "unfused", (q, k, v), bias, descriptor, jnp.uint32(7) if dropout else None, bias_type, mask,
                layout, SCALE, dropout, dropout > 0.0, max_segments, window, softmax_type=softmax_type,
                softmax_offset=offset)

        out, vjp = jax.vjp(f, q, k, v, bias, offset)
        return (out,) + vjp(dout)

    return jax.jit(run)


def _call(q, k, v, dout, layout, mask, window, descriptor=None, bias=None, bias_type=AttnBiasType.NO_BIAS,
          softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, offset=None, dropout=0.0, max_segments=1):
    fn = _attention(layout, mask, window, bias_type, softmax_type, dropout, max_segments)
    return fn(q, k, v, dout, descriptor, bias, offset)


def run_alone(seq, mask, window, **kw):
    q, k, v, do = (x[None] for x in seq)
    res = _call(q, k, v, do, QKVLayout.BSHD_BSHD_BSHD, mask, window, **kw)
    return [np.asarray(x[0]) for x in res[:4]], res[4:]


def run_padded(seqs, pad, mask, window, **kw):
    """bshd padded to ``pad`` with a padding mask; the first sequence's rows of out, dq, dk, dv."""
    lens = [s[0].shape[0] for s in seqs]

    def stack(i):  # padding is garbage (NaN): it must not leak
        rows = [jnp.concatenate([s[i], jnp.full((pad - n,) + s[i].shape[1:], jnp.nan, s[i].dtype)])
                for s, n in zip(seqs, lens)]
        return jnp.stack(rows)

    q, k, v, do = (stack(i) for i in range(4))
    desc = SequenceDescriptor.from_seqlens(jnp.asarray(lens, jnp.int32))
    res = _call(q, k, v, do, QKVLayout.BSHD_BSHD_BSHD, mask, window, descriptor=desc, **kw)
    n = lens[0]
    return [np.asarray(x[0, :n]) for x in res[:4]], res[4:]


def run_packed(seqs, mask, window, gap=0, rows=1, which=0, **kw):
    """thd: the sequences packed in order into ``rows`` rows of equal length (``gap`` unused tokens
    after each); the rows of sequence ``which``."""
    lens = [s[0].shape[0] for s in seqs]
    per_row = -(-len(seqs) // rows)
    groups = [list(range(len(seqs)))[r * per_row:(r + 1) * per_row] for r in range(rows)]
    width = max(sum(lens[i] + gap for i in g) for g in groups) + 3
    seqlens, offsets, where = [], [], {}
    for r, g in enumerate(groups):
        pos, sl, off = 0, [], []
        for i in g:
            where[i] = (r, pos)
            sl.append(lens[i])
            off.append(pos)
            pos += lens[i] + gap
        seqlens.append(sl + [0] * (per_row - len(g)))
        offsets.append(off + [pos] * (per_row + 1 - len(g)))

    def pack(i):
        out = []
        for g in groups:
            parts = []
            for j in g:
                parts += [seqs[j][i], jnp.full((gap,) + seqs[j][i].shape[1:], jnp.nan, seqs[j][i].dtype)]
            row = jnp.concatenate(parts)
            out.append(jnp.concatenate([row, jnp.full((width - row.shape[0],) + row.shape[1:], jnp.nan, row.dtype)]))
        return jnp.stack(out)

    q, k, v, do = (pack(i) for i in range(4))
    desc = SequenceDescriptor.from_seqlens_and_offsets(jnp.asarray(seqlens, jnp.int32), jnp.asarray(offsets, jnp.int32))
    res = _call(q, k, v, do, QKVLayout.THD_THD_THD, mask, window, descriptor=desc, max_segments=per_row, **kw)
    r, start = where[which]
    n = lens[which]
    return [np.asarray(x[r, start:start + n]) for x in res[:4]], res[4:]


def assert_same(a, b, what):
    for name, x, y in zip(("out", "dq", "dk", "dv"), a[0], b[0]):
        assert np.isfinite(np.asarray(x, np.float32)).all(), f"{what}: {name} not finite"
        try:
            np.testing.assert_array_equal(x, y)
        except AssertionError:
            rows = (x != y).reshape(x.shape[0], -1).any(-1).sum()
            raise AssertionError(f"{what}: {name} differs bitwise in {rows} of {x.shape[0]} rows") from None


HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (4, 1)}


# every mask and head grouping in fp32; fp16/bf16 with GQA (the structure is the dtype's; fewer compiles)
@pytest.mark.parametrize("mask,heads,dtype", grid("mask,heads,dtype", {m[0]: m for m in MASKS},
                                                  {"gqa": "gqa", "mha": "mha", "mqa": "mqa"}, DTYPES,
                                                  keep=lambda m, h, d: d == "float32" or h == "gqa"))
def test_alone_padded_packed_bitwise(mask, heads, dtype):
    _, mask_alone, mask_batch, window = mask
    heads = HEADS[heads]
    target, others = _batch(*heads, dtype)
    ref = run_alone(target, mask_alone, window)
    assert_same(ref, run_alone(target, mask_alone, window), "repeated run")
    assert_same(ref, run_padded([target], L, mask_batch, window), "alone, padding mask")
    for pad in PADS:
        assert_same(ref, run_padded([target], pad, mask_batch, window), f"alone padded to {pad}")
    assert_same(ref, run_padded([target] + others, 3 * KEY_BLOCK + 5, mask_batch, window), "batch padded")
    assert_same(ref, run_packed([target] + others, mask_batch, window), "packed")
    assert_same(ref, run_packed([target] + others, mask_batch, window, gap=5), "packed with gaps")
    assert_same(ref, run_packed(others + [target], mask_batch, window, which=3), "last in a packed row")
    assert_same(ref, run_packed(others + [target], mask_batch, window, rows=2, which=3), "second row, packed")


@pytest.mark.parametrize("bias_type", [AttnBiasType.POST_SCALE_BIAS, AttnBiasType.PRE_SCALE_BIAS],
                         ids=["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("mask_alone,mask_batch", [(AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK),
                                                   (AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK)],
                         ids=["no_mask", "causal"])
def test_bias_bitwise(bias_type, mask_alone, mask_batch):
    """A [b, h, s, s] bias: the target's block at its place in each padded or packed bias (garbage
    elsewhere); its bias gradient too."""
    target, others = _batch(2, 2, "float32")
    rng = np.random.default_rng(5)
    bias = rng.standard_normal((1, 2, L, L)).astype(np.float32)

    def full(b, s, r0=0, c0=0, row=0):
        x = rng.standard_normal((b, 2, s, s)).astype(np.float32) * 100.0
        x[row, :, r0:r0 + L, c0:c0 + L] = bias[0]
        return jnp.asarray(x)

    kw = dict(bias_type=bias_type)
    ref = run_alone(target, mask_alone, None, bias=jnp.asarray(bias), **kw)
    ref_dbias = np.asarray(ref[1][0][0])
    for seqs, pad in (([target], L + 29), ([target], 150), ([target] + others, 150)):
        got = run_padded(seqs, pad, mask_batch, None, bias=full(len(seqs), pad), **kw)
        assert_same(ref, got, f"padded to {pad}")
        np.testing.assert_array_equal(ref_dbias, np.asarray(got[1][0][0, :, :L, :L]), f"bias gradient, pad {pad}")
    # packed last in one row, after the others (at offset 250)
    start = sum(OTHERS)
    got = run_packed(others + [target], mask_batch, None, which=3, bias=full(1, start + L + 3, start, start), **kw)
    assert_same(ref, got, "packed")
    np.testing.assert_array_equal(ref_dbias, np.asarray(got[1][0][0, :, start:start + L, start:start + L]),
                                  "bias gradient, packed")


@pytest.mark.parametrize("softmax_type", [AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, AttnSoftmaxType.LEARNABLE_SOFTMAX],
                         ids=["off_by_one", "learnable"])
def test_sink_softmax_bitwise(softmax_type):
    target, others = _batch(4, 2, "float32")
    offset = None
    if softmax_type == AttnSoftmaxType.LEARNABLE_SOFTMAX:
        offset = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
    kw = dict(softmax_type=softmax_type, offset=offset)
    ref = run_alone(target, AttnMaskType.CAUSAL_MASK, None, **kw)
    for pad in PADS:
        assert_same(ref, run_padded([target] + others[:1], max(pad, OTHERS[0]), AttnMaskType.PADDING_CAUSAL_MASK,
                                    None, **kw), f"padded to {pad}")
    assert_same(ref, run_packed(others + [target], AttnMaskType.PADDING_CAUSAL_MASK, None, which=3, **kw), "packed")
    if softmax_type == AttnSoftmaxType.LEARNABLE_SOFTMAX:  # the sink's gradient: the target alone in a padded row
        alone_padded = run_padded([target], 150, AttnMaskType.PADDING_CAUSAL_MASK, None, **kw)
        np.testing.assert_array_equal(np.asarray(ref[1][1]), np.asarray(alone_padded[1][1]))


@pytest.mark.parametrize("mask_alone,mask_batch", [(AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK),
                                                   (AttnMaskType.CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_MASK)],
                         ids=["no_mask", "causal"])
def test_dropout_bitwise(mask_alone, mask_batch):
    """Dropout's mask is keyed by (seed, row, head, token positions in the row): the target keeps its
    bits alone, padded to any length in any batch and packed first in its row (row 0, offset 0);
    and the dropout really acts (the result differs from no dropout)."""
    target, others = _batch(4, 2, "float32")
    kw = dict(dropout=0.25)
    ref = run_alone(target, mask_alone, None, **kw)
    assert_same(ref, run_alone(target, mask_alone, None, **kw), "repeated run")
    for pad in PADS:
        assert_same(ref, run_padded([target] + others, max(pad, 150), mask_batch, None, **kw), f"padded to {pad}")
    assert_same(ref, run_packed([target] + others, mask_batch, None, **kw), "packed first")
    assert_same(ref, run_packed([target] + others, mask_batch, None, gap=5, **kw), "packed first, with gaps")
    plain = run_alone(target, mask_alone, None)
    assert not np.array_equal(plain[0][0], ref[0][0])


def test_sbhd_matches_bshd_bitwise():
    target, _ = _batch(4, 2, "float32")
    ref = run_alone(target, AttnMaskType.CAUSAL_MASK, None)
    q, k, v, do = (x[:, None] for x in target)
    res = _call(q, k, v, do, QKVLayout.SBHD_SBHD_SBHD, AttnMaskType.CAUSAL_MASK, None)
    assert_same(ref, ([np.asarray(x[:, 0]) for x in res[:4]], ()), "sbhd")


def test_repeated_runs_bitwise():
    target, others = _batch(4, 2, "float32")
    first = run_packed([target] + others, AttnMaskType.PADDING_CAUSAL_MASK, (17, 0), rows=2)
    for _ in range(3):
        assert_same(first, run_packed([target] + others, AttnMaskType.PADDING_CAUSAL_MASK, (17, 0), rows=2), "repeat")


def _reference(seq, causal, window, dtype=np.float64):
    """Definition in ``dtype`` (plain softmax over the whole sequence), with its VJP, in numpy."""
    q, k, v, do = (np.asarray(x, np.float32).astype(dtype) for x in seq)
    group = q.shape[1] // k.shape[1]
    kx, vx = np.repeat(k, group, 1), np.repeat(v, group, 1)
    s = np.einsum("qhd,khd->hqk", q, kx) * SCALE
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    keep = np.ones((L, L), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) & ((j <= i + window[1]) if window[1] >= 0 else True)
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p, vx)
    dp = np.einsum("qhd,khd->hqk", do, vx)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * SCALE
    dq = np.einsum("hqk,khd->qhd", ds, kx)
    dk = np.einsum("hqk,qhd->khd", ds, q).reshape(L, k.shape[1], group, D).sum(2)
    dv = np.einsum("hqk,qhd->khd", p, do).reshape(L, k.shape[1], group, D).sum(2)
    return [out, dq, dk, dv]


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (17, 0))],
                         ids=["no_mask", "causal", "sliding_window"])
def test_accuracy_against_fp64(causal, window):
    """fp32 error against fp64 no worse than plain fp32 math (whole-matrix einsums and softmax) on
    the same inputs, for the output and the gradients."""
    target, _ = _batch(4, 2, "float32", scale=2.0)
    mask = AttnMaskType.CAUSAL_MASK if causal else AttnMaskType.NO_MASK
    got = run_alone(target, mask, window)[0]
    exact = _reference(target, causal, window)
    plain = _reference(target, causal, window, np.float32)
    for name, x, p32, e in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        err = np.abs(x.astype(np.float64) - e).max()
        err_plain = np.abs(p32.astype(np.float64) - e).max()
        assert err <= 2.0 * err_plain + 1e-7, f"{name}: error {err:.3e}, plain fp32 math {err_plain:.3e}"


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_low_precision_accuracy(dtype):
    """fp16/bf16 inputs: the output's error against fp64 is the rounding of the result to ``dtype``."""
    target, _ = _batch(4, 2, dtype)
    out = run_alone(target, AttnMaskType.CAUSAL_MASK, None)[0][0]
    exact = _reference(target, True, None)[0]
    err = np.abs(out.astype(np.float64) - exact).max()
    rounding = np.abs(np.asarray(jnp.asarray(exact, dtype), np.float64) - exact).max()
    assert err <= 2.0 * rounding, f"error {err:.3e}, rounding of the exact result to {dtype} {rounding:.3e}"


def test_tree_sum_matches_the_common_description():
    """``tree_sum`` follows ``tree_sum_order`` (in fp32, each add rounded) and ignores trailing zeros."""
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 7, 64, 100, 129):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
        level = list(x)
        while len(level) > 1:  # tree_sum_order's structure, rounding to fp32 at each add
            level = level + [np.float32(0)] * (len(level) % 2)
            level = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
        got = np.asarray(attention_math.tree_sum(jnp.asarray(x)))
        assert got == level[0]
        for extra in (1, 5, 64, 200):
            assert np.asarray(attention_math.tree_sum(jnp.concatenate([jnp.asarray(x), jnp.zeros(extra)]))) == got
    assert tree_sum_order([1.0, 2.0, 3.0]) == 6.0
    assert attention_math.tree_sum(jnp.zeros((3, 0))).shape == (3,)


def test_pytorch_unfused_path_agrees_within_rounding():
    """The PyTorch unfused path has the same blocks and trees, but torch's and XLA's fp32 ``exp``
    differ in the last bit for some inputs (checked here), so no order of operations makes the two
    bitwise equal: they are compared against fp64, each within the other's error."""
    torch = pytest.importorskip("torch")
    from transformer_engine.pytorch.attention.unfused import unfused_attention as torch_unfused

    x = np.random.default_rng(11).standard_normal(4096).astype(np.float32) * 5.0
    assert not np.array_equal(np.asarray(jnp.exp(jnp.asarray(x))), torch.exp(torch.from_numpy(x)).numpy())
    target, _ = _batch(4, 2, "float32", scale=2.0)
    got = run_alone(target, AttnMaskType.CAUSAL_MASK, (17, 0))[0]
    q, k, v, do = (torch.from_numpy(np.array(x)).unsqueeze(0) for x in target)
    for t in (q, k, v):
        t.requires_grad_()
    out = torch_unfused(q, k, v, "bshd", "causal", (17, 0), SCALE)
    out.backward(do)
    theirs = [out.detach()[0].numpy()] + [t.grad[0].numpy() for t in (q, k, v)]
    exact = _reference(target, True, (17, 0))
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), got, theirs, exact):
        err_jax = np.abs(a.astype(np.float64) - e).max()
        err_torch = np.abs(b.astype(np.float64) - e).max()
        assert err_jax <= 2.0 * err_torch + 1e-7 and err_torch <= 2.0 * err_jax + 1e-7, (name, err_jax, err_torch)
        np.testing.assert_allclose(a, b, rtol=0, atol=4.0 * max(err_jax, err_torch) + 1e-7, err_msg=name)
