"""Preference among backends that can all run a call: data, kept apart from feasibility."""

from __future__ import annotations

from typing import List, Type

from transformer_engine.common.attention.config import AttnConfig

# Measured on the H200 (benchmarks/results): flash-attn-4 is fastest where it runs; our Triton
# kernels next; framework math last.
_PRIORITY = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")


def order_backends(backends: List[Type], config: AttnConfig) -> List[Type]:
    """Candidates in the order they should be tried for ``config``."""
    rank = {name: i for i, name in enumerate(_PRIORITY)}
    return sorted(backends, key=lambda b: rank.get(b.NAME, len(rank)))
