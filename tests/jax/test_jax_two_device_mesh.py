"""The 2-GPU run file: sharded attention on meshes of 2 devices.

On GPU: ``python -m pytest tests/jax/test_jax_two_device_mesh.py`` on a machine with 2 GPUs (2
H200s). On CPU it runs in CI too, on the first 2 of the 8 host devices tests/jax/conftest.py
forces. It is skipped only with fewer than 2 devices.

Meshes of 2 devices, one kind of parallelism each: dp=2 and fsdp=2 (batch split) and tp=2 (heads
split). With ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, ``fused_attn``'s output and dQ/dK/dV (and a
``[b, h, s, s]`` bias's gradient) equal the unsharded single-device results bit for bit, with no
all-gather in the compiled program; the Flax ``DotProductAttention`` (params replicated, inputs
split over dp or tp) likewise; and a sequence axis sharded without a context-parallel axis is rejected with a clear error.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharded_helpers import PARTITIONER_ERRORS, assert_results, problem, run_sharded, spec
from transformer_engine.jax.attention import SequenceDescriptor
from transformer_engine.common.log import selected_backends as recording_backend_selections
from transformer_engine.jax.sharding import MeshResource, global_shard_guard

if len(jax.devices()) < 2:
    pytest.skip(f"needs 2 devices, found {len(jax.devices())}", allow_module_level=True)

MESHES = {
    "dp2": ("dp", MeshResource(dp_resource="dp")),
    "tp2": ("tp", MeshResource(tp_resource="tp")),
    "fsdp2": ("fsdp", MeshResource(fsdp_resource="fsdp")),
}
B, S, H, G, D = 8, 32, 8, 4, 16  # problem()'s defaults: tp=2 divides both head counts


def _mesh(name):
    axis, resource = MESHES[name]
    return Mesh(np.array(jax.devices()[:2]), (axis,)), resource


def _padded(s):
    return tuple(s) + (None,) * (4 - len(s))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_fused_attn_sharded_equals_unsharded_bitwise(mesh_name, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    mesh, resource = _mesh(mesh_name)
    fn, args = problem(b=B, s=S, h_q=H, h_kv=G, d=D)
    unsharded = jax.jit(fn)(*args)
    sharded, hlo = run_sharded(fn, args, mesh, resource)
    assert "all-gather" not in hlo, "q/k/v were gathered"
    assert_results(sharded, unsharded, exact=True)
    # Each device ran on its own half: output and gradients keep the input sharding.
    for x in sharded[:4]:
        assert _padded(x.sharding.spec) == _padded(spec(resource)), x.sharding


@pytest.mark.parametrize("backend", ["fused", "selected"])
def test_fused_attn_bhss_bias_gradient_bitwise_under_tp(backend, monkeypatch):
    """A [b, h, s, s] bias split over heads: its gradient is per shard (no all-reduce), bitwise.

    ``fused`` forces the fused primitives (their partitioning rule; on CPU their jnp lowering; on a
    GPU the new bias launch, which fused_attn does not select until it is verified there).
    ``selected`` goes through ``fused_attn``'s selection, which picks the unfused backend for a
    bias on CPU and on a GPU alike: XLA partitions its jnp math over the heads."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    mesh, resource = _mesh("tp2")
    fn, args = problem(b=B, s=S, h_q=H, h_kv=G, d=D, bias_shape=(B, H, S, S), backend=backend)
    with recording_backend_selections() as selected:
        unsharded = jax.jit(fn)(*args)
        sharded, hlo = run_sharded(fn, args, mesh, resource, bias_spec=P(None, "tp"))
    if backend == "selected":
        assert selected and set(selected) == {"UnfusedDotProductAttention"}, selected
    assert "all-gather" not in hlo
    assert sharded[4] is not None and sharded[4].shape == (B, H, S, S)
    assert_results(sharded, unsharded, exact=True)
    assert _padded(sharded[4].sharding.spec) == (None, "tp", None, None)


def _flax_problem():
    flax_module = pytest.importorskip("transformer_engine.jax.flax", reason="Flax is not installed")
    module = flax_module.DotProductAttention(head_dim=D, num_attention_heads=H, num_gqa_groups=G,
                                             attn_mask_type="padding_causal")
    _, (q, k, v, _, lens, dout) = problem(b=B, s=S, h_q=H, h_kv=G, d=D)
    params = module.init(jax.random.PRNGKey(3), q, k, v, SequenceDescriptor.from_seqlens(lens))

    def fn(params, q, k, v, lens, dout):
        def attend(q, k, v):
            return module.apply(params, q, k, v, SequenceDescriptor.from_seqlens(lens))

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(dout))

    return fn, (params, q, k, v, lens, dout)


@pytest.mark.parametrize("mesh_name", ["dp2", "tp2"])
def test_flax_dot_product_attention_sharded_equals_unsharded_bitwise(mesh_name, monkeypatch):
    """Params replicated, q/k/v/dout split over batch (dp) or heads (tp): output and input
    gradients equal the unsharded module's bit for bit. On GPU the module runs the fused kernels
    (through the same partitioning rule as ``fused_attn``); on CPU it falls back to the unfused jnp
    path, which XLA partitions."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    mesh, resource = _mesh(mesh_name)
    fn, (params, q, k, v, lens, dout) = _flax_problem()
    unsharded = jax.jit(fn)(params, q, k, v, lens, dout)
    with jax.set_mesh(mesh), global_shard_guard(resource):
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
        placed = (
            jax.tree.map(lambda x: put(x, P()), params),
            *(put(x, spec(resource)) for x in (q, k, v)),
            put(lens, spec(resource, 1)),
            put(dout, spec(resource)),
        )
        jitted = jax.jit(fn)
        with recording_backend_selections() as selected:
            hlo = jitted.lower(*placed).compile().as_text()
        sharded = jitted(*placed)
    gpu = jax.devices()[0].platform == "gpu"
    assert selected and set(selected) == {"FusedAttention" if gpu else "UnfusedDotProductAttention"}, selected
    assert "all-gather" not in hlo, "q/k/v were gathered"
    assert_results(sharded, unsharded, exact=True, names=("out", "dq", "dk", "dv"))
    for x in sharded:
        assert _padded(x.sharding.spec) == _padded(spec(resource)), x.sharding


def test_sharded_sequence_axis_without_context_parallel_axis_is_rejected():
    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    fn, (q, k, v, _, lens, dout) = problem(b=B, s=S, h_q=H, h_kv=G, d=D)
    seq_sharded = NamedSharding(mesh, P(None, "cp", None, None))
    with jax.set_mesh(mesh), global_shard_guard(MeshResource()):
        placed = [jax.device_put(x, seq_sharded) for x in (q, k, v)]
        with pytest.raises(PARTITIONER_ERRORS, match="(?s)sequence axis of `q` is sharded.*context parallelism"):
            jax.jit(fn).lower(*placed, None, lens, dout).compile()
