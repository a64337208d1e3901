"""The shape of the small decoder-only transformer that both frameworks' determinism checks train
(:mod:`transformer_engine.pytorch.models`, :mod:`transformer_engine.jax.flax.models`): its sizes
and their checks, once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["TinyShape"]


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_gqa_groups: int = 2
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden_size
    attn_mask_type: str = "causal"
    window_size: Tuple[int, int] = (-1, 0)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(
                f"`num_gqa_groups` ({self.num_gqa_groups}) must divide num_attention_heads ({self.num_attention_heads})"
            )
