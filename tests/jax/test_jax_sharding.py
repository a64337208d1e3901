"""MeshResource and global_shard_guard: values, nesting, restoring on exit and on error."""

from __future__ import annotations

import pytest

from transformer_engine.jax.sharding import (
    MeshResource,
    batch_axes,
    global_mesh_resource,
    global_shard_guard,
    head_axes,
)


def test_default_is_empty():
    assert global_mesh_resource() == MeshResource()
    assert batch_axes() == () and head_axes() == ()


def test_guard_sets_nests_and_restores():
    outer = MeshResource(dp_resource="data", tp_resource="model")
    inner = MeshResource(fsdp_resource="fsdp")
    with global_shard_guard(outer) as active:
        assert active is outer and global_mesh_resource() is outer
        assert batch_axes() == ("data",) and head_axes() == ("model",)
        with global_shard_guard(inner):
            assert global_mesh_resource() is inner
            assert batch_axes() == ("fsdp",)
        assert global_mesh_resource() is outer
    assert global_mesh_resource() == MeshResource()


def test_guard_restores_after_an_error():
    with pytest.raises(RuntimeError):
        with global_shard_guard(MeshResource(dp_resource="dp")):
            raise RuntimeError("boom")
    assert global_mesh_resource() == MeshResource()


def test_batch_axes_order_is_dp_then_fsdp():
    assert batch_axes(MeshResource(dp_resource="dp", fsdp_resource="fsdp")) == ("dp", "fsdp")


@pytest.mark.parametrize(
    "kwargs, words",
    [(dict(dp_resource=3), "`dp_resource` must be a mesh axis name"), (dict(dp_resource="x", tp_resource="x"),
                                                                        "must be distinct")],
)
def test_bad_resources(kwargs, words):
    with pytest.raises(ValueError, match=words):
        MeshResource(**kwargs)


def test_guard_rejects_other_types():
    with pytest.raises(ValueError, match="`resource` must be a MeshResource"):
        with global_shard_guard({"dp_resource": "dp"}):
            pass


def test_meshes_are_read_without_deprecation_warnings():
    """The context-parallel axis size is found under ``jax.set_mesh`` (also inside ``jit``) and under
    the legacy ``with mesh:`` (TransformerEngine's way), with no warning from this library on any
    supported JAX (its one read of the deprecated ``thread_resources`` is in ``jax_compat``)."""
    import warnings

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from transformer_engine.jax.context_parallel import mesh_axis_size

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (CPU: the suite's 8 host devices)")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mesh_axis_size("context") == 1
        with jax.set_mesh(mesh):
            assert mesh_axis_size("context") == 2
            jax.jit(lambda x: seen.append(mesh_axis_size("context")) or x)(np.zeros(2))
    assert seen == [2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # JAX's own warning on entering `with mesh:`
        mesh.__enter__()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mesh_axis_size("context") == 2
    finally:
        mesh.__exit__(None, None, None)
