"""Preference among backends that can all run a call: data, kept apart from feasibility."""

from __future__ import annotations

from typing import List, Type

from transformer_engine.common.attention.config import AttnConfig

_PRIORITY = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
_FUSED_FIRST = ("FusedAttention", "FlashAttention", "UnfusedDotProductAttention")

# Where flash-attn-4 was measured faster than our Triton kernels, deterministic or not, as
# (GPU major, head_dim_qk, head_dim_v): H200, bf16, no mask and causal, flash-attn-4 4.0.0b36
# (benchmarks/results/attention.md: deterministic fwd+bwd 502-615 TFLOP/s at d=128 against 383-436 for
# our kernels, 393-462 at d=64 against 282-352, 316 at d=256 causal against 193). Elsewhere (other head dims, Blackwell) it is not measured yet,
# so there our kernels come first and flash-attn-4 second.
FLASH_MEASURED_FASTER = frozenset({(9, 64, 64), (9, 128, 128), (9, 256, 256)})
# GPU majors flash-attn-4 runs on. On others (and on CPU) the order decides nothing, and trying
# FlashAttention first puts why it cannot run into the NVTE_DEBUG log and the rejected reasons.
_FLASH_MAJORS = frozenset({9, 10})


def _fused_before_flash(config: AttnConfig) -> bool:
    """Where flash-attn-4 could run but is not measured faster than our kernels."""
    if config.compute_capability is None or config.compute_capability[0] not in _FLASH_MAJORS:
        return False
    key = (config.compute_capability[0], config.head_dim_qk, config.head_dim_v)
    return key not in FLASH_MEASURED_FASTER


def order_backends(backends: List[Type], config: AttnConfig) -> List[Type]:
    """Candidates in the order they should be tried for ``config``."""
    priority = _FUSED_FIRST if _fused_before_flash(config) else _PRIORITY
    rank = {name: i for i, name in enumerate(priority)}
    return sorted(backends, key=lambda b: rank.get(b.NAME, len(rank)))
