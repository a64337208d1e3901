"""PyTorch frontend: DotProductAttention and the fused attention ops."""

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised by tests/common/test_imports.py
    raise ImportError(
        "transformer_engine.pytorch needs PyTorch, which is not installed: "
        "pip install torch (or install this package with its extra: pip install 'deterministic-attention[pytorch]')"
    ) from err

from transformer_engine.pytorch.attention import DotProductAttention  # noqa: E402
