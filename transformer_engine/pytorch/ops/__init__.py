"""TransformerEngine's operation API, to the extent Megatron-core uses it.

``Sequential`` runs its operations in order (there is no operation fuser: see ``sequential.py``). The operations:
``LayerNorm``, ``RMSNorm``, ``BasicLinear``, ``Bias``, the activations ``GELU``, ``GEGLU``, ``ReLU``, ``ReGLU``,
``SiLU``, ``SwiGLU``, ``MakeExtraOutput``, ``AddExtraInput``, ``AllReduce``, ``ReduceScatter``, and
``L2Normalization`` (``MultiheadAttention``'s L2 QK norm). Each computes with the functions the modules call, so
an operation gives its module's bits. Megatron-core reaches these through ``use_te_activation_func``,
``use_transformer_engine_op_fuser`` (dense MLPs) and ``fused_residual_rmsnorm``.

Not here: the grouped operations (``GroupedLinear``, ``ScaledSwiGLU``, ...), the other activations, ``Linear``,
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
    L2Normalization,
    LayerNorm,
    MakeExtraOutput,
    ReduceScatter,
    ReGLU,
    ReLU,
    RMSNorm,
    SiLU,
    SwiGLU,
)
from transformer_engine.pytorch.ops.op import BasicOperation, FusibleOperation
from transformer_engine.pytorch.ops.sequential import Sequential

__all__ = ["AddExtraInput", "AllReduce", "BasicLinear", "BasicOperation", "Bias", "FusibleOperation", "GEGLU",
           "GELU", "L2Normalization", "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU", "ReLU", "ReduceScatter",
           "Sequential", "SiLU", "SwiGLU"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"transformer_engine.pytorch.ops.{name} is not implemented: of TransformerEngine's "
                         f"operations only {', '.join(__all__)} are")
