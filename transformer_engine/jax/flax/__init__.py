"""Flax (linen) modules of transformer_engine.jax."""

try:
    import flax  # noqa: F401
except ImportError as err:  # pragma: no cover
    raise ImportError(
        "transformer_engine.jax.flax needs Flax, which is not installed: pip install flax"
    ) from err

from transformer_engine.jax.flax import module
from transformer_engine.jax.flax.module import DotProductAttention, TransformerEngineBase

__all__ = ["DotProductAttention", "TransformerEngineBase", "module"]
