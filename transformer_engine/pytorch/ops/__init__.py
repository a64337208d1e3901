"""TransformerEngine's operation API, to the extent Megatron-core uses it.

``Sequential`` runs its operations in order (there is no operation fuser: see ``sequential.py``). The operations:
``LayerNorm``, ``RMSNorm``, ``BasicLinear``, ``Bias``, the activations ``GELU``, ``GEGLU``, ``ReLU``, ``ReGLU``,
``SiLU``, ``SwiGLU``, ``MakeExtraOutput``, ``AddExtraInput``, ``AllReduce``, ``ReduceScatter``,
``L2Normalization`` (``MultiheadAttention``'s L2 QK norm), and the grouped MLP's ``GroupedLinear``,
``ScaledSwiGLU``, ``ScaledClampedQGeGLU`` and ``ScaledSReLU``. Each computes with the functions the modules call,
so an operation gives its module's bits. Megatron-core reaches these through ``use_te_activation_func``,
``use_transformer_engine_op_fuser`` (dense MLPs, and MoE experts with ``moe_grouped_gemm``) and
``fused_residual_rmsnorm``.

Not here: the other activations, ``Linear``,
``Dropout``, ``Quantize``, ``Reshape``, ``AllGather``, ``Identity``, ``ConstantScale`` and the fuser registration
functions; asking for one raises an AttributeError that says so.
"""

from transformer_engine.pytorch.ops.basic import (
    GEGLU,
    GELU,
    AddExtraInput,
    AllReduce,
    BasicLinear,
    Bias,
    GroupedLinear,
    L2Normalization,
    LayerNorm,
    MakeExtraOutput,
    ReduceScatter,
    ReGLU,
    ReLU,
    RMSNorm,
    ScaledClampedQGeGLU,
    ScaledSReLU,
    ScaledSwiGLU,
    SiLU,
    SwiGLU,
)
from transformer_engine.pytorch.ops.op import BasicOperation, FusibleOperation
from transformer_engine.pytorch.ops.sequential import Sequential

__all__ = ["AddExtraInput", "AllReduce", "BasicLinear", "BasicOperation", "Bias", "FusibleOperation", "GEGLU",
           "GELU", "GroupedLinear", "L2Normalization", "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU", "ReLU",
           "ReduceScatter", "ScaledClampedQGeGLU", "ScaledSReLU", "ScaledSwiGLU", "Sequential", "SiLU", "SwiGLU"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"transformer_engine.pytorch.ops.{name} is not implemented: of TransformerEngine's "
                         f"operations only {', '.join(__all__)} are")
