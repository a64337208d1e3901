"""The PyTorch backends: the registry's classes (``transformer_engine.common.attention.backends``) with
their runner hooks and what only PyTorch knows, and backend selection over them.

Each class here subclasses the framework-free one of the same ``NAME``, so its identity, capabilities
and reasons are declared once, there. It adds ``run(q, k, v, call)``, which runs one
:class:`AttnCall` (DotProductAttention's arguments, converted and checked once) on that backend.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple, Type

import torch

from transformer_engine.common.attention import backends as common
from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.pytorch.attention import flash_backend
from transformer_engine.pytorch.attention.fused_attn import fused_attention, new_rng_state, sink_logits
from transformer_engine.pytorch.attention.unfused import default_alibi_slopes, unfused_math

__all__ = ["AttnCall", "FusedAttentionBackend", "FlashAttentionBackend", "UnfusedAttentionBackend", "BACKENDS",
           "backend_named", "select"]


@dataclass(frozen=True)
class AttnCall:
    """One attention call with its arguments converted and checked once (by DotProductAttention):
    enums, not strings; the normalized window and the resolved diagonal; where the sequences are."""

    fmt: QKVFormat
    mask: AttnMaskType  # the effective mask (padding forms under thd; unpadded without padding information)
    window: Tuple[int, int]  # normalize_window's
    bottom_right: bool  # resolve_bottom_right_diagonal's
    softmax_scale: float
    deterministic: bool
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    attention_mask: Optional[torch.Tensor] = None  # the 'arbitrary' mask
    bias_type: AttnBiasType = AttnBiasType.NO_BIAS
    bias: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    dropout: float = 0.0
    rng_context: Optional[Callable[[], ContextManager]] = None
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    softmax_offset: Optional[torch.Tensor] = None  # fp32 [h_q] on q's device: 'learnable', 'off-by-one' (zeros)
    return_max_logit: bool = False

    @property
    def sequences(self) -> tuple:
        return (self.cu_seqlens_q, self.cu_seqlens_kv, self.cu_seqlens_q_padded, self.cu_seqlens_kv_padded,
                self.max_seqlen_q, self.max_seqlen_kv)


class FusedAttentionBackend(common.FusedAttention):
    """The project's Triton kernels (:func:`~transformer_engine.pytorch.attention.fused_attn.fused_attention`)."""

    @staticmethod
    def run(q, k, v, call: AttnCall):
        bias = alibi = rng_state = None
        if call.bias_type == AttnBiasType.POST_SCALE_BIAS:
            bias = call.bias
        elif call.bias_type == AttnBiasType.ALIBI:
            slopes = call.alibi_slopes if call.alibi_slopes is not None else default_alibi_slopes(q.shape[-2], q.device)
            alibi = slopes.to(device=q.device, dtype=torch.float32)
        if call.dropout > 0:
            # Drawn from torch's generator (inside the RNG tracker's fork when given), so seeding
            # and activation checkpointing reproduce the same dropout mask.
            with (call.rng_context() if call.rng_context is not None else contextlib.nullcontext()):
                rng_state = new_rng_state(q.device)
        return fused_attention(q, k, v, call.fmt, call.mask, call.window, call.softmax_scale, call.bottom_right,
                               *call.sequences, call.deterministic, bias, alibi, call.dropout, rng_state,
                               call.softmax_type, sink_logits(q, call.softmax_type, call.softmax_offset))


class FlashAttentionBackend(common.FlashAttention):
    """flash-attn-4 (:func:`~transformer_engine.pytorch.attention.flash_backend.flash_attention`)."""

    @classmethod
    def availability_reasons(cls, config: AttnConfig) -> List[str]:
        reasons = super().availability_reasons(config)
        unavailable = flash_backend.unavailable_reason()  # read now: the device and whether the package imports
        return reasons + [unavailable] if unavailable else reasons

    @staticmethod
    def run(q, k, v, call: AttnCall):
        return flash_backend.flash_attention(q, k, v, call.fmt, call.mask, call.window, call.softmax_scale,
                                             *call.sequences, call.deterministic)


class UnfusedAttentionBackend(common.UnfusedDotProductAttention):
    """PyTorch math (:func:`~transformer_engine.pytorch.attention.unfused.unfused_math`)."""

    @staticmethod
    def run(q, k, v, call: AttnCall):
        return unfused_math(q, k, v, call.fmt, call.mask, call.window, call.softmax_scale, call.bottom_right,
                            *call.sequences, call.attention_mask, call.bias_type, call.bias, call.alibi_slopes,
                            call.dropout, call.rng_context, call.softmax_type, call.softmax_offset,
                            call.return_max_logit)


# The PyTorch backends, in the common registry's order (a test keeps the two equal).
BACKENDS: Tuple[Type[common.AttentionBackend], ...] = (FlashAttentionBackend, FusedAttentionBackend,
                                                       UnfusedAttentionBackend)


def backend_named(name: str) -> Type[common.AttentionBackend]:
    """The PyTorch backend of ``NAME`` or ``SHORT_NAME`` ``name``."""
    return common.backend_named(name, BACKENDS)


def select(config: AttnConfig, candidates: Sequence[Type[common.AttentionBackend]] = BACKENDS,
           force: Optional[str] = None) -> common.Selection:
    """Backend selection over the PyTorch backends."""
    return common.select_backend(config, candidates, force=force)
