"""RMSNorm at TransformerEngine's import path (``transformer_engine.pytorch.module.rmsnorm``); the class is defined
with LayerNorm in ``layernorm.py``, which it shares its code with."""

from transformer_engine.pytorch.module.layernorm import RMSNorm

__all__ = ["RMSNorm"]
