"""TransformerEngine's module path for the attention layer: ``transformer_engine.jax.flax.transformer``.

TE-JAX code (MaxText among it) imports ``DotProductAttention`` from here; it is
:class:`transformer_engine.jax.flax.DotProductAttention`. TransformerEngine's other layers in this
module (``MultiHeadAttention``, ``TransformerLayer``, ``RelativePositionBiases``) are not part of
this project.
"""

from transformer_engine.jax.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVLayout
from transformer_engine.jax.flax.module import DotProductAttention

__all__ = ["DotProductAttention", "AttnBiasType", "AttnMaskType", "AttnSoftmaxType", "QKVLayout"]
