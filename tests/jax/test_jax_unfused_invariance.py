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

from transformer_engine.common.attention.reduction import KEY_BLOCK, tree_sum_order
from transformer_engine.jax import attention_math
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVLayout,
    SequenceDescriptor,
    _fused_attn_with_backend,
)

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
            return _fused_attn_with_backend(
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
CASES = [(d, m, h) for m in MASKS for h in HEADS for d in DTYPES if d == "float32" or h == "gqa"]


@pytest.mark.parametrize("dtype,mask,heads", CASES, ids=[f"{m[0]}-{h}-{d}" for d, m, h in CASES])
def test_alone_padded_packed_bitwise(dtype, mask, heads):
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
