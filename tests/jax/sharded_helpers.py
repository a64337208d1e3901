"""Helpers shared by the sharded fused-attention tests (test_jax_distributed_fused_attn.py on 8
devices, test_jax_two_device_mesh.py on 2): partition specs from a ``MeshResource``, one small
attention problem (forward and vjp), running it sharded on a mesh (results and compiled HLO
text), and comparing sharded with unsharded results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from te_jax_testing import attn_fn, random_qkv, skip_unless_backend_runs
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVLayout
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.sharding import batch_axes, global_shard_guard, head_axes

__all__ = ["PARTITIONER_ERRORS", "spec", "problem", "run_sharded", "assert_results"]

# The partitioning rule runs inside XLA's SPMD partitioner, which re-raises its NotImplementedError
# as a runtime error carrying the same message.
PARTITIONER_ERRORS = (NotImplementedError, jax.errors.JaxRuntimeError)


def spec(resource, rank=4):
    """Batch over dp/fsdp and heads over tp, as MeshResource names them."""
    batch = batch_axes(resource) or None
    heads = head_axes(resource) or None
    return P(batch, None, heads, None) if rank == 4 else P(batch)


def problem(b=8, s=32, h_q=8, h_kv=4, d=16, bias_shape=None, mask=AttnMaskType.PADDING_CAUSAL_MASK,
            layout=QKVLayout.BSHD_BSHD_BSHD, backend="fused", m=1):
    """``(fn, args)``: ``fn(q, k, v, bias, lens, dout) -> (out, dq, dk, dv, dbias)`` through
    ``backend`` ('fused', 'unfused' or 'selected': what ``fused_attn`` picks), and bf16 inputs for
    it (fixed seeds; ``bias`` None without ``bias_shape``). Skips where ``backend`` is 'fused' and
    a GPU's fused backend cannot run the config (e.g. dropout: the JAX launch passes none yet)."""
    skip_unless_backend_runs(
        backend, is_training=True, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, qkv_layout=layout,
        attn_bias_type=AttnBiasType.NO_BIAS if bias_shape is None else AttnBiasType.POST_SCALE_BIAS,
        attn_mask_type=mask, dropout_probability=0.0, q_num_heads=h_q, kv_num_heads=h_kv, q_max_seqlen=s,
        kv_max_seqlen=s, head_dim_qk=d, head_dim_v=d, bias_shape=bias_shape,
    )
    q, k, v = random_qkv(jax.random.PRNGKey(0), b, s, s, h_q, h_kv, d, d, jnp.bfloat16)
    dout = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32).astype(q.dtype)
    bias = None if bias_shape is None else jax.random.normal(jax.random.PRNGKey(2), bias_shape).astype(q.dtype)
    rng = np.random.default_rng(0)
    if m == 1:
        lens = jnp.asarray(rng.integers(1, s + 1, size=b), jnp.int32)
    else:
        lens = jnp.asarray(rng.integers(1, s // m + 1, size=(b, m)), jnp.int32)

    def fn(q, k, v, bias, lens, dout):
        f = attn_fn(
            backend, sequence_descriptor=SequenceDescriptor.from_seqlens(lens), seed=None,
            attn_bias_type=AttnBiasType.NO_BIAS if bias is None else AttnBiasType.POST_SCALE_BIAS,
            attn_mask_type=mask, qkv_layout=layout, scaling_factor=d**-0.5, dropout_probability=0.0,
            is_training=True, max_segments_per_seq=m,
        )
        out, vjp = jax.vjp(lambda q, k, v, bias: f((q, k, v), bias), q, k, v, bias)
        return (out, *vjp(dout))

    return fn, (q, k, v, bias, lens, dout)


def run_sharded(fn, args, mesh, resource, bias_spec=None):
    """Place ``args`` (from :func:`problem`) on ``mesh`` as ``resource`` splits them (kv heads that
    tp does not divide: replicated), jit ``fn`` under ``global_shard_guard(resource)``; return
    ``(results, compiled HLO text)``."""
    spec4 = spec(resource)
    h_kv, tp = args[1].shape[2], mesh.shape.get(resource.tp_resource, 1)
    kv_spec = spec4 if h_kv % tp == 0 else P(spec4[0])  # a kv head count tp does not divide: replicated
    shardings = [spec4, kv_spec, kv_spec, bias_spec, spec(resource, 1), spec4]
    with jax.set_mesh(mesh), global_shard_guard(resource):
        placed = [x if x is None else jax.device_put(x, NamedSharding(mesh, s or P()))
                  for x, s in zip(args, shardings)]
        jitted = jax.jit(fn)
        hlo = jitted.lower(*placed).compile().as_text()
        return jitted(*placed), hlo


def assert_results(sharded, unsharded, exact, names=("out", "dq", "dk", "dv", "dbias")):
    """Compare pairwise (skipping None): bitwise when ``exact``, else within bf16 rounding."""
    for name, a, b in zip(names, sharded, unsharded):
        if b is None:
            continue
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2, err_msg=name)
