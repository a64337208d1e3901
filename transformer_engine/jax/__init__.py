"""JAX frontend: ``fused_attn`` (transformer_engine.jax.attention), sharding resources
(transformer_engine.jax.sharding, ``autocast``) and the Flax module (transformer_engine.jax.flax),
with TransformerEngine-JAX's names and import paths."""

try:
    import jax  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by tests/common/test_imports.py
    raise ImportError(
        "transformer_engine.jax needs JAX, which is not installed: pip install jax flax (or install "
        "this package with its extra: pip install 'deterministic-attention[jax]')"
    ) from err

from transformer_engine.jax import attention, cpp_extensions, sharding
from transformer_engine.jax.quantize import autocast, fp8_autocast
from transformer_engine.jax.sharding import MeshResource, global_mesh_resource, global_shard_guard

__all__ = [
    "attention",
    "autocast",
    "cpp_extensions",
    "fp8_autocast",
    "sharding",
    "MeshResource",
    "global_shard_guard",
    "global_mesh_resource",
]
