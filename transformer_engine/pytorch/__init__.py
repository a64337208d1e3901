"""PyTorch frontend: DotProductAttention, the fused attention ops, and TransformerEngine-style
LayerNorm, RMSNorm, Linear, LayerNormLinear and LayerNormMLP modules and the MultiheadAttention and
TransformerLayer blocks built from them (tensor parallel through torch.distributed), with FP8 training under TransformerEngine's recipes inside ``autocast`` /
``fp8_autocast`` (see docs/fp8.rst) and activation recompute by ``checkpoint``."""

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
    MultiheadAttention,
    RotaryPositionEmbedding,
)
from transformer_engine.pytorch import distributed, fp8, router  # noqa: E402,F401
from transformer_engine.pytorch.batch_invariance import batch_invariant, is_batch_invariant  # noqa: E402,F401
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint  # noqa: E402,F401
from transformer_engine.pytorch.fp8 import (  # noqa: E402,F401
    FP8GlobalStateManager,
    autocast,
    check_fp8_block_scaling_support,
    check_fp8_support,
    check_mxfp8_support,
    check_nvfp4_support,
    fp8_autocast,
    fp8_model_init,
    quantized_model_init,
)
from transformer_engine.pytorch.module import (  # noqa: E402,F401
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
)
from transformer_engine.pytorch.transformer import TransformerLayer  # noqa: E402,F401
from transformer_engine.pytorch.permutation import (  # noqa: E402,F401
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy  # noqa: E402,F401
from transformer_engine.pytorch import ops  # noqa: E402,F401
from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context, mark_not_offload  # noqa: E402,F401
