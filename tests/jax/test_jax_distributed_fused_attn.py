"""Sharded fused attention on 8 CPU host devices (conftest sets
``--xla_force_host_platform_device_count=8``): batch over dp/fsdp and heads over tp as named by
``MeshResource``, the same results as unsharded (bitwise on the fused path, whose arithmetic does
not depend on the shard shape), no all-gather of q/k/v in the compiled program, and a clear error
for a sequence axis sharded without naming it the context-parallel axis (context parallelism:
test_jax_context_parallel.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharded_helpers import PARTITIONER_ERRORS, assert_results, problem, run_sharded, spec
from transformer_engine.common.attention.enums import QKVLayout
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

if len(jax.devices()) < 8:
    pytest.skip(
        f"needs 8 devices, found {len(jax.devices())}: run with XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        "(tests/jax/conftest.py sets it unless JAX was initialized earlier)",
        allow_module_level=True,
    )

MESHES = {
    "dp8": ((8,), ("dp",), MeshResource(dp_resource="dp")),
    "dp2-tp4": ((2, 4), ("dp", "tp"), MeshResource(dp_resource="dp", tp_resource="tp")),
    "fsdp4-tp2": ((4, 2), ("fsdp", "tp"), MeshResource(fsdp_resource="fsdp", tp_resource="tp")),
    "dp2-fsdp2-tp2": ((2, 2, 2), ("dp", "fsdp", "tp"), MeshResource(dp_resource="dp", tp_resource="tp", fsdp_resource="fsdp")),
}


def _mesh(name):
    shape, axes, resource = MESHES[name]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), axes), resource


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_equals_unsharded_bitwise_without_gathers(mesh_name, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    mesh, resource = _mesh(mesh_name)
    fn, args = problem()
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo, "q/k/v were gathered"
    assert "custom-call" not in hlo or "CustomSPMDPartitioning" not in hlo
    assert_results(sharded, unsharded, exact=True)
    # Each device ran on its own shard: the gradient keeps the input sharding.
    padded = lambda s: tuple(s) + (None,) * (4 - len(s))  # noqa: E731
    assert padded(sharded[1].sharding.spec) == padded(spec(resource))


@pytest.mark.parametrize("h_kv", [1, 2], ids=["mqa", "gqa"])
def test_tensor_parallel_gqa_and_mqa(h_kv):
    """tp=4 over 8 query heads: MQA replicates its one kv head on every device and all-reduces
    dK/dV (so equal within rounding); GQA with 2 kv heads (not a multiple of tp) is rejected."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = problem(h_kv=h_kv)
    if h_kv == 2:
        with pytest.raises(PARTITIONER_ERRORS, match="not a multiple of 4"):
            run_sharded(fn, args, mesh, resource)
        return
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo
    assert_results(sharded[:2], unsharded[:2], exact=True)
    assert_results(sharded[2:4], unsharded[2:4], exact=False, names=("dk", "dv"))


@pytest.mark.parametrize(
    "bias_shape, exact",
    [((8, 8, 32, 32), True), ((1, 8, 32, 32), False), ((8, 1, 32, 32), False)],
    ids=["bhss", "1hss", "b1ss"],
)
def test_bias_and_its_gradient_under_sharding(bias_shape, exact):
    """A bias broadcast over a split axis gets its gradient summed across devices (all-reduce):
    equal within rounding (the sum's order changes); an unbroadcast bias stays bitwise."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = problem(bias_shape=bias_shape)
    bias_spec = P("dp" if bias_shape[0] > 1 else None, "tp" if bias_shape[1] > 1 else None)
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = run_sharded(fn, args, mesh, resource, bias_spec=bias_spec)
    assert "all-gather" not in hlo
    assert_results(sharded[:4], unsharded[:4], exact=True)
    assert_results(sharded[4:], unsharded[4:], exact=exact, names=("dbias",))


def test_thd_packed_rows_shard_over_batch():
    mesh, resource = _mesh("fsdp4-tp2")
    fn, args = problem(layout=QKVLayout.THD_THD_THD, m=3)
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo
    assert_results(sharded, unsharded, exact=True)


def test_unfused_backend_under_sharding_matches():
    """The unfused backend is plain jnp: XLA partitions it; equal within rounding."""
    mesh, resource = _mesh("dp2-tp4")
    fn, args = problem(backend="unfused")
    unsharded = jax.jit(fn)(*args)
    sharded, _ = run_sharded(fn, args, mesh, resource)
    assert_results(sharded, unsharded, exact=False)


def test_sharded_sequence_axis_without_context_parallel_axis_is_rejected():
    mesh, resource = _mesh("dp2-tp4")
    fn, args = problem()
    q, k, v, bias, lens, dout = args
    seq_sharded = NamedSharding(mesh, P("dp", "tp", None, None))
    with jax.set_mesh(mesh), global_shard_guard(MeshResource(dp_resource="dp")):
        placed = [jax.device_put(x, seq_sharded) for x in (q, k, v)]
        with pytest.raises(PARTITIONER_ERRORS, match="(?s)sequence axis of `q` is sharded.*context parallelism"):
            jax.jit(fn).lower(*placed, None, lens, dout).compile()


def test_gspmd_partitioner_too(monkeypatch):
    """The same rules through GSPMD (``jax_use_shardy_partitioner=False``): infer_sharding_from_operands."""
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        mesh, resource = _mesh("dp2-tp4")
        fn, args = problem()
        unsharded = jax.jit(fn)(*args)
        sharded, hlo = run_sharded(fn, args, mesh, resource)
        assert "all-gather" not in hlo
        assert_results(sharded, unsharded, exact=True)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
