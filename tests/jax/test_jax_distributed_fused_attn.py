"""Sharded fused attention on 8 CPU host devices (conftest sets
``--xla_force_host_platform_device_count=8``): batch over dp/fsdp and heads over tp as named by
``MeshResource``, the same results as unsharded (bitwise on the fused path, whose arithmetic does
not depend on the shard shape), no all-gather of q/k/v in the compiled program, and a clear error
for a sharded sequence axis (context parallelism is not supported)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from te_jax_testing import attn_fn, random_qkv
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, QKVLayout
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.jax.sharding import MeshResource, batch_axes, global_shard_guard, head_axes

if len(jax.devices()) < 8:
    pytest.skip(
        f"needs 8 devices, found {len(jax.devices())}: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        "(tests/jax/conftest.py sets it unless JAX was initialized earlier)",
        allow_module_level=True,
    )

# The partitioning rule runs inside XLA's SPMD partitioner, which re-raises its NotImplementedError
# as a runtime error carrying the same message.
_PARTITIONER_ERRORS = (NotImplementedError, jax.errors.JaxRuntimeError)

MESHES = {
    "dp8": ((8,), ("dp",), MeshResource(dp_resource="dp")),
    "dp2-tp4": ((2, 4), ("dp", "tp"), MeshResource(dp_resource="dp", tp_resource="tp")),
    "fsdp4-tp2": ((4, 2), ("fsdp", "tp"), MeshResource(fsdp_resource="fsdp", tp_resource="tp")),
    "dp2-fsdp2-tp2": ((2, 2, 2), ("dp", "fsdp", "tp"), MeshResource("dp", "tp", "fsdp")),
}


def _mesh(name):
    shape, axes, resource = MESHES[name]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), axes), resource


def _spec(resource, rank=4):
    """Batch over dp/fsdp and heads over tp, as MeshResource names them."""
    batch = batch_axes(resource) or None
    heads = head_axes(resource) or None
    return P(batch, None, heads, None) if rank == 4 else P(batch)


def _problem(b=8, s=32, h_q=8, h_kv=4, d=16, bias_shape=None, mask=AttnMaskType.PADDING_CAUSAL_MASK,
             layout=QKVLayout.BSHD_BSHD_BSHD, backend="fused", m=1):
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


def _run_sharded(fn, args, mesh, resource, bias_spec=None):
    spec4 = _spec(resource)
    h_kv, tp = args[1].shape[2], mesh.shape.get(resource.tp_resource, 1)
    kv_spec = spec4 if h_kv % tp == 0 else P(spec4[0])  # a kv head count tp does not divide: replicated
    shardings = [spec4, kv_spec, kv_spec, bias_spec, _spec(resource, 1), spec4]
    with jax.set_mesh(mesh), global_shard_guard(resource):
        placed = [x if x is None else jax.device_put(x, NamedSharding(mesh, s or P()))
                  for x, s in zip(args, shardings)]
        jitted = jax.jit(fn)
        hlo = jitted.lower(*placed).compile().as_text()
        return jitted(*placed), hlo


def _assert_results(sharded, unsharded, exact, names=("out", "dq", "dk", "dv", "dbias")):
    for name, a, b in zip(names, sharded, unsharded):
        if b is None:
            continue
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2, err_msg=name)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_equals_unsharded_bitwise_without_gathers(mesh_name, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    mesh, resource = _mesh(mesh_name)
    fn, args = _problem()
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = _run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo, "q/k/v were gathered"
    assert "custom-call" not in hlo or "CustomSPMDPartitioning" not in hlo
    _assert_results(sharded, unsharded, exact=True)
    # Each device ran on its own shard: the gradient keeps the input sharding.
    padded = lambda spec: tuple(spec) + (None,) * (4 - len(spec))  # noqa: E731
    assert padded(sharded[1].sharding.spec) == padded(_spec(resource))


@pytest.mark.parametrize("h_kv", [1, 2], ids=["mqa", "gqa"])
def test_tensor_parallel_gqa_and_mqa(h_kv):
    """tp=4 over 8 query heads: MQA replicates its one kv head on every device and all-reduces
    dK/dV (so equal within rounding); GQA with 2 kv heads (not a multiple of tp) is rejected."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = _problem(h_kv=h_kv)
    if h_kv == 2:
        with pytest.raises(_PARTITIONER_ERRORS, match="not a multiple of 4"):
            _run_sharded(fn, args, mesh, resource)
        return
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = _run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo
    _assert_results(sharded[:2], unsharded[:2], exact=True)
    _assert_results(sharded[2:4], unsharded[2:4], exact=False, names=("dk", "dv"))


@pytest.mark.parametrize(
    "bias_shape, exact",
    [((8, 8, 32, 32), True), ((1, 8, 32, 32), False), ((8, 1, 32, 32), False)],
    ids=["bhss", "1hss", "b1ss"],
)
def test_bias_and_its_gradient_under_sharding(bias_shape, exact):
    """A bias broadcast over a split axis gets its gradient summed across devices (all-reduce):
    equal within rounding (the sum's order changes); an unbroadcast bias stays bitwise."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = _problem(bias_shape=bias_shape)
    bias_spec = P("dp" if bias_shape[0] > 1 else None, "tp" if bias_shape[1] > 1 else None)
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = _run_sharded(fn, args, mesh, resource, bias_spec=bias_spec)
    assert "all-gather" not in hlo
    _assert_results(sharded[:4], unsharded[:4], exact=True)
    _assert_results(sharded[4:], unsharded[4:], exact=exact, names=("dbias",))


def test_thd_packed_rows_shard_over_batch():
    mesh, resource = _mesh("fsdp4-tp2")
    fn, args = _problem(layout=QKVLayout.THD_THD_THD, m=3)
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = _run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo
    _assert_results(sharded, unsharded, exact=True)


def test_unfused_backend_under_sharding_matches():
    """The unfused backend is plain jnp: XLA partitions it; equal within rounding."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = _problem(backend="unfused")
    unsharded = jax.jit(fn)(*args)
    sharded, _ = _run_sharded(fn, args, mesh, resource)
    _assert_results(sharded, unsharded, exact=False)


def test_sharded_sequence_axis_is_rejected():
    mesh, resource = _mesh("dp2-tp4")
    fn, args = _problem()
    q, k, v, bias, lens, dout = args
    seq_sharded = NamedSharding(mesh, P("dp", "tp", None, None))
    with jax.set_mesh(mesh), global_shard_guard(MeshResource(dp_resource="dp", cp_resource="tp")):
        placed = [jax.device_put(x, seq_sharded) for x in (q, k, v)]
        with pytest.raises(_PARTITIONER_ERRORS, match="(?s)sequence axis of `q` is sharded.*context parallelism"):
            jax.jit(fn).lower(*placed, None, lens, dout).compile()


def test_gspmd_partitioner_too(monkeypatch):
    """The same rules through GSPMD (``jax_use_shardy_partitioner=False``): infer_sharding_from_operands."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh, resource = _mesh("dp2-tp4")
        fn, args = _problem()
        unsharded = jax.jit(fn)(*args)
        sharded, hlo = _run_sharded(fn, args, mesh, resource)
        assert "all-gather" not in hlo
        _assert_results(sharded, unsharded, exact=True)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
