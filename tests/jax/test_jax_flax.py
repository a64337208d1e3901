"""transformer_engine.jax.flax.DotProductAttention: TE's fields, layouts, masks, dropout RNG, and
the logged fallback to the unfused path when the fused kernel is unavailable."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="Flax is not installed")

from te_jax_testing import pack, random_qkv  # noqa: E402
from transformer_engine.common import log as te_log  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVLayout,
    SequenceDescriptor,
    fused_attn,
)
from transformer_engine.jax.flax import DotProductAttention  # noqa: E402

B, S, H, G, D = 2, 16, 4, 2, 16


def _reference(q, k, v, mask=AttnMaskType.CAUSAL_MASK, desc=None, bias=None, layout=QKVLayout.BSHD_BSHD_BSHD):
    return fused_attn(pack(q, k, v, layout), bias, desc, None,
                      AttnBiasType.NO_BIAS if bias is None else AttnBiasType.POST_SCALE_BIAS, mask, layout,
                      AttnSoftmaxType.VANILLA_SOFTMAX, D**-0.5, 0.0, True)


@pytest.mark.parametrize("layout", [QKVLayout.BSHD_BSHD_BSHD, QKVLayout.BSHD_BS2HD, QKVLayout.BS3HD],
                         ids=lambda l: l.value)
def test_module_matches_fused_attn_in_each_packing(layout):
    groups = H if layout == QKVLayout.BS3HD else G
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, groups, D, D, jnp.float32)
    module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=groups, qkv_layout=layout)
    args = pack(q, k, v, layout) + (None,) * (3 - len(pack(q, k, v, layout)))
    params = module.init(jax.random.PRNGKey(1), *args)
    assert params == {} or not jax.tree.leaves(params)  # attention has no parameters
    out = jax.jit(module.apply)(params, *args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(_reference(q, k, v, layout=layout)), rtol=1e-6,
                               atol=1e-6)


def test_transpose_batch_sequence():
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
    module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, transpose_batch_sequence=True)
    sb = [jnp.swapaxes(x, 0, 1) for x in (q, k, v)]
    out = module.apply({}, *sb)
    assert out.shape == (S, B, H, D)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(out, 0, 1)), np.asarray(_reference(q, k, v)), rtol=1e-6,
                               atol=1e-6)


def test_padding_mask_array_equals_sequence_descriptor():
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
    lens = jnp.array([16, 11])
    real = jnp.arange(S)[None, :] < lens[:, None]
    masked_out = ~(real[:, None, :, None] & real[:, None, None, :])  # True = masked out (TE's convention)
    module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G,
                                 attn_mask_type=AttnMaskType.PADDING_CAUSAL_MASK)
    by_mask = module.apply({}, q, k, v, masked_out)
    by_desc = module.apply({}, q, k, v, SequenceDescriptor.from_seqlens(lens))
    np.testing.assert_array_equal(np.asarray(by_mask), np.asarray(by_desc))
    ref = _reference(q, k, v, AttnMaskType.PADDING_CAUSAL_MASK, SequenceDescriptor.from_seqlens(lens))
    np.testing.assert_allclose(np.asarray(by_desc), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_dropout_uses_the_named_rng_and_is_off_when_deterministic():
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
    module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, attention_dropout=0.3,
                                 dropout_rng_name="attn_dropout")
    eval_out = module.apply({}, q, k, v, deterministic=True)
    np.testing.assert_allclose(np.asarray(eval_out), np.asarray(_reference(q, k, v)), rtol=1e-6, atol=1e-6)
    rngs = {"attn_dropout": jax.random.PRNGKey(7)}
    train_a = module.apply({}, q, k, v, deterministic=False, rngs=rngs)
    train_b = module.apply({}, q, k, v, deterministic=False, rngs=rngs)
    other = module.apply({}, q, k, v, deterministic=False, rngs={"attn_dropout": jax.random.PRNGKey(8)})
    np.testing.assert_array_equal(np.asarray(train_a), np.asarray(train_b))
    assert not np.allclose(np.asarray(train_a), np.asarray(eval_out))
    assert not np.allclose(np.asarray(train_a), np.asarray(other))


def test_bias_and_gradients_through_the_module():
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
    bias = jax.random.normal(jax.random.PRNGKey(3), (1, H, S, S))
    module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G, window_size=(4, 0))

    def loss(q, k, v, bias):
        return jnp.sum(module.apply({}, q, k, v, None, bias) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert grads[3].shape == bias.shape


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(num_attention_heads=8), "`num_attention_heads` is 8"),
        (dict(head_dim=32), "`head_dim` is 32"),
        (dict(num_gqa_groups=1), "`num_gqa_groups` is 1"),
        (dict(qkv_layout="bshd_bs2hd"), "`value` must be None"),
        (dict(attn_mask_type="padding"), "`sequence_descriptor` must be given"),
    ],
)
def test_bad_fields_raise_naming_them(fields, words):
    q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
    module = DotProductAttention(**{**dict(head_dim=D, num_attention_heads=H, num_gqa_groups=G), **fields})
    with pytest.raises(ValueError) as info:
        module.apply({}, q, k, v)
    assert words in str(info.value)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="on CPU the fused kernel is unavailable")
def test_fallback_to_unfused_is_logged_once_with_the_reason(monkeypatch):
    monkeypatch.setattr(te_log, "_warned_once", set())
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformer_engine")
    logger.addHandler(handler)
    try:
        q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
        module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G)
        module.apply({}, q, k, v)
        module.apply({}, q, k, v)
    finally:
        logger.removeHandler(handler)
    fallbacks = [m for m in records if "fused backend supports this call" in m]
    assert len(fallbacks) == 1, records
    assert "CUDA" in fallbacks[0] and "using UnfusedDotProductAttention" in fallbacks[0]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="on CPU the fused kernel is unavailable")
def test_deterministic_training_fallback_is_reported_once_in_one_wording(monkeypatch):
    """Selection reports a deterministic training call's fallback; the module does not say it again."""
    monkeypatch.setattr(te_log, "_warned_once", set())
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformer_engine")
    logger.addHandler(handler)
    try:
        q, k, v = random_qkv(jax.random.PRNGKey(0), B, S, S, H, G, D, D, jnp.float32)
        module = DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G)
        jax.grad(lambda q: module.apply({}, q, k, v).sum())(q)
    finally:
        logger.removeHandler(handler)
    fallbacks = [m for m in records if "UnfusedDotProductAttention" in m and "Reasons" in m]
    assert len(fallbacks) == 1, records
    assert fallbacks[0].startswith("Deterministic attention requested; no fused backend supports this call")
