"""TransformerEngine-JAX code runs unchanged: ``fused_attn``, the enums, ``SequenceDescriptor``,
``MeshResource`` / ``autocast``, ``FusedAttnHelper``, the causal load-balancing reorder and the
Flax ``DotProductAttention``, called the way TransformerEngine's own JAX tests and MaxText call
them (keyword dictionaries, positional calls, mask arrays, THD seqlens with -1 fill), checked
against the float64 reference of ``te_jax_testing``.

The configurations are TransformerEngine's test grid (layouts, masks, sequence-descriptor
kinds, bias shapes, dropout, GQA, cross attention, d_qk != d_v) at CPU-sized shapes.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from te_jax_testing import assert_close_to_reference, reference_attention
from transformer_engine.common.attention import enums as common_enums
from transformer_engine.jax import attention_math, autocast, fp8_autocast
from transformer_engine.jax.attention import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    CPStrategy,
    QKVFormat,
    QKVLayout,
    ReorderStrategy,
    SequenceDescriptor,
    fused_attn,
    inverse_reorder_causal_load_balancing,
    is_fused_attn_kernel_available,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.cpp_extensions import FusedAttnHelper, NVTE_Fused_Attn_Backend
from transformer_engine.jax.enums import from_common, to_common
from transformer_engine.jax.sharding import MeshResource, global_mesh_resource

# ------------------------------------------------------------------------------------------------
# TransformerEngine-style inputs: segment ids and positions, masks, THD seqlens/offsets
# ------------------------------------------------------------------------------------------------


def padded_ids_and_pos(b, s, pad_ratio):
    """BSHD rows: the first ``s - int(s * pad_ratio)`` tokens are real (id 1), the rest padding."""
    valid = s - int(s * pad_ratio)
    ids = np.zeros((b, s), np.int32)
    ids[:, :valid] = 1
    return ids, np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy()


def packed_ids_and_pos(b, s, num_segments, seed, min_lens=None):
    """THD rows: up to ``num_segments`` segments of random size, each with padding at its end
    (segment ids 1, 2, ...; 0 for padding); positions count from 0 within each segment.
    ``min_lens[r][k]`` bounds segment k's real length from below (kv at least as long as q)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    largest = s // num_segments
    for r in range(b):
        t = 0
        for k in range(num_segments):
            low = 1 if min_lens is None else max(1, int(min_lens[r][k]))
            size = int(rng.integers(low, max(low, largest) + 1))
            if t + size > s:
                break
            real = int(rng.integers(low, size + 1))
            ids[r, t:t + real] = k + 1
            pos[r, t:t + size] = np.arange(size)
            t += size
    return ids, pos


def runs(ids_row):
    """(start, length) of each run of equal nonzero ids in one row."""
    out, t = [], 0
    while t < len(ids_row):
        if ids_row[t] == 0:
            t += 1
            continue
        start = t
        while t < len(ids_row) and ids_row[t] == ids_row[start]:
            t += 1
        out.append((start, t - start))
    return out


def te_seqlens_and_offsets(ids):
    """TransformerEngine's THD form: seqlens ``[b, s]`` and offsets ``[b, s + 1]``, the used
    slots first, the rest -1."""
    b, s = ids.shape
    lens = np.full((b, s), -1, np.int32)
    offsets = np.full((b, s + 1), -1, np.int32)
    for r in range(b):
        for k, (start, length) in enumerate(runs(ids[r])):
            lens[r, k], offsets[r, k] = length, start
    return lens, offsets


def run_length(ids):
    """Per token: the number of tokens of its run (0 for padding)."""
    out = np.zeros_like(ids)
    for r in range(ids.shape[0]):
        for start, length in runs(ids[r]):
            out[r, start:start + length] = length
    return out


def te_mask(ids_q, ids_kv, pos_q, pos_kv, mask_type, window=None):
    """``[b, 1, s_q, s_kv]``, True = masked out (TransformerEngine's convention), from the mask
    rules: same segment, causal top-left by positions, bottom-right by positions from the end."""
    visible = (ids_q[:, :, None] == ids_kv[:, None, :]) & (ids_q[:, :, None] != 0)
    if mask_type.is_bottom_right():
        from_end_q = run_length(ids_q) - pos_q
        from_end_kv = run_length(ids_kv) - pos_kv
        visible &= from_end_q[:, :, None] <= from_end_kv[:, None, :]
        if window is not None and window[0] >= 0:
            visible &= from_end_q[:, :, None] + window[0] >= from_end_kv[:, None, :]
    else:
        if mask_type.is_causal():
            visible &= pos_q[:, :, None] >= pos_kv[:, None, :]
        if window is not None and window[0] >= 0:
            visible &= pos_kv[:, None, :] >= pos_q[:, :, None] - window[0]
    return ~visible[:, None]


# ------------------------------------------------------------------------------------------------
# One TransformerEngine-test-style run
# ------------------------------------------------------------------------------------------------


def customcall_fused_dpa(query, key, value, bias, softmax_offset, sequence_descriptor, dropout_rng, **kwargs):
    """What TransformerEngine's test does: pack by layout, then ``fused_attn(qkv, bias, desc, rng,
    softmax_offset=..., **kwargs)``."""
    layout = kwargs["qkv_layout"]
    if layout.is_qkvpacked():
        qkv_args = (jnp.stack([query, key, value], axis=-3),)
    elif layout.is_kvpacked():
        qkv_args = (query, jnp.stack([key, value], axis=-3))
    else:
        qkv_args = (query, key, value)
    return fused_attn(qkv_args, bias, sequence_descriptor, dropout_rng, softmax_offset=softmax_offset,
                      **kwargs).astype(query.dtype)


def run_te_config(b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype, layout, mask_type, seq_desc_format,
                  bias_shape=None, dropout=0.0, window=None, is_training=True):
    if layout.is_thd() and not mask_type.is_padding():
        pytest.skip("THD format requires padding masks (as in TransformerEngine)")
    if layout.is_thd() and seq_desc_format == "mask":
        pytest.skip("THD doesn't support mask input (as in TransformerEngine)")
    num_segments = 2 if layout.is_thd() else 1
    if layout.is_thd():
        ids_q, pos_q = packed_ids_and_pos(b, s_q, num_segments, seed=42)
        if layout.is_qkvpacked() or s_q == s_kv:
            ids_kv, pos_kv = ids_q, pos_q
        else:
            min_lens = None
            if window is not None or mask_type.is_bottom_right():
                min_lens = [[length for _, length in runs(ids_q[r])] + [1] * num_segments for r in range(b)]
            ids_kv, pos_kv = packed_ids_and_pos(b, s_kv, num_segments, seed=2024, min_lens=min_lens)
    else:
        ratio = 0.3 if mask_type.is_padding() else 0.0
        ids_q, pos_q = padded_ids_and_pos(b, s_q, ratio)
        ids_kv, pos_kv = padded_ids_and_pos(b, s_kv, ratio)
    reference_masked_out = te_mask(ids_q, ids_kv, pos_q, pos_kv, mask_type, window)

    if layout.is_thd():
        if seq_desc_format == "seqlens":
            (lens_q, off_q), (lens_kv, off_kv) = te_seqlens_and_offsets(ids_q), te_seqlens_and_offsets(ids_kv)
            desc = SequenceDescriptor.from_seqlens_and_offsets(
                (jnp.asarray(lens_q), jnp.asarray(lens_kv)), (jnp.asarray(off_q), jnp.asarray(off_kv)))
        else:
            desc = SequenceDescriptor.from_segment_ids_and_pos(
                (jnp.asarray(ids_q), jnp.asarray(ids_kv)), (jnp.asarray(pos_q), jnp.asarray(pos_kv)))
    elif seq_desc_format == "mask":
        desc = None if mask_type == AttnMaskType.NO_MASK else jnp.asarray(te_mask(ids_q, ids_kv, pos_q, pos_kv,
                                                                                  mask_type))
    elif seq_desc_format == "seqlens":
        desc = SequenceDescriptor.from_seqlens((jnp.asarray(ids_q.sum(-1)), jnp.asarray(ids_kv.sum(-1))))
    else:
        desc = SequenceDescriptor.from_segment_ids_and_pos(
            (jnp.asarray(ids_q), jnp.asarray(ids_kv)), (jnp.asarray(pos_q), jnp.asarray(pos_kv)))

    key = jax.random.PRNGKey(0)
    q_key, k_key, v_key, bias_key, dropout_key, dout_key = jax.random.split(key, 6)
    q = jax.random.uniform(q_key, (b, s_q, h_q, d_qk), dtype, -1.0)
    k = jax.random.uniform(k_key, (b, s_kv, h_kv, d_qk), dtype, -1.0)
    v = jax.random.uniform(v_key, (b, s_kv, h_kv, d_v), dtype, -1.0)
    dout = jax.random.uniform(dout_key, (b, s_q, h_q, d_v), dtype, -1.0)
    bias_type = AttnBiasType.NO_BIAS
    bias = None
    if bias_shape is not None:
        bias_type = AttnBiasType.POST_SCALE_BIAS
        shape = {"1HSS": (1, h_q, s_q, s_kv), "B1SS": (b, 1, s_q, s_kv), "BHSS": (b, h_q, s_q, s_kv),
                 "11SS": (1, 1, s_q, s_kv)}[bias_shape]
        bias = jax.random.uniform(bias_key, shape, dtype, -1.0)
    dropout_rng = dropout_key if dropout > 0 else None
    scaling_factor = 1.0 / np.sqrt(d_qk)

    kwargs = {
        "attn_bias_type": bias_type,
        "attn_mask_type": mask_type,
        "softmax_type": AttnSoftmaxType.VANILLA_SOFTMAX,
        "scaling_factor": scaling_factor,
        "dropout_probability": dropout,
        "is_training": is_training,
        "qkv_layout": layout,
        "max_segments_per_seq": num_segments + 1 if layout.is_thd() else 1,
        "window_size": window,
        "context_parallel_strategy": CPStrategy.DEFAULT,
        "context_parallel_causal_load_balanced": True,  # TransformerEngine's runner default
        "stripe_size": None,
        "score_mod": None,
        "score_mod_bprop": None,
        "score_mod_tensors": None,
        "score_mod_bprop_tensors": None,
    }

    def loss_and_grads(q, k, v, bias, desc, rng, dout):
        f = lambda q, k, v, bias: customcall_fused_dpa(q, k, v, bias, None, desc, rng, **kwargs)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v, bias)
        return out, vjp(dout)

    # TransformerEngine's runner: a (1, 1, 1) mesh and its positional MeshResource("dp", "cp", "tp").
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("dp", "cp", "tp"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*`with mesh:` context manager", category=DeprecationWarning)
        with mesh, autocast(mesh_resource=MeshResource("dp", "cp", "tp")):
            out, (dq, dk, dv, dbias) = jax.jit(loss_and_grads)(q, k, v, bias, desc, dropout_rng, dout)

    keep = None
    if dropout > 0 and is_training:
        seeds = attention_math.head_seeds(attention_math.seed_words(dropout_rng), b, h_q)
        keep = attention_math.dropout_keep_mask(seeds, s_q, s_kv, dropout)
    visible = jnp.asarray(~reference_masked_out)
    args = (q, k, v, bias, dout, visible, scaling_factor, common_enums.AttnBiasType(bias_type.value), keep,
            dropout if is_training else 0.0)
    ref = reference_attention(*args, jnp.float32)
    low = reference_attention(*args, dtype)
    assert out.shape == (b, s_q, h_q, d_v) and out.dtype == dtype
    for name, actual, i in (("out", out, 0), ("dq", dq, 1), ("dk", dk, 2), ("dv", dv, 3)):
        assert_close_to_reference(name, actual, ref[i], low[i])
    if bias is not None:
        assert_close_to_reference("dbias", dbias, ref[4], low[4])
    padded_q = ids_q == 0
    assert float(jnp.abs(jnp.where(padded_q[:, :, None, None], out, 0)).max()) == 0.0


# TransformerEngine's shape grid, scaled down for the CPU: (b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype, layout).
TE_SHAPES = [
    pytest.param(2, 32, 32, 4, 4, 16, 16, jnp.bfloat16, QKVLayout.BS3HD, id="SELF-QKV_PACKED"),
    pytest.param(2, 32, 32, 4, 4, 16, 16, jnp.bfloat16, QKVLayout.T3HD, id="SELF-RAGGED_QKV_PACKED"),
    pytest.param(2, 16, 32, 4, 4, 16, 16, jnp.bfloat16, QKVLayout.BSHD_BS2HD, id="CROSS-KV_PACKED"),
    pytest.param(2, 16, 32, 4, 4, 16, 16, jnp.bfloat16, QKVLayout.THD_T2HD, id="CROSS-RAGGED_KV_PACKED"),
    pytest.param(2, 32, 16, 4, 4, 16, 8, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD, id="CROSS-SEPARATE-DV"),
    pytest.param(2, 32, 16, 4, 4, 16, 8, jnp.bfloat16, QKVLayout.THD_THD_THD, id="CROSS-RAGGED_SEPARATE-DV"),
    pytest.param(2, 32, 32, 4, 2, 16, 16, jnp.bfloat16, QKVLayout.BSHD_BS2HD, id="GQA-KV_PACKED"),
    pytest.param(2, 32, 32, 4, 2, 16, 16, jnp.bfloat16, QKVLayout.THD_T2HD, id="GQA-RAGGED_KV_PACKED"),
    pytest.param(2, 16, 32, 4, 2, 16, 8, jnp.float16, QKVLayout.BSHD_BSHD_BSHD, id="FP16-CROSS-GQA-SEPARATE"),
    pytest.param(2, 16, 32, 4, 2, 16, 8, jnp.float16, QKVLayout.THD_THD_THD, id="FP16-CROSS-GQA-RAGGED_SEPARATE"),
]
TE_MASKS = [AttnMaskType.NO_MASK, AttnMaskType.PADDING_MASK, AttnMaskType.CAUSAL_MASK,
            AttnMaskType.PADDING_CAUSAL_MASK, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK]


@pytest.mark.parametrize("b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype, layout", TE_SHAPES)
def test_te_grid_shapes_and_layouts(b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype, layout):
    # One mask and descriptor kind per shape (the mask grid below crosses them all on two layouts).
    mask_type, seq_desc_format = ((AttnMaskType.PADDING_MASK, "segment_ids") if layout.is_thd()
                                  else (AttnMaskType.PADDING_CAUSAL_MASK, "seqlens"))
    run_te_config(b, s_q, s_kv, h_q, h_kv, d_qk, d_v, dtype, layout, mask_type, seq_desc_format)


@pytest.mark.parametrize("layout", [QKVLayout.BSHD_BSHD_BSHD, QKVLayout.THD_THD_THD], ids=lambda x: x.name)
@pytest.mark.parametrize("mask_type", TE_MASKS, ids=lambda x: x.name)
@pytest.mark.parametrize("seq_desc_format", ["mask", "seqlens", "segment_ids"])
def test_te_grid_masks_and_sequence_descriptors(layout, mask_type, seq_desc_format):
    if mask_type.is_bottom_right() and seq_desc_format == "mask":
        pytest.skip("covered by the seqlens and segment-id forms (one mask per row kind is enough on CPU)")
    run_te_config(2, 16, 32, 4, 2, 16, 16, jnp.float16, layout, mask_type, seq_desc_format)


@pytest.mark.parametrize("bias_shape, mask_type", [
    ("1HSS", AttnMaskType.PADDING_CAUSAL_MASK), ("B1SS", AttnMaskType.NO_MASK), ("BHSS", AttnMaskType.CAUSAL_MASK),
    ("11SS", AttnMaskType.NO_MASK),
])
def test_te_grid_post_scale_bias_shapes(bias_shape, mask_type):
    run_te_config(2, 32, 32, 4, 2, 16, 16, jnp.float16, QKVLayout.BSHD_BSHD_BSHD, mask_type, "seqlens",
                  bias_shape=bias_shape)


@pytest.mark.parametrize("is_training", [True, False], ids=["TRAINING", "INFERENCE"])
def test_te_grid_dropout(is_training):
    run_te_config(2, 32, 32, 4, 2, 16, 16, jnp.float16, QKVLayout.BSHD_BS2HD, AttnMaskType.PADDING_CAUSAL_MASK,
                  "seqlens", dropout=0.1, is_training=is_training)


@pytest.mark.parametrize("layout, mask_type", [
    (QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.CAUSAL_MASK),
    (QKVLayout.THD_THD_THD, AttnMaskType.PADDING_CAUSAL_MASK),
    (QKVLayout.BSHD_BSHD_BSHD, AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK),
], ids=["BSHD-CAUSAL", "THD-PADDING_CAUSAL", "BSHD-PADDING_CAUSAL_BOTTOM_RIGHT"])
def test_te_grid_sliding_window_with_causal_masks(layout, mask_type):
    run_te_config(2, 16, 32, 4, 2, 16, 16, jnp.float16, layout, mask_type, "seqlens", window=(32 // 10, 0))


# ------------------------------------------------------------------------------------------------
# Positional calls
# ------------------------------------------------------------------------------------------------

_B, _S, _H, _D = 2, 16, 4, 16


def _qkv():
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    return tuple(jax.random.normal(kk, (_B, _S, _H, _D), jnp.float32) for kk in keys)


def test_positional_call_in_te_order_equals_keyword_call():
    q, k, v = _qkv()
    desc = SequenceDescriptor.from_seqlens((jnp.array([16, 11]), jnp.array([16, 9])))
    positional = jax.jit(lambda q, k, v: fused_attn(
        (jnp.stack([q, k, v], axis=2),), None, desc, None, AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_MASK,
        QKVLayout.BS3HD, AttnSoftmaxType.VANILLA_SOFTMAX, 0.125, 0.0, True, 1, (-1, 0), CPStrategy.DEFAULT, False,
        "", "context", None, None, None, None, None, None))(q, k, v)
    keyword = jax.jit(lambda q, k, v: fused_attn(
        qkv=(q, k, v), bias=None, sequence_descriptor=desc, seed=None, attn_bias_type=AttnBiasType.NO_BIAS,
        attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK, qkv_layout=QKVLayout.BSHD_BSHD_BSHD,
        softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, scaling_factor=0.125, dropout_probability=0.0,
        is_training=True))(q, k, v)
    np.testing.assert_array_equal(np.asarray(positional), np.asarray(keyword))
    (ids_q, pos_q), (ids_kv, pos_kv) = padded_lens_ids(16, 11), padded_lens_ids(16, 9)
    visible = te_mask(ids_q, ids_kv, pos_q, pos_kv, AttnMaskType.PADDING_CAUSAL_MASK)
    ref = reference_attention(q, k, v, None, jnp.zeros_like(q), jnp.asarray(~visible), 0.125)[0]
    assert_close_to_reference("out", positional, ref, ref)


def padded_lens_ids(*lens):
    ids = np.stack([(np.arange(_S) < n).astype(np.int32) for n in lens])
    return ids, np.broadcast_to(np.arange(_S, dtype=np.int32), ids.shape).copy()


def test_positional_call_without_softmax_type_is_refused_not_shifted():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="`softmax_type` must be an AttnSoftmaxType.*before scaling_factor"):
        fused_attn((q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                   QKVLayout.BSHD_BSHD_BSHD, 0.125, 0.0, True)


def test_te_docstring_thd_example_with_minus_one_fill():
    """TransformerEngine's THD example: seqlens ``[b, s]`` and offsets ``[b, s + 1]`` padded with -1,
    fewer segments than slots, ``max_segments_per_seq=3``."""
    b, s = 2, 4
    qkv = jax.random.normal(jax.random.PRNGKey(0), (b, s, 3, _H, _D), jnp.float32)
    lens = jnp.asarray([[2, 1, 1, -1], [2, 1, -1, -1]])
    offsets = jnp.asarray([[0, 2, 3, 4, -1], [0, 2, 3, -1, -1]])
    desc = SequenceDescriptor.from_seqlens_and_offsets(seqlens=(lens, lens), seq_offsets=(offsets, offsets))
    out = jax.jit(lambda qkv, desc: fused_attn((qkv,), None, desc, None, AttnBiasType.NO_BIAS,
                                               AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.T3HD,
                                               AttnSoftmaxType.VANILLA_SOFTMAX, 0.125, 0, True, 3))(qkv, desc)
    ids = np.array([[1, 1, 2, 3], [1, 1, 2, 0]], np.int32)
    pos = np.array([[0, 1, 0, 0], [0, 1, 0, 1]], np.int32)
    masked = te_mask(ids, ids, pos, pos, AttnMaskType.PADDING_CAUSAL_MASK)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    ref = reference_attention(q, k, v, None, jnp.zeros_like(q), jnp.asarray(~masked), 0.125)[0]
    assert_close_to_reference("out", out, ref, ref)


def test_max_segments_per_seq_above_one_on_bshd_warns_as_te_does():
    q, k, v = _qkv()
    args = ((q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD,
            AttnSoftmaxType.VANILLA_SOFTMAX, 0.25, 0.0, True)
    with pytest.warns(UserWarning, match="max_segments_per_seq=3 applies to THD layouts only"):
        three = fused_attn(*args, 3)
    np.testing.assert_array_equal(np.asarray(three), np.asarray(fused_attn(*args, 1)))


# ------------------------------------------------------------------------------------------------
# Refused arguments name themselves
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, error, words", [
    (dict(softmax_type="learnable"), ValueError, "`softmax_offset` must be a float32 array"),
    (dict(softmax_offset=jnp.zeros((1, _H, 1, 1))), ValueError, "`softmax_offset` must be None"),
    (dict(softmax_type="sparse"), ValueError, "`softmax_type` must be one of"),
    (dict(context_parallel_strategy="ring"), ValueError, "`context_parallel_strategy` must be a CPStrategy"),
    (dict(stripe_size=0), ValueError, "`stripe_size` must be None or a positive int"),
    (dict(score_mod=lambda graph, score, tensors: score), NotImplementedError, "`score_mod` must be None"),
    (dict(score_mod_tensors={"a": 1.0}), NotImplementedError, "`score_mod_tensors` must be None"),
    (dict(context_checkpoint_name=""), ValueError, "`context_checkpoint_name` must be"),
])
def test_unsupported_te_arguments_raise_naming_them(overrides, error, words):
    q, k, v = _qkv()
    kwargs = dict(attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.CAUSAL_MASK,
                  qkv_layout=QKVLayout.BSHD_BSHD_BSHD, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX,
                  scaling_factor=0.25, dropout_probability=0.0, is_training=True)
    kwargs.update(overrides)
    with pytest.raises(error) as info:
        fused_attn((q, k, v), None, None, None, **kwargs)
    assert words in str(info.value)


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
def test_context_parallel_axis_of_size_one_runs_the_plain_path():
    """(Larger context-parallel axes: tests/jax/test_jax_context_parallel.py.)"""
    q, k, v = _qkv()
    kwargs = dict(attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.CAUSAL_MASK,
                  qkv_layout=QKVLayout.BSHD_BSHD_BSHD, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX,
                  scaling_factor=0.25, dropout_probability=0.0, is_training=True,
                  context_parallel_causal_load_balanced=True, context_parallel_axis="context")
    plain = fused_attn((q, k, v), None, None, None, **{**kwargs, "context_parallel_causal_load_balanced": False,
                                                         "context_parallel_axis": ""})
    with Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "context")):
        one = fused_attn((q, k, v), None, None, None, **kwargs)
        ring = fused_attn((q, k, v), None, None, None, **{**kwargs, "context_parallel_strategy": CPStrategy.RING})
    np.testing.assert_array_equal(np.asarray(one), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(plain))


def test_context_checkpoint_name_names_the_output():
    q, k, v = _qkv()

    def f(q):
        return fused_attn((q, k, v), None, None, None, AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK,
                          QKVLayout.BSHD_BSHD_BSHD, AttnSoftmaxType.VANILLA_SOFTMAX, 0.25, 0.0, True,
                          context_checkpoint_name="my_context").sum()

    text = str(jax.make_jaxpr(jax.grad(f))(q))
    assert "name=my_context" in text
    assert "name=context" not in text.replace("name=my_context", "")


# ------------------------------------------------------------------------------------------------
# Enums
# ------------------------------------------------------------------------------------------------

_CAUSAL = {"CAUSAL_MASK", "PADDING_CAUSAL_MASK", "CAUSAL_BOTTOM_RIGHT_MASK", "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"}
_PADDING = {"PADDING_MASK", "PADDING_CAUSAL_MASK", "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"}
_BOTTOM_RIGHT = {"CAUSAL_BOTTOM_RIGHT_MASK", "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"}


def test_mask_type_methods_as_te_defines_them():
    """``is_causal()``, ``is_padding()``, ``is_bottom_right()``: methods, as TE-JAX calls them, on the one
    mask enum (the common member is the JAX one)."""
    for name in ("NO_MASK", "PADDING_MASK", "CAUSAL_MASK", "PADDING_CAUSAL_MASK", "CAUSAL_BOTTOM_RIGHT_MASK",
                 "PADDING_CAUSAL_BOTTOM_RIGHT_MASK"):
        member = AttnMaskType[name]
        assert member.is_causal() is (name in _CAUSAL)
        assert member.is_padding() is (name in _PADDING)
        assert member.is_bottom_right() is (name in _BOTTOM_RIGHT)
        assert member.is_top_left_causal() is (name in _CAUSAL and name not in _BOTTOM_RIGHT)
        assert member is common_enums.AttnMaskType[name]


def test_qkv_layout_methods_as_te_defines_them():
    expect = {  # name: (format, packing)
        "BS3HD": ("BSHD", "qkv"), "BSHD_BS2HD": ("BSHD", "kv"), "BSHD_BSHD_BSHD": ("BSHD", "separate"),
        "T3HD": ("THD", "qkv"), "THD_T2HD": ("THD", "kv"), "THD_THD_THD": ("THD", "separate"),
    }
    for name, (fmt, packing) in expect.items():
        layout = QKVLayout[name]
        assert layout.get_qkv_format() is QKVFormat[fmt]
        assert layout.is_thd() is (fmt == "THD")
        assert (layout.is_qkvpacked(), layout.is_kvpacked(), layout.is_separate()) == (
            packing == "qkv", packing == "kv", packing == "separate")
        assert layout.to_qkvpacked() is QKVLayout["BS3HD" if fmt == "BSHD" else "T3HD"]
        assert layout.to_kvpacked() is QKVLayout["BSHD_BS2HD" if fmt == "BSHD" else "THD_T2HD"]
        assert layout.to_separate() is QKVLayout["BSHD_BSHD_BSHD" if fmt == "BSHD" else "THD_THD_THD"]
    assert QKVLayout.SBHD_SB2HD.get_qkv_format() is QKVFormat.SBHD  # the project's extra layouts
    assert {f.name for f in QKVFormat} == {"SBHD", "BSHD", "THD"}


def test_softmax_cp_and_reorder_enums():
    assert AttnSoftmaxType.from_str("vanilla") is AttnSoftmaxType.VANILLA_SOFTMAX
    assert AttnSoftmaxType.from_str("off_by_one") is AttnSoftmaxType.OFF_BY_ONE_SOFTMAX
    assert AttnSoftmaxType.from_str("learnable") is AttnSoftmaxType.LEARNABLE_SOFTMAX
    with pytest.raises(ValueError, match="`softmax_type` must be one of"):
        AttnSoftmaxType.from_str("sigmoid")
    assert [(m.name, m.value) for m in CPStrategy] == [("DEFAULT", 0), ("ALL_GATHER", 1), ("RING", 2)]
    assert [m.name for m in ReorderStrategy] == ["DualChunkSwap", "Striped"]


_ENUM_PAIRS = [(AttnBiasType, common_enums.AttnBiasType), (AttnMaskType, common_enums.AttnMaskType),
               (AttnSoftmaxType, common_enums.AttnSoftmaxType), (QKVFormat, common_enums.QKVFormat),
               (QKVLayout, common_enums.QKVLayout)]


@pytest.mark.parametrize("jax_cls,common_cls", _ENUM_PAIRS, ids=lambda c: c.__name__)
def test_jax_enums_are_the_common_enums(jax_cls, common_cls):
    """One family: each JAX name is the common class, so a member is one object in both frameworks
    (equal to itself and its string value, hashing and pickling as one); ``to_common`` takes the
    member or a string, ``from_common`` is the identity; another enum's member is refused."""
    assert jax_cls is common_cls
    for member in jax_cls:
        assert member is common_cls[member.name] and member == member.value
        assert to_common(member, common_cls, "arg") is member and from_common(member) is member
        assert to_common(member.value, common_cls, "arg") is member
        if common_cls is not AttnMaskType:  # TE-JAX's modules name these kinds by member name too
            assert to_common(member.name.lower(), common_cls, "arg") is member
        assert pickle.loads(pickle.dumps(member)) is member and {member: 1}[common_cls(member.value)] == 1
        with pytest.raises(ValueError, match="`value` must be a member of transformer_engine.common"):
            common_cls(CPStrategy.RING)
    with pytest.raises(ValueError, match="`arg` must be one of"):
        to_common(CPStrategy.RING, common_cls, "arg")
    with pytest.raises(ValueError, match="`member` must be a member of an attention enum"):
        from_common(CPStrategy.RING)


def test_te_jax_softmax_spelling_converts():
    """TE-JAX's 'off_by_one' names the one off-by-one member (whose value is 'off-by-one')."""
    member = AttnSoftmaxType.OFF_BY_ONE_SOFTMAX
    assert member.value == "off-by-one"
    assert AttnSoftmaxType("off_by_one") is member and AttnSoftmaxType.from_str("off_by_one") is member
    assert to_common("off_by_one", AttnSoftmaxType, "arg") is member
    assert to_common("OFF_BY_ONE", AttnSoftmaxType, "arg") is member


def test_internal_entry_points_take_jax_names_and_strings():
    """The code past the frontend reads the one family: JAX names, common members and string values give
    the same bits."""
    from transformer_engine.jax import context_parallel
    from transformer_engine.jax.primitives.attention import FusedAttnStatic

    q = jnp.ones((1, 4, 2, 8), jnp.float32).at[0, 1].set(2.0)
    seq = attention_math.full_seq_info(1, 4, 4)
    kwargs = dict(window_size=(-1, 0), scaling_factor=0.5, dropout_probability=0.0, is_training=True)
    outs = [attention_math.unfused_attention(q, q, q, None, seq, None, attn_mask_type=mask, attn_bias_type=bias,
                                             **kwargs)
            for mask, bias in ((common_enums.AttnMaskType.CAUSAL_MASK, common_enums.AttnBiasType.NO_BIAS),
                               (AttnMaskType.CAUSAL_MASK, AttnBiasType.NO_BIAS), ("causal", "no_bias"))]
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))
    cp = context_parallel.ContextParallel("cp", 2, CPStrategy.ALL_GATHER, False)
    args = dict(layout=QKVLayout.BSHD_BSHD_BSHD, mask=AttnMaskType.NO_MASK, bias_type=AttnBiasType.NO_BIAS,
                dropout=0.0, is_training=True, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, window=(-1, -1),
                max_segments=1, local=False)
    assert context_parallel.unsupported_reasons(cp, **args) == []
    reasons = context_parallel.unsupported_reasons(cp, **{**args, "bias_type": AttnBiasType.POST_SCALE_BIAS})
    assert len(reasons) == 1 and "`attn_bias_type` must be 'no_bias'" in reasons[0]
    static = FusedAttnStatic(attn_mask_type=AttnMaskType.CAUSAL_MASK, attn_bias_type=AttnBiasType.NO_BIAS,
                             qkv_format=QKVFormat.BSHD, window_size=(-1, 0), scaling_factor=0.5,
                             dropout_probability=0.0, is_training=True, deterministic=True)
    assert context_parallel.make_plan(static, cp).causal is True
    with pytest.raises(ValueError, match="`value` must be a member of transformer_engine.common"):
        context_parallel.make_plan(dataclasses.replace(static, attn_mask_type=CPStrategy.RING), cp)


def test_jax_enum_members_work_as_static_jit_arguments():
    """TE-JAX passes its enums as static arguments of jit: they hash, and each new member retraces."""
    q, k, v = _qkv()
    traces = []

    def attend(q, k, v, mask, layout):
        traces.append(mask)
        return fused_attn((q, k, v), None, None, None, AttnBiasType.NO_BIAS, mask, layout, scaling_factor=0.25)

    jitted = jax.jit(attend, static_argnames=("mask", "layout"))
    causal = jitted(q, k, v, mask=AttnMaskType.CAUSAL_MASK, layout=QKVLayout.BSHD_BSHD_BSHD)
    again = jitted(q, k, v, mask=AttnMaskType.CAUSAL_MASK, layout=QKVLayout.BSHD_BSHD_BSHD)
    full = jitted(q, k, v, mask=AttnMaskType.NO_MASK, layout=QKVLayout.BSHD_BSHD_BSHD)
    assert traces == [AttnMaskType.CAUSAL_MASK, AttnMaskType.NO_MASK]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(causal))
    eager = attend(q, k, v, common_enums.AttnMaskType.CAUSAL_MASK, "bshd_bshd_bshd")
    np.testing.assert_array_equal(np.asarray(causal), np.asarray(eager))
    assert not np.array_equal(np.asarray(full), np.asarray(causal))


def test_common_enum_members_and_strings_still_run():
    q, k, v = _qkv()
    runs_ = [fused_attn((q, k, v), None, None, None, bias_t, mask_t, layout_t, scaling_factor=0.25)
             for bias_t, mask_t, layout_t in (
                 (AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD),
                 (common_enums.AttnBiasType.NO_BIAS, common_enums.AttnMaskType.CAUSAL_MASK,
                  common_enums.QKVLayout.BSHD_BSHD_BSHD),
                 ("no_bias", "causal", "bshd_bshd_bshd"),
                 ("NO_BIAS", "causal", "BSHD_BSHD_BSHD"),
             )]
    for other in runs_[1:]:
        np.testing.assert_array_equal(np.asarray(other), np.asarray(runs_[0]))


# ------------------------------------------------------------------------------------------------
# MeshResource, autocast, FusedAttnHelper
# ------------------------------------------------------------------------------------------------


def test_mesh_resource_positional_order_is_te_order():
    resource = MeshResource("dp", "tp", "tpsp", "fsdp", "pp", "cp", "ep")
    assert (resource.dp_resource, resource.tp_resource, resource.tpsp_resource, resource.fsdp_resource,
            resource.pp_resource, resource.cp_resource, resource.ep_resource) == (
        "dp", "tp", "tpsp", "fsdp", "pp", "cp", "ep")


def test_autocast_sets_the_mesh_resource_and_refuses_blackwell_recipes():
    resource = MeshResource("data", "model")
    before = global_mesh_resource()
    with autocast(mesh_resource=resource):
        assert global_mesh_resource() is resource
    assert global_mesh_resource() == before
    with autocast(enabled=True, mesh_resource=resource):  # FP8 (DelayedScaling): tests/jax/test_jax_fp8.py
        assert global_mesh_resource() is resource
    from transformer_engine.common.recipe import MXFP8BlockScaling

    with pytest.raises(NotImplementedError, match="MXFP8BlockScaling.*Blackwell"):
        with autocast(enabled=True, recipe=MXFP8BlockScaling(), mesh_resource=resource):
            pass
    assert global_mesh_resource() == before
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        with fp8_autocast(mesh_resource=resource):
            assert global_mesh_resource() is resource


def test_fused_attn_helper_agrees_with_the_availability_query():
    fields = (True, jnp.bfloat16, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD, AttnBiasType.NO_BIAS,
              AttnMaskType.CAUSAL_MASK, AttnSoftmaxType.VANILLA_SOFTMAX, 0.0, 8, 2, 128, 128, 64, 64, (-1, -1))
    helper = FusedAttnHelper(*fields)
    available = is_fused_attn_kernel_available(*fields)
    assert helper.is_fused_attn_kernel_available() is available
    backends = NVTE_Fused_Attn_Backend
    expected = backends.NVTE_F16_arbitrary_seqlen if available else backends.NVTE_No_Backend
    assert helper.get_fused_attn_backend() is expected
    if jax.devices()[0].platform == "cpu":
        assert not available and any("CUDA" in r for r in helper.unavailable_reasons())
    sinks = FusedAttnHelper(*fields[:6], AttnSoftmaxType.OFF_BY_ONE_SOFTMAX, *fields[7:])
    assert sinks.is_fused_attn_kernel_available() is available  # the fused kernels take sink softmax


def test_is_non_deterministic_allowed_reads_the_variable(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert FusedAttnHelper.is_non_deterministic_allowed() is False
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    assert FusedAttnHelper.is_non_deterministic_allowed() is True


# ------------------------------------------------------------------------------------------------
# Causal load-balancing reorder
# ------------------------------------------------------------------------------------------------


def test_reorder_examples_from_te():
    tokens = jnp.arange(16)[None, :]  # [b, s]
    dual = reorder_causal_load_balancing(tokens, ReorderStrategy.DualChunkSwap, 4, 1)
    np.testing.assert_array_equal(np.asarray(dual[0]).reshape(4, 4),
                                  [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
    striped = reorder_causal_load_balancing(tokens, ReorderStrategy.Striped, 4, 1)
    np.testing.assert_array_equal(np.asarray(striped[0]).reshape(4, 4),
                                  [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]])
    striped2 = reorder_causal_load_balancing(tokens, ReorderStrategy.Striped, 2, 1, stripe_size=2)
    np.testing.assert_array_equal(np.asarray(striped2[0]), [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15])


@pytest.mark.parametrize("strategy, cp_size, stripe_size, seq_dim", [
    (ReorderStrategy.DualChunkSwap, 1, None, 1), (ReorderStrategy.DualChunkSwap, 2, None, 1),
    (ReorderStrategy.DualChunkSwap, 4, None, 0), (ReorderStrategy.DualChunkSwap, 6, None, 1),
    (ReorderStrategy.Striped, 2, None, 1), (ReorderStrategy.Striped, 4, 2, 0), (ReorderStrategy.Striped, 3, 4, 1),
])
def test_reorder_round_trips(strategy, cp_size, stripe_size, seq_dim):
    shape = [2, 2, 3, 5]
    shape[seq_dim] = 48
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    y = reorder_causal_load_balancing(x, strategy, cp_size, seq_dim, stripe_size)
    back = inverse_reorder_causal_load_balancing(y, strategy, cp_size, seq_dim, stripe_size)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    assert cp_size == 1 or not np.array_equal(np.asarray(y), np.asarray(x))
    np.testing.assert_array_equal(np.sort(np.asarray(y), axis=seq_dim), np.sort(np.asarray(x), axis=seq_dim))


@pytest.mark.parametrize("args, words", [
    ((ReorderStrategy.DualChunkSwap, 3, 1, None), "`cp_size` must be 1 or even"),
    ((ReorderStrategy.DualChunkSwap, 4, 1, None), "multiple of 2 * cp_size = 8"),
    ((ReorderStrategy.DualChunkSwap, 2, 1, 1), "`stripe_size` must be None"),
    ((ReorderStrategy.Striped, 4, 1, 0), "`stripe_size` must be a positive int"),
    ((ReorderStrategy.Striped, 4, 1, 3), "multiple of cp_size * stripe_size = 12"),
    (("DualChunkSwap", 2, 1, None), "`strategy` must be a ReorderStrategy"),
])
def test_reorder_errors_name_the_argument(args, words):
    with pytest.raises(ValueError) as info:
        reorder_causal_load_balancing(jnp.zeros((1, 20)), *args)
    assert words in str(info.value)


# ------------------------------------------------------------------------------------------------
# Flax: TransformerEngine's module path and fields, called the way MaxText calls it
# ------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
def test_flax_dot_product_attention_as_maxtext_calls_it():
    pytest.importorskip("flax", reason="Flax is not installed")
    from transformer_engine.jax.flax.transformer import DotProductAttention

    q, k, v = _qkv()
    ids, pos = padded_lens_ids(16, 11)
    mask = jnp.asarray(te_mask(ids, ids, pos, pos, AttnMaskType.PADDING_CAUSAL_MASK))
    layer = DotProductAttention(
        head_dim=_D, num_attention_heads=_H, num_gqa_groups=_H, attn_mask_type="padding_causal",
        attn_bias_type="NO_BIAS", attention_dropout=0.0, dropout_rng_name="aqt", dtype=jnp.float32,
        float32_logits=True, qkv_layout="BSHD_BSHD_BSHD", scale_factor=1.0, transpose_batch_sequence=False,
        window_size=[4, 0], context_parallel_causal_load_balanced=True, context_parallel_axis="context")
    with Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "context")):
        with pytest.warns(DeprecationWarning, match="`mask` is deprecated"):
            out = layer.apply({}, q, k, v, mask=mask)
    expected = fused_attn((q, k, v), None, SequenceDescriptor.from_seqlens(jnp.array([16, 11])), None,
                          AttnBiasType.NO_BIAS, AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD,
                          AttnSoftmaxType.VANILLA_SOFTMAX, 1.0, 0.0, True, window_size=(4, 0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    visible = ~np.asarray(te_mask(ids, ids, pos, pos, AttnMaskType.PADDING_CAUSAL_MASK, (4, 0)))
    ref = reference_attention(q, k, v, None, jnp.zeros_like(q), jnp.asarray(visible), 1.0)[0]
    assert_close_to_reference("out", out, ref, ref)


@pytest.mark.parametrize("fields, error, words", [
    (dict(dtype=jnp.bfloat16), ValueError, "`dtype` must be None or the inputs' dtype"),
    (dict(context_parallel_strategy="zigzag"), ValueError, "`context_parallel_strategy` must be one of"),
    (dict(score_mod=lambda graph, score, tensors: score), NotImplementedError, "`score_mod` must be None"),
    (dict(attn_mask_type="diagonal"), ValueError, "`attn_mask_type` must be one of"),
])
def test_flax_refused_fields_name_themselves(fields, error, words):
    pytest.importorskip("flax", reason="Flax is not installed")
    from transformer_engine.jax.flax.transformer import DotProductAttention

    q, k, v = _qkv()
    layer = DotProductAttention(**{**dict(head_dim=_D, num_attention_heads=_H), **fields})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error) as info:
            layer.apply({}, q, k, v)
    assert words in str(info.value)


def test_flax_te_mask_aliases_and_sequence_descriptor_and_mask_together():
    pytest.importorskip("flax", reason="Flax is not installed")
    from transformer_engine.jax.flax.transformer import DotProductAttention

    q, k, v = _qkv()
    desc = SequenceDescriptor.from_seqlens(jnp.array([16, 11]))
    outs = [DotProductAttention(head_dim=_D, num_attention_heads=_H, attn_mask_type=name).apply({}, q, k, v, desc)
            for name in ("padding_causal", "causal_padding")]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    with pytest.raises(ValueError, match="`mask` must be None when `sequence_descriptor` is given"):
        DotProductAttention(head_dim=_D, num_attention_heads=_H, attn_mask_type="padding").apply(
            {}, q, k, v, desc, mask=jnp.zeros((_B, 1, _S, _S), bool))

