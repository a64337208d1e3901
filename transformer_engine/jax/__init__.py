"""JAX frontend: ``fused_attn`` (transformer_engine.jax.attention), sharding resources
(transformer_engine.jax.sharding), FP8 (``autocast``, transformer_engine.jax.quantize and
transformer_engine.jax.dense) and the Flax modules (transformer_engine.jax.flax, imported on first
use), with TransformerEngine-JAX's names and import paths."""

try:
    import jax  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by tests/common/test_imports.py
    raise ImportError(
        "transformer_engine.jax needs JAX, which is not installed: pip install jax flax (or install "
        "this package with its extra: pip install 'deterministic-attention[jax]')"
    ) from err

import importlib

from transformer_engine.jax import attention, cpp_extensions, dense, quantize, sharding
from transformer_engine.jax.batch_invariance import batch_invariant, is_batch_invariant
from transformer_engine.jax.quantize import autocast, fp8_autocast
from transformer_engine.jax.sharding import MeshResource, global_mesh_resource, global_shard_guard

__all__ = [
    "attention",
    "autocast",
    "batch_invariant",
    "cpp_extensions",
    "dense",
    "flax",
    "fp8_autocast",
    "is_batch_invariant",
    "quantize",
    "sharding",
    "MeshResource",
    "global_shard_guard",
    "global_mesh_resource",
]


def __getattr__(name):
    # ``transformer_engine.jax.flax`` as an attribute (MaxText reads
    # ``transformer_engine.jax.flax.module.TransformerEngineBase`` after ``import transformer_engine.jax``),
    # imported on first use so that the frontend itself does not need Flax.
    if name == "flax":
        return importlib.import_module("transformer_engine.jax.flax")
    raise AttributeError(f"module 'transformer_engine.jax' has no attribute {name!r}")
