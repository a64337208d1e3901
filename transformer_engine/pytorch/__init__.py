"""PyTorch frontend: DotProductAttention, the fused attention ops, and TransformerEngine-style
LayerNorm, RMSNorm, Linear and LayerNormLinear modules (plain torch ops, tensor parallel through
torch.distributed). FP8 is not implemented: ``fp8_autocast``/``autocast`` and the model-init
contexts are no-ops when disabled and raise NotImplementedError when enabled."""

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by tests/common/test_imports.py
    raise ImportError(
        "transformer_engine.pytorch needs PyTorch, which is not installed: "
        "pip install torch (or install this package with its extra: pip install 'deterministic-attention[pytorch]')"
    ) from err

from transformer_engine.pytorch.attention import (  # noqa: E402,F401
    DotProductAttention,
    InferenceParams,
    RotaryPositionEmbedding,
)
from transformer_engine.pytorch import distributed, fp8, router  # noqa: E402,F401
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker  # noqa: E402,F401
from transformer_engine.pytorch.fp8 import (  # noqa: E402,F401
    autocast,
    fp8_autocast,
    fp8_model_init,
    quantized_model_init,
)
from transformer_engine.pytorch.module import (  # noqa: E402,F401
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    Linear,
    RMSNorm,
)
