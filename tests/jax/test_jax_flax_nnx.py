"""The Flax NNX DotProductAttention computes what the linen module computes, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax.nnx")

from transformer_engine.jax.flax import DotProductAttention as LinenDPA  # noqa: E402
from transformer_engine.jax.flax.nnx import DotProductAttention as NnxDPA  # noqa: E402


def _qkv(b=2, s=13, h=4, g=2, d=16):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(kq, (b, s, h, d)), jax.random.normal(kk, (b, s, g, d)),
            jax.random.normal(kv, (b, s, g, d)))


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
def test_nnx_matches_linen(mask):
    q, k, v = _qkv()
    linen = LinenDPA(head_dim=16, num_attention_heads=4, num_gqa_groups=2, attn_mask_type=mask)
    nnx_module = NnxDPA(16, 4, 2, attn_mask_type=mask)

    def linen_loss(q, k, v):
        return jnp.sum(linen.apply({}, q, k, v) ** 2)

    def nnx_loss(q, k, v):
        return jnp.sum(nnx_module(q, k, v) ** 2)

    want, want_grads = jax.value_and_grad(linen_loss, argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.value_and_grad(nnx_loss, argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_checks_heads_and_dropout_rngs():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="heads"):
        NnxDPA(16, 4, 1)(q, k, v)
    with pytest.raises(ValueError, match="rngs"):
        NnxDPA(16, 4, 2, attention_dropout=0.1)(q, k, v)
