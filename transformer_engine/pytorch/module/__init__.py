"""Linear and normalization modules with TransformerEngine's signatures (plain torch ops)."""

from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.fp8_padding import Fp8Padding
from transformer_engine.pytorch.module.fp8_unpadding import Fp8Unpadding
from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
from transformer_engine.pytorch.module.layernorm import LayerNorm, RMSNorm
from transformer_engine.pytorch.module.layernorm_linear import LayerNormLinear
from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
from transformer_engine.pytorch.module.linear import Linear

__all__ = ["TransformerEngineBaseModule", "Fp8Padding", "Fp8Unpadding", "GroupedLinear", "LayerNorm", "RMSNorm",
           "LayerNormLinear", "LayerNormMLP", "Linear"]
