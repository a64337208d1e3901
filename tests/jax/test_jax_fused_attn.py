"""fused_attn numerics against an independent fp32 reference: layouts, masks and windows, GQA/MQA,
dtypes, bias, dropout, THD with each SequenceDescriptor form, rows that see no key.

Both backends are checked: ``fused`` (the fused primitives: on CPU their jnp lowering, on a GPU
the Triton kernels) and ``unfused`` (jnp math differentiated by JAX). Tolerances follow
FlashAttention's rule (twice the framework's own low-precision error, see te_jax_testing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_testing import BACKENDS, LAYOUTS, MASKS, Segments, attn_fn, max_abs, random_qkv, run_case
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVFormat, QKVLayout
from transformer_engine.jax import attention_math


def _layout_heads(layout):
    """qkv-packed layouts need h_q == h_kv; kv-packed and separate layouts test GQA."""
    return (4, 4) if QKVLayout(layout).packing == "qkv" else (4, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_layouts(backend, layout):
    h_q, h_kv = _layout_heads(layout)
    is_thd = QKVLayout(layout).qkv_format == QKVFormat.THD
    run_case(
        backend, layout=layout, mask=AttnMaskType.PADDING_CAUSAL_MASK, dtype=jnp.float16, s_q=40, s_kv=40,
        h_q=h_q, h_kv=h_kv, m=3 if is_thd else 1, desc_kind="offsets" if is_thd else "seqlens",
    )


def _window_for(mask, windowed):
    if not windowed:
        return None
    return (5, 0) if AttnMaskType(mask).is_causal() else (5, 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.value)
def test_masks_and_windows(backend, mask, windowed):
    # s_q != s_kv so that top-left and bottom-right diagonals differ.
    run_case(backend, mask=mask, s_q=24, s_kv=40, window=_window_for(mask, windowed), d_qk=24, d_v=16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("h_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gqa(backend, h_kv):
    run_case(backend, mask=AttnMaskType.CAUSAL_MASK, dtype=jnp.bfloat16, h_q=4, h_kv=h_kv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["fp16", "bf16", "fp32"])
def test_dtypes_odd_sizes(backend, dtype):
    run_case(backend, mask=AttnMaskType.PADDING_MASK, dtype=dtype, b=3, s_q=37, s_kv=29, d_qk=72, d_v=40, h_q=2,
             h_kv=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bias_type, bias_shape",
    [
        (AttnBiasType.POST_SCALE_BIAS, (1, 4, 24, 32)),
        (AttnBiasType.POST_SCALE_BIAS, (2, 1, 24, 32)),
        (AttnBiasType.POST_SCALE_BIAS, (2, 4, 24, 32)),
        (AttnBiasType.POST_SCALE_BIAS, (1, 1, 24, 32)),
        (AttnBiasType.PRE_SCALE_BIAS, (2, 4, 24, 32)),
    ],
    ids=["post-1hss", "post-b1ss", "post-bhss", "post-11ss", "pre-bhss"],
)
def test_bias(backend, bias_type, bias_shape):
    run_case(backend, mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, s_q=24, s_kv=32, h_kv=2,
             bias_type=bias_type, bias_shape=bias_shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_matches_reference_with_the_same_mask(backend):
    run_case(backend, mask=AttnMaskType.CAUSAL_MASK, dropout=0.25, h_kv=2)


def test_dropout_mask_statistics_and_reproducibility():
    words = attention_math.seed_words(jax.random.PRNGKey(3))
    seeds = attention_math.head_seeds(words, 4, 8)
    keep = np.asarray(attention_math.dropout_keep_mask(seeds, 128, 128, 0.3))
    assert abs(1.0 - keep.mean() - 0.3) < 0.01
    # Each (row, head) draws its own mask; the same key draws the same masks.
    assert not np.array_equal(keep[0, 0], keep[0, 1]) and not np.array_equal(keep[0, 0], keep[1, 0])
    again = attention_math.dropout_keep_mask(attention_math.head_seeds(words, 4, 8), 128, 128, 0.3)
    np.testing.assert_array_equal(keep, np.asarray(again))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_off_when_not_training(backend):
    q, k, v = random_qkv(jax.random.PRNGKey(0), 2, 16, 16, 2, 2, 16, 16, jnp.float32)
    kwargs = dict(sequence_descriptor=None, attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.NO_MASK,
                  qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=0.25, dropout_probability=0.5)
    inference = attn_fn(backend, seed=jax.random.PRNGKey(1), is_training=False, **kwargs)((q, k, v), None)
    no_dropout = attn_fn(backend, seed=None, is_training=True, **{**kwargs, "dropout_probability": 0.0})(
        (q, k, v), None)
    np.testing.assert_array_equal(np.asarray(inference), np.asarray(no_dropout))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "desc_kind, mask",
    [
        ("seqlens", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK),
        ("offsets", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK),
        ("segment_ids", AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK),
        ("offsets", AttnMaskType.PADDING_MASK),
        ("segment_ids", AttnMaskType.PADDING_CAUSAL_MASK),
    ],
    ids=lambda x: getattr(x, "value", x),
)
def test_thd_sequence_descriptors(backend, desc_kind, mask):
    run_case(backend, layout=QKVLayout.THD_THD_THD, mask=mask, s_q=48, s_kv=48, h_kv=2, m=3, desc_kind=desc_kind,
             dtype=jnp.bfloat16)


_ALIGNMENT_CASES = [
    # (mask, s_q, s_kv, bottom_right_diagonal): both conventions where s_q < s_kv and s_q > s_kv.
    (AttnMaskType.NO_MASK, 24, 40, None), (AttnMaskType.NO_MASK, 24, 40, True),
    (AttnMaskType.NO_MASK, 40, 24, None), (AttnMaskType.NO_MASK, 40, 24, True),
    (AttnMaskType.PADDING_MASK, 24, 40, False), (AttnMaskType.PADDING_MASK, 40, 24, True),
    # The causal masks fix the diagonal whatever is passed.
    (AttnMaskType.CAUSAL_MASK, 24, 40, True), (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, 40, 24, False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask,s_q,s_kv,bottom_right", _ALIGNMENT_CASES,
                         ids=lambda x: getattr(x, "value", str(x)))
def test_sliding_window_diagonal_alignment(backend, mask, s_q, s_kv, bottom_right):
    """Windows follow TransformerEngine-JAX (top-left unless the mask is bottom-right causal, as its
    make_swa_mask), and ``bottom_right_diagonal=True`` moves the non-causal masks' diagonal to the
    bottom-right corner (TransformerEngine-PyTorch's convention)."""
    window = (5, 0) if mask.is_causal() else (5, 3)
    results = run_case(backend, mask=mask, s_q=s_q, s_kv=s_kv, window=window, bottom_right_diagonal=bottom_right,
                       d_qk=16, d_v=16, h_kv=2)
    # What the reference checked the outputs against, stated for the full rows of a no-padding mask.
    diag_bottom_right = mask.is_bottom_right() or (not mask.is_causal() and bool(bottom_right))
    if not mask.is_padding():
        rel = np.arange(s_kv)[None, :] - np.arange(s_q)[:, None] - ((s_kv - s_q) if diag_bottom_right else 0)
        expected = (rel >= -window[0]) & (rel <= window[1])
        for row in results["visible"][:, 0]:
            np.testing.assert_array_equal(row, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_thd_sliding_window(backend):
    run_case(backend, layout=QKVLayout.THD_T2HD, mask=AttnMaskType.PADDING_CAUSAL_MASK, s_q=48, s_kv=48, m=3,
             desc_kind="segment_ids", window=(4, 0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_give_zero_output_and_gradient(backend):
    """Regression guard: a query whose keys are all masked must give 0, not NaN, forward and back."""
    b, s = 3, 16
    seg_q = Segments(np.array([[16], [7], [16]], np.int32), np.zeros((3, 1), np.int32), s)
    seg_kv = Segments(np.array([[16], [0], [3]], np.int32), np.zeros((3, 1), np.int32), s)  # row 1: no keys
    # Bottom-right causal with 16 queries and 3 keys: the first 13 queries of row 2 see nothing.
    res = run_case(backend, mask=AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK, b=b, s_q=s, s_kv=s,
                   segments=(seg_q, seg_kv))
    blind = ~np.asarray(res["visible"]).any(-1)[:, 0]  # [b, s_q]
    assert blind[1].all() and blind[2, :13].all() and not blind[2, 13:].any()
    for name in ("out", "dq", "dk", "dv"):
        assert np.isfinite(np.asarray(res[name])).all(), name
    assert max_abs(np.asarray(res["out"])[blind]) == 0.0
    assert max_abs(np.asarray(res["dq"])[blind]) == 0.0
    assert max_abs(res["dk"][1]) == 0.0 and max_abs(res["dv"][1]) == 0.0
