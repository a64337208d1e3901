"""The JAX API differences between the supported versions (0.10 to 0.12), in one place.

- The mesh of ``with mesh:``: that form is deprecated (JAX says ``jax.set_mesh``) but still works,
  and TransformerEngine-JAX's users write it. It has no public accessor: it lives in
  ``jax.interpreters.pxla.thread_resources``, deprecated since JAX 0.8.2. It is read here only,
  with the deprecation warning silenced, and ``None`` once JAX removes it; a mesh set with
  ``jax.set_mesh`` is read through the public ``jax.sharding.get_abstract_mesh``.
- The manual-axes type of an abstract value inside ``shard_map``: ``manual_axis_type`` (with
  ``.varying``) on newer JAX, ``vma`` (a set of axis names) on older.
"""

from __future__ import annotations

import warnings
from typing import List

import jax

__all__ = ["legacy_context_mesh", "current_meshes", "varying_axes", "manual_axes_field"]


def legacy_context_mesh():
    """The mesh of an enclosing ``with mesh:`` block, or None (none, or a JAX without it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from jax.interpreters import pxla

            return pxla.thread_resources.env.physical_mesh
        except (ImportError, AttributeError):
            return None


def current_meshes() -> List[object]:
    """The non-empty meshes in effect: ``with mesh:`` first (TransformerEngine's way), then
    ``jax.set_mesh``'s, through ``get_abstract_mesh`` (``get_mesh`` refuses to run under ``jit``)."""
    meshes = [legacy_context_mesh(), jax.sharding.get_abstract_mesh()]
    return [m for m in meshes if m is not None and not m.empty]


def varying_axes(aval) -> frozenset:
    """The manual mesh axes ``aval`` varies over (empty outside shard_map)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def manual_axes_field(aval) -> str:
    """The ``ShapedArray`` keyword that carries ``aval``'s manual-axes type."""
    return "manual_axis_type" if hasattr(aval, "manual_axis_type") else "vma"
