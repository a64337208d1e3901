"""``autocast`` and ``fp8_autocast`` with TransformerEngine-JAX's signatures.

This project has no FP8/FP4 quantization: the context managers exist so that TE-JAX code that
wraps its model in them runs unchanged. They make ``mesh_resource`` the active
:class:`~transformer_engine.jax.sharding.MeshResource` for the block (what they do in
TransformerEngine besides quantization) and refuse ``enabled=True`` with ``NotImplementedError``.
A recipe passed with ``enabled=False`` has no effect, as in TransformerEngine.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional

from transformer_engine.jax.sharding import MeshResource, global_shard_guard

__all__ = ["autocast", "fp8_autocast"]


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Optional[Any] = None,
             mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Run the block with ``mesh_resource`` active (``None``: an empty MeshResource).
    ``enabled=True`` (FP8/FP4 quantization) raises ``NotImplementedError``."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    if enabled:
        raise NotImplementedError(
            f"`enabled` must be False in transformer_engine.jax, got True (recipe={type(recipe).__name__}): this "
            "project has no FP8/FP4 quantization; its attention runs in float16/bfloat16/float32"
        )
    with global_shard_guard(mesh_resource):
        yield


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe: Optional[Any] = None,
                 mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Deprecated in TransformerEngine for :func:`autocast` (``fp8_recipe`` is its ``recipe``)."""
    warnings.warn("fp8_autocast is deprecated, use autocast(enabled=..., recipe=..., mesh_resource=...)",
                  DeprecationWarning, stacklevel=3)
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield
