"""The Flax DotProductAttention's ``decode=True``: a KV cache in the ``"cache"`` collection (Flax's convention).

``init`` with cache-sized inputs creates the cache; each ``apply(..., mutable=["cache"])`` appends the call's new
tokens. Every output row must be bitwise the row the same module gives that token in a training call over the
whole sequence (``np.testing.assert_array_equal``): prompts in chunks then token by token, slots of different
lengths stepping at different times, GQA, a sliding window and a learnable sink (its parameter shared by the
training and the decode calls). On CPU the module runs the unfused backend, on a GPU the fused kernels; both
keep a row's bits whatever the step (docs/kv_cache.rst). Bad decode inputs are refused with the argument named.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.flax import DotProductAttention

ON_GPU = jax.default_backend() == "gpu"
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
H, HK, D = (8, 2, 128) if ON_GPU else (4, 2, 16)
SLOTS, MAX_SEQLEN = 2, (320 if ON_GPU else 24)


def _tokens(n, heads, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((SLOTS, n, heads, D)), DTYPE)


def _module(**kw):
    return DotProductAttention(D, H, num_gqa_groups=HK, attn_mask_type="causal", **kw)


@pytest.mark.parametrize("options", [{}, {"window_size": (5, 0)}, {"softmax_type": "learnable"}],
                         ids=["causal", "window", "learnable_sink"])
def test_decode_rows_equal_the_training_rows(options):
    q, k, v = _tokens(MAX_SEQLEN, H, 1), _tokens(MAX_SEQLEN, HK, 2), _tokens(MAX_SEQLEN, HK, 3)
    decoder = _module(decode=True, **options)
    variables = decoder.init(jax.random.PRNGKey(0), q, k, v, deterministic=True)
    assert variables["cache"]["cached_key"].shape == (SLOTS, MAX_SEQLEN, HK, D)
    params = {"params": variables["params"]} if "params" in variables else {}
    if "params" in params:  # a learnable sink: random values, so that it matters
        params["params"] = {"softmax_offset": jnp.linspace(-1.0, 1.0, H, dtype=jnp.float32).reshape(1, H, 1, 1)}
    training = _module(**options).apply(params, q, k, v, deterministic=True)

    step = jax.jit(lambda cache, q, k, v, lens: decoder.apply({**params, "cache": cache}, q, k, v, lens,
                                                              deterministic=True, mutable=["cache"]))
    cache = variables["cache"]
    n = [0, 0]
    # slot 1 starts two steps late; prompts in chunks of 7 and 5, then one token at a time
    plan = [(7, 0), (7, 0), (1, 5), (1, 5), (1, 1), (0, 1)] + [(1, 1)] * 4
    for sizes in plan:
        t = max(sizes)
        part = [jnp.stack([jnp.pad(x[i, n[i]:n[i] + sizes[i]], ((0, t - sizes[i]), (0, 0), (0, 0)))
                           for i in range(SLOTS)]) for x in (q, k, v)]
        out, mutated = step(cache, *part, jnp.asarray(sizes, jnp.int32))
        cache = mutated["cache"]
        for i in range(SLOTS):
            np.testing.assert_array_equal(np.asarray(out[i, :sizes[i]]), np.asarray(training[i, n[i]:n[i] + sizes[i]]),
                                          err_msg=f"slot {i}, tokens {n[i]}..{n[i] + sizes[i]}")
            assert not np.asarray(out[i, sizes[i]:]).any()  # rows past a slot's new tokens are zeros
            n[i] += sizes[i]
    np.testing.assert_array_equal(np.asarray(cache["cache_lengths"]), n)


def test_every_slot_takes_the_calls_tokens_without_step_lengths():
    q, k, v = _tokens(MAX_SEQLEN, H, 4), _tokens(MAX_SEQLEN, HK, 5), _tokens(MAX_SEQLEN, HK, 6)
    decoder = _module(decode=True)
    cache = decoder.init(jax.random.PRNGKey(0), q, k, v)["cache"]
    training = _module().apply({}, q, k, v)
    rows = []
    for start, size in ((0, 9), (9, 1), (10, 1)):
        out, mutated = decoder.apply({"cache": cache}, q[:, start:start + size], k[:, start:start + size],
                                     v[:, start:start + size], mutable=["cache"])
        cache = mutated["cache"]
        rows.append(out)
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(rows, axis=1)), np.asarray(training[:, :11]))


def test_decode_refuses_what_the_cache_cannot_serve():
    q, k, v = _tokens(MAX_SEQLEN, H, 7), _tokens(MAX_SEQLEN, HK, 8), _tokens(MAX_SEQLEN, HK, 9)
    cache = _module(decode=True).init(jax.random.PRNGKey(0), q, k, v)["cache"]

    def step(module, *args, **kw):
        return module.apply({"cache": cache}, *args, mutable=["cache"], **kw)

    with pytest.raises(ValueError, match="`bias` must be None"):
        step(_module(decode=True), q[:, :1], k[:, :1], v[:, :1], None, jnp.zeros((1, H, 1, MAX_SEQLEN), DTYPE))
    with pytest.raises(ValueError, match="`attention_dropout` must be 0"):
        step(_module(decode=True, attention_dropout=0.1), q[:, :1], k[:, :1], v[:, :1], deterministic=False,
             rngs={"dropout": jax.random.PRNGKey(1)})
    with pytest.raises(ValueError, match="`qkv_layout` must be 'bshd_bshd_bshd'"):
        step(_module(decode=True, transpose_batch_sequence=True), q[:, :1], k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="`sequence_descriptor` must be None or an int array"):
        step(_module(decode=True), q[:, :1], k[:, :1], v[:, :1], jnp.ones((SLOTS, 1), jnp.int32))
    with pytest.raises(ValueError, match="`attn_mask_type`"):
        step(DotProductAttention(D, H, num_gqa_groups=HK, attn_mask_type="padding_causal_bottom_right_x",
                                 decode=True), q[:, :1], k[:, :1], v[:, :1])


def test_nnx_decode_rows_equal_the_training_rows():
    from flax import nnx

    from transformer_engine.jax.flax.nnx import DotProductAttention as NnxDotProductAttention

    q, k, v = _tokens(MAX_SEQLEN, H, 10), _tokens(MAX_SEQLEN, HK, 11), _tokens(MAX_SEQLEN, HK, 12)
    attn = NnxDotProductAttention(D, H, HK, window_size=(6, 0))
    training = attn(q, k, v, deterministic=True)
    attn.init_cache(SLOTS, MAX_SEQLEN, DTYPE)
    step = nnx.jit(lambda m, q, k, v, lens: m(q, k, v, lens, deterministic=True, decode=True))
    n = [0, 0]
    for sizes in [(5, 3), (1, 4), (0, 1), (1, 1), (2, 0)]:
        t = max(sizes)
        part = [jnp.stack([jnp.pad(x[i, n[i]:n[i] + sizes[i]], ((0, t - sizes[i]), (0, 0), (0, 0)))
                           for i in range(SLOTS)]) for x in (q, k, v)]
        out = step(attn, *part, jnp.asarray(sizes, jnp.int32))
        for i in range(SLOTS):
            np.testing.assert_array_equal(np.asarray(out[i, :sizes[i]]), np.asarray(training[i, n[i]:n[i] + sizes[i]]),
                                          err_msg=f"slot {i}")
            n[i] += sizes[i]
    np.testing.assert_array_equal(np.asarray(attn.cache_lengths[...]), n)
    with pytest.raises(ValueError, match="init_cache"):
        NnxDotProductAttention(D, H, HK)(q[:, :1], k[:, :1], v[:, :1], decode=True)
