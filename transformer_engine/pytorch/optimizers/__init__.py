"""TransformerEngine's optimizers and multi-tensor ops, on torch's own kernels.

``FusedAdam`` and ``FusedSGD`` take TransformerEngine's constructor arguments and run torch's
fused Adam/AdamW and SGD kernels (deterministic: elementwise updates); the multi-tensor ops
(``multi_tensor_applier`` with ``multi_tensor_scale``, ``multi_tensor_scale_tensor``,
``multi_tensor_l2norm``, ``multi_tensor_unscale_l2norm``) are torch operations in list order.
Megatron-core imports these names first and uses them when they are present.
"""

from transformer_engine.pytorch.optimizers.fused_adam import FusedAdam  # noqa: F401
from transformer_engine.pytorch.optimizers.fused_sgd import FusedSGD  # noqa: F401
from transformer_engine.pytorch.optimizers.multi_tensor_apply import (  # noqa: F401
    MultiTensorApply,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
    multi_tensor_scale_tensor,
    multi_tensor_unscale_l2norm,
)

__all__ = [
    "FusedAdam",
    "FusedSGD",
    "MultiTensorApply",
    "multi_tensor_applier",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "multi_tensor_scale_tensor",
    "multi_tensor_unscale_l2norm",
]
