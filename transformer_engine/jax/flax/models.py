"""A small decoder-only transformer in Flax linen, for the JAX determinism check and examples.

The same shape as :mod:`transformer_engine.pytorch.models` (pre-norm blocks: fused QKV projection
with GQA, :class:`~transformer_engine.jax.flax.DotProductAttention`, output projection, GELU MLP;
final norm; untied LM head). The token embedding is a one-hot matmul rather than a gather, whose
gradient (a scatter-add) XLA makes deterministic on GPUs only under ``--xla_gpu_deterministic_ops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_engine.common.tiny_model import TinyShape
from transformer_engine.jax.flax.module import DotProductAttention

__all__ = ["TinyConfig", "TinyTransformerLayer", "TinyTransformerLM"]


@dataclass(frozen=True)
class TinyConfig(TinyShape):
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32


class TinyTransformerLayer(nn.Module):
    cfg: TinyConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        h, g, d = cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim
        dense = lambda n, name: nn.Dense(n, dtype=cfg.dtype, name=name)  # noqa: E731
        qkv = dense((h + 2 * g) * d, "qkv")(nn.LayerNorm(dtype=cfg.dtype, name="ln_attn")(x))
        q, k, v = jnp.split(qkv, [h * d, (h + g) * d], axis=-1)
        b, s = x.shape[:2]
        attn = DotProductAttention(
            head_dim=d, num_attention_heads=h, num_gqa_groups=g, attn_mask_type=cfg.attn_mask_type,
            window_size=cfg.window_size, name="attention",
        )(q.reshape(b, s, h, d), k.reshape(b, s, g, d), v.reshape(b, s, g, d))
        x = x + dense(cfg.hidden_size, "proj")(attn.reshape(b, s, h * d))
        y = nn.LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x)
        y = dense(cfg.ffn_size, "fc1")(y)
        return x + dense(cfg.hidden_size, "fc2")(nn.gelu(y))


class TinyTransformerLM(nn.Module):
    """One-hot embedding, ``num_layers`` blocks, final norm, untied LM head. Tokens ``[b, s]``."""

    cfg: TinyConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embedding = self.param("embedding", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size))
        x = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=cfg.dtype) @ embedding.astype(cfg.dtype)
        for i in range(cfg.num_layers):
            x = TinyTransformerLayer(cfg, name=f"layer_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="head")(x)

    def loss(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross entropy in fp32 (one-hot targets: no gather/scatter)."""
        logits = self(tokens).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, self.cfg.vocab_size), axis=-1))
