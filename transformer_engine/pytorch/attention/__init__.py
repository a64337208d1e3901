"""PyTorch attention: custom ops, autograd function, backends and the DotProductAttention module."""

from transformer_engine.pytorch.attention.dot_product_attention import DotProductAttention
from transformer_engine.pytorch.attention.inference import InferenceParams
from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from transformer_engine.pytorch.attention.unfused import UnfusedDotProductAttention, unfused_attention

__all__ = [
    "DotProductAttention",
    "InferenceParams",
    "MultiheadAttention",
    "RotaryPositionEmbedding",
    "UnfusedDotProductAttention",
    "apply_rotary_pos_emb",
    "unfused_attention",
]
