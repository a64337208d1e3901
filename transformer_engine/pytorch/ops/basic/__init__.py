"""Single operations (see ``transformer_engine.pytorch.ops``)."""

from transformer_engine.pytorch.ops.basic.activation import GEGLU, GELU, ReGLU, ReLU, SiLU, SwiGLU
from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear
from transformer_engine.pytorch.ops.basic.bias import Bias
from transformer_engine.pytorch.ops.basic.collectives import AllReduce, ReduceScatter
from transformer_engine.pytorch.ops.basic.extra_io import AddExtraInput, MakeExtraOutput
from transformer_engine.pytorch.ops.basic.grouped_linear import GroupedLinear
from transformer_engine.pytorch.ops.basic.l2normalization import L2Normalization
from transformer_engine.pytorch.ops.basic.normalization import LayerNorm, RMSNorm
from transformer_engine.pytorch.ops.basic.scaled_activation import ScaledClampedQGeGLU, ScaledSReLU, ScaledSwiGLU

__all__ = ["AddExtraInput", "AllReduce", "BasicLinear", "Bias", "GEGLU", "GELU", "GroupedLinear", "L2Normalization",
           "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU", "ReLU", "ReduceScatter", "ScaledClampedQGeGLU",
           "ScaledSReLU", "ScaledSwiGLU", "SiLU", "SwiGLU"]
