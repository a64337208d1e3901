"""cp = N is bitwise the public cp = 1 call on CPU (8 host devices): ``fused_attn`` with a context-parallel
mesh axis selects the backend the same call selects without one (the unfused backend here), for every mask
and format the CP path takes (BSHD causal, causal_bottom_right, no_mask; THD padding, padding_causal,
Striped and contiguous). And the THD row split of the fused primitives (forced; their jnp lowering) is
bitwise their cp = 1 call, with calls starting at a forced 16-row tile boundary.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_engine.jax.attention import (AttnBiasType, AttnMaskType, CPStrategy, QKVLayout, ReorderStrategy,
                                              SequenceDescriptor, fused_attn, inverse_reorder_causal_load_balancing,
                                              reorder_causal_load_balancing)
from transformer_engine.jax.sharding import MeshResource, global_shard_guard
from te_jax_testing import fused_attn_with_backend

if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")

B, S, H_Q, H_KV, D = 2, 64, 4, 2, 16


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def _inputs():
    rng = np.random.default_rng(3)
    shapes = ((B, S, H_Q, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H_Q, D))
    lens = np.array([[13, 30, 0, 17], [5, 20, 32, 6]])
    ids, pos = np.zeros((B, S), np.int32), np.zeros((B, S), np.int32)
    for b in range(B):
        t = 0
        for i, n in enumerate(lens[b]):
            ids[b, t:t + n], pos[b, t:t + n] = i + 1, np.arange(n)
            t += n + (i == 1)  # a padding token after the second segment
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes) + (jnp.asarray(ids),
                                                                                       jnp.asarray(pos))


def _fn(mask, layout, backend=None, window=None, **cp):
    thd = layout == QKVLayout.THD_THD_THD

    def loss(q, k, v, dout, ids, pos):
        desc = SequenceDescriptor.from_segment_ids_and_pos(ids, pos) if thd else None
        args = ((q, k, v), None, desc, None, AttnBiasType.NO_BIAS, mask, layout)
        kwargs = dict(scaling_factor=0.25, max_segments_per_seq=4 if thd else 1, **cp)
        if window is not None:
            kwargs["window_size"] = window
        out = fused_attn(*args, **kwargs) if backend is None else fused_attn_with_backend(backend, *args, **kwargs)
        return jnp.sum(out * dout), out

    def fn(*args):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(*args)
        return (out, *grads)

    return jax.jit(fn)


def _run(mask, layout, cp, strategy, load_balanced, backend=None, window=None, stripe=None):
    thd = layout == QKVLayout.THD_THD_THD
    inputs = _inputs()
    expected = _fn(mask, layout, backend, window)(*inputs)
    order = ReorderStrategy.Striped if thd or stripe is not None else ReorderStrategy.DualChunkSwap
    args = [reorder_causal_load_balancing(x, order, cp, 1, stripe) if load_balanced else x for x in inputs]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // cp, cp), ("dp", "cp"))
    with mesh, global_shard_guard(MeshResource(dp_resource="dp" if 8 // cp <= B else None, cp_resource="cp")):
        spec = P("dp" if 8 // cp <= B else None, "cp")
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
        got = _fn(mask, layout, backend, window, context_parallel_strategy=strategy,
                  context_parallel_causal_load_balanced=load_balanced,
                  **({} if stripe is None else dict(stripe_size=stripe)))(*placed)
    if load_balanced:
        got = [inverse_reorder_causal_load_balancing(x, order, cp, 1, stripe) for x in got]
    for name, a, e in zip(("out", "dq", "dk", "dv"), got, expected):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(e).view(np.uint32), err_msg=name)


CASES = [  # (mask, layout, cp, strategy, load balanced)
    (AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 2, CPStrategy.ALL_GATHER, True),
    (AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK, QKVLayout.BSHD_BSHD_BSHD, 4, CPStrategy.RING, False),
    (AttnMaskType.NO_MASK, QKVLayout.BSHD_BSHD_BSHD, 8, CPStrategy.RING, True),
    (AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD, 8, CPStrategy.ALL_GATHER, True),
    (AttnMaskType.PADDING_MASK, QKVLayout.THD_THD_THD, 4, CPStrategy.RING, False),
]


@pytest.mark.parametrize("mask,layout,cp,strategy,lb", CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_public_cp_call_is_bitwise_the_public_cp1_call(mask, layout, cp, strategy, lb):
    _run(mask, layout, cp, strategy, lb)


def test_public_striped_bshd_call_is_bitwise_the_public_cp1_call():
    """BSHD input in the Striped order (``stripe_size``) on the backend the call selects (the unfused one
    here: every rank's rows gathered back into token order)."""
    _run(AttnMaskType.CAUSAL_MASK, QKVLayout.BSHD_BSHD_BSHD, 4, CPStrategy.RING, True, stripe=4)


@pytest.mark.parametrize("mask,cp,strategy,lb", [
    (AttnMaskType.PADDING_CAUSAL_MASK, 2, CPStrategy.RING, True),
    (AttnMaskType.PADDING_MASK, 8, CPStrategy.ALL_GATHER, True),
    (AttnMaskType.PADDING_CAUSAL_MASK, 4, CPStrategy.ALL_GATHER, False),
], ids=lambda x: getattr(x, "value", str(x)))
def test_thd_row_split_is_bitwise_the_fused_cp1_call(mask, cp, strategy, lb, monkeypatch):
    from transformer_engine.jax import context_parallel

    monkeypatch.setattr(context_parallel, "tile_alignment", lambda *args, **kwargs: 16)
    _run(mask, QKVLayout.THD_THD_THD, cp, strategy, lb, backend="fused")


@pytest.mark.parametrize("cp,strategy,lb", [(2, CPStrategy.RING, True), (4, CPStrategy.ALL_GATHER, False),
                                            (4, CPStrategy.RING, True)], ids=lambda x: getattr(x, "name", str(x)))
def test_thd_sliding_window_row_split_is_bitwise_the_fused_cp1_call(cp, strategy, lb, monkeypatch):
    """A causal sliding window (5 keys back) runs split by the plan (the whole-rows path is not taken), with
    calls from a forced 16-row tile boundary, bitwise the fused cp = 1 call."""
    from transformer_engine.jax import context_parallel

    def whole_rows(*args):
        raise AssertionError("the sliding window ran the whole gathered rows on every rank")

    monkeypatch.setattr(context_parallel, "_thd_cp_attention", whole_rows)
    monkeypatch.setattr(context_parallel, "tile_alignment", lambda *args, **kwargs: 16)
    _run(AttnMaskType.PADDING_CAUSAL_MASK, QKVLayout.THD_THD_THD, cp, strategy, lb, backend="fused", window=(5, 0))


@pytest.mark.parametrize("mask,cp,stripe,window", [
    (AttnMaskType.PADDING_CAUSAL_MASK, 2, 16, None),  # two stripes per rank
    (AttnMaskType.PADDING_MASK, 4, 8, None),
    (AttnMaskType.PADDING_CAUSAL_MASK, 4, 16, (5, 0)),  # one stripe per rank, a sliding window
], ids=lambda x: getattr(x, "value", str(x)))
def test_thd_striped_plan_keeps_each_ranks_own_rows_bitwise(mask, cp, stripe, window, monkeypatch):
    """Striped input with one or two stripes per rank runs the plan in its own STRIPED order: each rank's kept
    rows are its own (no permutation of gathered results), bitwise the fused cp = 1 call."""
    from transformer_engine.jax import context_parallel

    def permuted(*args, **kwargs):
        raise AssertionError("the kept rows were exchanged: the plan did not run the Striped order")

    monkeypatch.setattr(context_parallel, "_permute_chunks", permuted)
    monkeypatch.setattr(context_parallel, "tile_alignment", lambda *args, **kwargs: 16)
    _run(mask, QKVLayout.THD_THD_THD, cp, CPStrategy.RING, True, backend="fused", window=window, stripe=stripe)
