"""Context parallelism on one GPU: the cp ranks simulated in one process (skipped without a CUDA GPU).

Each rank's step is a function of the gathered operands (``context_parallel.rank_forward`` and
``rank_backward``, what every device runs after its all-gather or ring); here the "gathered"
operands are the whole arrays, and the step runs for every rank index in turn. bf16, s = 32k,
causal with DualChunkSwap load balancing and without, GQA: in deterministic mode every rank's
output and dQ/dK/dV rows are bitwise the single-device ``fused_attn`` call's (cp = 1) for cp = 2,
4 and 8; and gradients of ``fused_attn`` inside ``shard_map`` match, on this jax version. Run as
``pytest tests/jax/test_jax_context_parallel_gpu.py`` or as a script
(``python tests/jax/test_jax_context_parallel_gpu.py [s]``), which prints one line per case.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from transformer_engine.jax import context_parallel as cpmod  # noqa: E402
from transformer_engine.jax.attention import (  # noqa: E402
    AttnBiasType,
    AttnMaskType,
    CPStrategy,
    QKVLayout,
    ReorderStrategy,
    _FusedAttnArgs,
    _parse_call,
    fused_attn,
    fused_attn_unavailable_reasons,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)


@pytest.fixture(autouse=True)
def _deterministic(monkeypatch):
    """Deterministic mode for every case (the suite's conftest clears NVTE_* before each test)."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


B, H_Q, H_KV, D = 1, 8, 2, 128
S_DEFAULT = 32768
LB = ReorderStrategy.DualChunkSwap


def _skip_reason():
    if jax.devices()[0].platform not in ("gpu", "cuda"):
        return "needs a CUDA GPU (the fused kernels)"
    reasons = fused_attn_unavailable_reasons(True, jnp.bfloat16, jnp.bfloat16, QKVLayout.BSHD_BSHD_BSHD,
                                             AttnBiasType.NO_BIAS, AttnMaskType.CAUSAL_MASK, "vanilla", 0.0,
                                             H_Q, H_KV, S_DEFAULT, S_DEFAULT, D, D)
    return "; ".join(reasons) if reasons else None


def _inputs(s):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = ((B, s, H_Q, D), (B, s, H_KV, D), (B, s, H_KV, D), (B, s, H_Q, D))
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in zip(keys, shapes))


_KW = dict(attn_bias_type=AttnBiasType.NO_BIAS, attn_mask_type=AttnMaskType.CAUSAL_MASK,
           qkv_layout=QKVLayout.BSHD_BSHD_BSHD, scaling_factor=D**-0.5, dropout_probability=0.0, is_training=True)


def _single_device(q, k, v, dout, mask=AttnMaskType.CAUSAL_MASK):
    kw = dict(_KW, attn_mask_type=mask)

    def loss(q, k, v):
        out = fused_attn((q, k, v), None, None, None, **kw)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out, *grads)


def _static(q, k, v, mask=AttnMaskType.CAUSAL_MASK):
    """The FusedAttnStatic fused_attn builds for this call (deterministic mode)."""
    call = _parse_call(_FusedAttnArgs(qkv=(q, k, v), bias=None, sequence_descriptor=None, seed=None,
                                      softmax_type="vanilla", **dict(_KW, attn_mask_type=mask)))
    assert call.static.deterministic
    return call.static


def _simulate(q, k, v, dout, cp, load_balanced, mask=AttnMaskType.CAUSAL_MASK, stripe=None):
    """Every rank's step on one GPU, the chunk calls aligned to the kernels' tiles as ``fused_attn`` aligns
    them (``tile_alignment``); results in global token order. ``stripe``: load-balanced input in the Striped
    order of such stripes (``stripe_size``) instead of DualChunkSwap."""
    s = q.shape[1]
    plan = cpmod.make_plan(_static(q, k, v, mask), cpmod.ContextParallel("cp", cp, CPStrategy.ALL_GATHER,
                                                                         load_balanced, stripe))
    plan = cpmod.make_plan(plan.static, plan.cp, cpmod.tile_alignment(plan, q, k, v))
    how = (ReorderStrategy.Striped, cp) if stripe is not None else (LB, cp)
    order = (lambda x, axis=1: reorder_causal_load_balancing(x, *how, axis, stripe)) if load_balanced else (
        lambda x, axis=1: x)
    unorder = (lambda x, axis=1: inverse_reorder_causal_load_balancing(x, *how, axis, stripe)) if load_balanced \
        else (lambda x, axis=1: x)
    n = s // cp
    local = lambda x, r, axis=1: jax.lax.dynamic_slice_in_dim(order(x, axis), r * n, n, axis)  # noqa: E731

    fwd = jax.jit(lambda r, q, k, v: cpmod.rank_forward(plan, r, local(q, r), k, v))
    outs, lses = zip(*(fwd(jnp.int32(r), q, k, v) for r in range(cp)))
    out_all = unorder(jnp.concatenate(outs, axis=1))
    lse_all = unorder(jnp.concatenate(lses, axis=3), 3)

    def bwd(r, q, k, v, out_all, lse_all, dout):
        mine = tuple(local(x, r, 3 if i == 4 else 1) for i, x in enumerate((q, k, v, out_all, lse_all, dout)))
        return cpmod.rank_backward(plan, r, mine, (q, k, v, out_all, lse_all, dout))

    bwd = jax.jit(bwd)
    grads = [bwd(jnp.int32(r), q, k, v, out_all, lse_all, dout) for r in range(cp)]
    dq, dk, dv = (unorder(jnp.concatenate([g[i] for g in grads], axis=1)) for i in range(3))
    return out_all, dq, dk, dv


def _bits(x):
    return np.asarray(x).view(np.uint16)


def check(s, cp, load_balanced, expected=None, inputs=None, mask=AttnMaskType.CAUSAL_MASK, stripe=None):
    inputs = inputs or _inputs(s)
    expected = expected or _single_device(*inputs, mask)
    actual = _simulate(*inputs, cp, load_balanced, mask, stripe)
    # Elements whose bits differ (a -0.0 against a +0.0 counts: the contract is bitwise).
    mismatched = {name: int(np.sum(_bits(a) != _bits(e))) for name, a, e in zip(("out", "dq", "dk", "dv"), actual,
                                                                                expected)}
    return mismatched


@pytest.mark.parametrize("load_balanced", [True, False], ids=["dual_chunk_swap", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallel_ranks_on_one_gpu_bitwise_equal_to_cp1(cp, load_balanced):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    s = int(os.environ.get("TE_CP_GPU_SEQLEN", S_DEFAULT))
    mismatched = check(s, cp, load_balanced)
    assert not any(mismatched.values()), f"elements differing from cp = 1: {mismatched}"


@pytest.mark.parametrize("mask", [AttnMaskType.CAUSAL_MASK, AttnMaskType.NO_MASK], ids=lambda m: m.value)
@pytest.mark.parametrize("load_balanced", [True, False], ids=["dual_chunk_swap", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_chunks_off_the_tiles_bitwise_equal_to_cp1(cp, load_balanced, mask):
    """Chunks of 1000 tokens (dual chunk) or 2000 (contiguous), not multiples of the kernels' tiles: the
    causal chunk calls start at the tile boundary before each chunk (the common plan's aligned start);
    without a mask the calls need none. Still the single-device bits."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    s = 2000 * cp
    inputs = _inputs(s)
    plan = cpmod.make_plan(_static(*inputs[:3], mask), cpmod.ContextParallel("cp", cp, CPStrategy.ALL_GATHER,
                                                                              load_balanced))
    align = cpmod.tile_alignment(plan, *inputs[:3])
    assert (s // (2 * cp if load_balanced else cp)) % align, f"chunks meet the {align}-row tiles: not a test of leads"
    mismatched = check(s, cp, load_balanced, inputs=inputs, mask=mask)
    assert not any(mismatched.values()), f"elements differing from cp = 1: {mismatched}"


@pytest.mark.parametrize("mask", [AttnMaskType.CAUSAL_MASK, AttnMaskType.NO_MASK], ids=lambda m: m.value)
@pytest.mark.parametrize("stripe", [1024, 1000], ids=["on_the_tiles", "off_the_tiles"])
@pytest.mark.parametrize("cp", [2, 4])
def test_striped_order_bitwise_equal_to_cp1(cp, stripe, mask):
    """Striped input (``stripe_size``), two stripes per rank: the plan's STRIPED calls, stripes on the kernels'
    tiles and off them (the causal calls then start at the tile boundary before each stripe). Still the
    single-device bits."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    mismatched = check(2 * cp * stripe, cp, True, mask=mask, stripe=stripe)
    assert not any(mismatched.values()), f"elements differing from cp = 1: {mismatched}"


def grad_inside_shard_map_matches(s=4096):
    """Gradients of fused_attn inside ``shard_map`` (a one-GPU mesh: the values are still typed as
    varying over its axis) equal those outside, bitwise: the manual-axes typing on this jax version."""
    q, k, v, dout = _inputs(s)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    spec = jax.sharding.PartitionSpec("dp")
    inside = jax.jit(jax.shard_map(_single_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))
    return all(np.array_equal(_bits(a), _bits(e)) for a, e in zip(inside(q, k, v, dout), _single_device(q, k, v, dout)))


def test_grad_of_fused_attn_inside_shard_map_on_gpu():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    assert grad_inside_shard_map_matches()


if __name__ == "__main__":
    reason = _skip_reason()
    if reason:
        print(f"skipped: {reason}")
        sys.exit(0)
    s = int(sys.argv[1]) if len(sys.argv) > 1 else S_DEFAULT
    inputs = _inputs(s)
    expected = _single_device(*inputs)
    ok = grad_inside_shard_map_matches()
    print(f"grad of fused_attn inside shard_map (jax {jax.__version__}): {'bitwise equal' if ok else 'DIFFERS'}",
          flush=True)
    failures = int(not ok)
    for cp in (2, 4, 8):
        for lb in (True, False):
            mismatched = check(s, cp, lb, expected, inputs)
            ok = not any(mismatched.values())
            failures += not ok
            print(f"s={s} cp={cp} load_balanced={lb}: {'bitwise equal' if ok else 'DIFFERS'} {mismatched}", flush=True)
    sys.exit(1 if failures else 0)
