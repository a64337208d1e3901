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
