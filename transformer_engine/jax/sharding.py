"""Which mesh axes carry which kind of parallelism: ``MeshResource`` and ``global_shard_guard``.

A :class:`MeshResource` names the mesh axes of each kind of parallelism, with TransformerEngine's
fields in its order: data (``dp_resource``), tensor (``tp_resource``), tensor-sequence
(``tpsp_resource``), fully sharded data (``fsdp_resource``), pipeline (``pp_resource``), context
(``cp_resource``) and expert (``ep_resource``) parallelism; ``None`` means "not used". Code reads
the active one with :func:`global_mesh_resource` and sets it for a block with
:func:`global_shard_guard` (or ``transformer_engine.jax.autocast(mesh_resource=...)``)::

    mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"))
    with mesh, global_shard_guard(MeshResource(dp_resource="data", tp_resource="model")):
        out = fused_attn(...)

What the fused attention does with it: batch is split over the dp and fsdp axes and heads over
the tp (or tpsp) axis, each device computing its own shard with no gather of q, k or v. The
sequence is split over the ``cp_resource`` axis (context parallelism,
:mod:`transformer_engine.jax.context_parallel`); a sequence axis sharded over any other axis is
rejected with ``NotImplementedError``.
Attention has no pipeline or expert dimension: ``pp_resource`` and ``ep_resource`` are carried for
TransformerEngine code that sets them and do not change attention.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

__all__ = [
    "MeshResource",
    "global_shard_guard",
    "global_mesh_resource",
    "batch_axes",
    "head_axes",
    "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES", "SEQLEN_CP_AXES", "HEAD_AXES", "HIDDEN_AXES", "HIDDEN_TP_AXES",
    "JOINED_AXES", "W_NO_SHARD_AXES", "W_FSDP_AXES", "W_TP_AXES", "W_JOINED_AXES",
    "get_sharding_map_logic_axis_to_mesh_axis",
    "with_sharding_constraint_by_logical_axes",
]


_RESOURCE_FIELDS = ("dp_resource", "tp_resource", "tpsp_resource", "fsdp_resource", "pp_resource", "cp_resource",
                   "ep_resource")


@dataclass(frozen=True)
class MeshResource:
    """Mesh axis names for each kind of parallelism (``None``: that kind is not used), in
    TransformerEngine's order, so that ``MeshResource("dp", "tp")`` means what it means there."""

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None
    tpsp_resource: Optional[str] = None
    fsdp_resource: Optional[str] = None
    pp_resource: Optional[str] = None
    cp_resource: Optional[str] = None
    ep_resource: Optional[str] = None

    def __post_init__(self) -> None:
        for name in _RESOURCE_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"`{name}` must be a mesh axis name (str) or None, got {value!r}")
        used = [getattr(self, name) for name in _RESOURCE_FIELDS if getattr(self, name)]
        if len(used) != len(set(used)):
            raise ValueError(f"MeshResource axes must be distinct, got {self}")


_GLOBAL_MESH_RESOURCE = MeshResource()


def global_mesh_resource() -> MeshResource:
    """The :class:`MeshResource` in effect (an empty one outside any guard)."""
    return _GLOBAL_MESH_RESOURCE


@contextlib.contextmanager
def global_shard_guard(resource: Optional[MeshResource] = None) -> Iterator[MeshResource]:
    """Make ``resource`` the active :class:`MeshResource` inside the block; restore the previous
    one on exit (also when the block raises). Guards nest."""
    if resource is None:
        resource = MeshResource()
    if not isinstance(resource, MeshResource):
        raise ValueError(f"`resource` must be a MeshResource, got {type(resource).__name__}")
    global _GLOBAL_MESH_RESOURCE
    previous = _GLOBAL_MESH_RESOURCE
    _GLOBAL_MESH_RESOURCE = resource
    try:
        yield resource
    finally:
        _GLOBAL_MESH_RESOURCE = previous


def batch_axes(resource: Optional[MeshResource] = None) -> Tuple[str, ...]:
    """Mesh axes the batch dimension is split over (dp, then fsdp), in that order."""
    resource = resource or global_mesh_resource()
    return tuple(a for a in (resource.dp_resource, resource.fsdp_resource) if a)


def head_axes(resource: Optional[MeshResource] = None) -> Tuple[str, ...]:
    """Mesh axes the heads dimension is split over: tpsp when set, else tp."""
    resource = resource or global_mesh_resource()
    axis = resource.tpsp_resource or resource.tp_resource
    return (axis,) if axis else ()


# ------------------------------------------------------------------------------------------------
# TransformerEngine's logical axes (the Flax layers name their activations and weights with them)
# ------------------------------------------------------------------------------------------------

BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


def get_sharding_map_logic_axis_to_mesh_axis(resource: Optional[MeshResource] = None) -> dict:
    """TransformerEngine's logical axes -> mesh axes of ``resource`` (default: the active one).

    Batch goes over fsdp when set, else dp; heads, the hidden dimension of tensor-parallel
    activations and the tensor-parallel weight dimension go over tpsp when set, else tp; fsdp
    weight dimensions over fsdp; the sequence over tpsp (``SEQLEN_TP_AXES``, sequence parallelism)
    or cp (``SEQLEN_CP_AXES``); everything else is replicated (None). A set axis counts as used
    whatever its mesh size (TransformerEngine also checks the size is above 1; with size 1 the
    sharding is the same)."""
    r = resource or global_mesh_resource()
    tp = r.tpsp_resource or r.tp_resource
    return {
        BATCH_AXES: r.fsdp_resource or r.dp_resource,
        SEQLEN_AXES: None,
        SEQLEN_TP_AXES: r.tpsp_resource,
        SEQLEN_CP_AXES: r.cp_resource,
        HEAD_AXES: tp,
        HIDDEN_AXES: None,
        HIDDEN_TP_AXES: tp,
        JOINED_AXES: None,
        W_NO_SHARD_AXES: None,
        W_FSDP_AXES: r.fsdp_resource,
        W_TP_AXES: tp,
        W_JOINED_AXES: None,
    }


def with_sharding_constraint_by_logical_axes(x, logical_axis_names):
    """``x`` constrained to the sharding its logical axes get under the enclosing
    ``flax.linen.logical_axis_rules`` (``flax.linen.with_logical_constraint``); ``x`` itself when
    ``logical_axis_names`` is empty or None, when no rules are set, or outside a mesh.
    (TransformerEngine's deprecated fallback to its own table without Flax rules is not built: add
    its axes to the rules with ``transformer_engine.jax.flax.extend_logical_axis_rules``.)"""
    if not logical_axis_names:
        return x
    import flax.linen as nn  # the sharding module itself does not need Flax

    if len(logical_axis_names) != x.ndim:
        raise ValueError(f"`logical_axis_names` must name each of the {x.ndim} axes of shape {x.shape}, "
                         f"got {tuple(logical_axis_names)}")
    return nn.with_logical_constraint(x, tuple(logical_axis_names))
