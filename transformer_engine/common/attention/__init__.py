"""Attention: enums, the one AttnConfig, backends and their selection, launch plans, kernels."""

from transformer_engine.common.attention.enums import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    BackwardGrads,
    QKVFormat,
    QKVLayout,
)
from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.backends import (
    BACKENDS,
    AttentionBackend,
    FlashAttention,
    FusedAttention,
    UnfusedDotProductAttention,
    Selection,
    select_backend,
)
from transformer_engine.common.attention.explain import PlanExplanation, explain_plan

__all__ = [
    "AttnBiasType",
    "AttnMaskType",
    "AttnSoftmaxType",
    "BackwardGrads",
    "QKVFormat",
    "QKVLayout",
    "AttnConfig",
    "BACKENDS",
    "AttentionBackend",
    "FlashAttention",
    "FusedAttention",
    "UnfusedDotProductAttention",
    "Selection",
    "select_backend",
    "PlanExplanation",
    "explain_plan",
]
