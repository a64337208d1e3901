"""A jitted ``kv_cache_attention`` decode step is traced once per batch size over many steps: lengths, the page
table and the slots taking part live in the cache and ``step_lens`` (arrays), never in a Python value, so
sequences growing, finishing (``reset_slots``) and joining do not retrace it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.inference import init_kv_cache, init_paged_kv_cache, kv_cache_attention, reset_slots

SLOTS, MAX_SEQLEN, PAGE, H, HK, D = 3, 32, 8, 4, 2, 16


@pytest.mark.parametrize("paged", [False, True], ids=["non_paged", "paged"])
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_decode_step_traces_once_over_many_steps(paged, fmt):
    traces = []

    def step(q, k, v, cache, step_lens):
        traces.append(1)  # runs only while tracing
        return kv_cache_attention(q, k, v, cache, step_lens, qkv_format=fmt)

    jitted = jax.jit(step)
    if paged:
        cache = init_paged_kv_cache(SLOTS, SLOTS * MAX_SEQLEN // PAGE, PAGE, HK, D, jnp.float32)
    else:
        cache = init_kv_cache(SLOTS, MAX_SEQLEN, HK, D, jnp.float32)
    rng = np.random.default_rng(0)
    lengths = np.zeros(SLOTS, np.int64)
    for t in range(40):
        finished = np.flatnonzero(lengths >= np.array([13, 7, 21]))  # sequences finish; new ones join there
        if finished.size:
            cache = reset_slots(cache, jnp.asarray(finished))
            lengths[finished] = 0
        active = np.ones(SLOTS, np.int32)
        active[t % SLOTS] = t % 5 != 0  # now and then a slot sits a step out
        shape = (SLOTS, 1) if fmt == "bshd" else (SLOTS,)
        q, k, v = (jnp.asarray(rng.standard_normal(shape + (heads, D)), jnp.float32) for heads in (H, HK, HK))
        out, cache = jitted(q, k, v, cache, jnp.asarray(active))
        lengths += active
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    assert np.isfinite(np.asarray(out)).all()
    assert len(traces) == 1, f"the decode step was traced {len(traces)} times in 40 steps"
