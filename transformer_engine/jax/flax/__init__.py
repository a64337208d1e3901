"""Flax (linen) modules of transformer_engine.jax."""

try:
    import flax  # noqa: F401
except ImportError as err:  # pragma: no cover
    raise ImportError(
        "transformer_engine.jax.flax needs Flax, which is not installed: pip install flax"
    ) from err

from transformer_engine.jax.flax import module, transformer
from transformer_engine.jax.flax.module import (DenseGeneral, DotProductAttention, LayerNorm, LayerNormDenseGeneral,
                                                LayerNormMLP, TransformerEngineBase)
from transformer_engine.jax.flax.transformer import (MultiHeadAttention, RelativePositionBiases, TransformerLayer,
                                                     TransformerLayerType, extend_logical_axis_rules)

__all__ = ["DenseGeneral", "DotProductAttention", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP",
           "MultiHeadAttention", "RelativePositionBiases", "TransformerEngineBase", "TransformerLayer",
           "TransformerLayerType", "extend_logical_axis_rules", "module", "transformer"]
