"""The PyTorch backends: the registry's classes (``transformer_engine.common.attention.backends``) with
their runner hooks and what only PyTorch knows, and backend selection over them.

Each class here subclasses the framework-free one of the same ``NAME``, so its identity, capabilities
and reasons are declared once, there. It adds ``run(q, k, v, call)``, which runs one
:class:`~transformer_engine.pytorch.attention.call.AttnCall` (DotProductAttention's arguments, converted and
checked once) on that backend.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple, Type

import torch

from transformer_engine.common.attention import backends as common
from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.enums import AttnBiasType
from transformer_engine.pytorch.attention import flash_backend
from transformer_engine.pytorch.attention.call import AttnCall
from transformer_engine.pytorch.attention.fused_attn import fused_attention, new_rng_state, sink_logits
from transformer_engine.pytorch.attention.unfused import default_alibi_slopes, unfused_math

__all__ = ["AttnCall", "FusedAttentionBackend", "FlashAttentionBackend", "UnfusedAttentionBackend", "BACKENDS",
           "backend_named", "select"]


class FusedAttentionBackend(common.FusedAttention):
    """The project's Triton kernels (:func:`~transformer_engine.pytorch.attention.fused_attn.fused_attention`)."""

    @staticmethod
    def run(q, k, v, call: AttnCall):
        p = call.params
        bias = alibi = rng_state = None
        if p.attn_bias_type == AttnBiasType.POST_SCALE_BIAS:
            bias = call.bias
        elif p.attn_bias_type == AttnBiasType.ALIBI:
            slopes = call.alibi_slopes if call.alibi_slopes is not None else default_alibi_slopes(q.shape[-2], q.device)
            alibi = slopes.to(device=q.device, dtype=torch.float32)
        if p.kernel_dropout > 0:
            # Drawn from torch's generator (inside the RNG tracker's fork when given), so seeding
            # and activation checkpointing reproduce the same dropout mask.
            with (call.rng_context() if call.rng_context is not None else contextlib.nullcontext()):
                rng_state = new_rng_state(q.device)
        return fused_attention(q, k, v, call.at_kernels(params=p, bias=bias, alibi_slopes=alibi, rng_state=rng_state,
                                                        softmax_offset=sink_logits(q, p.softmax_type,
                                                                                   call.softmax_offset)))


class FlashAttentionBackend(common.FlashAttention):
    """flash-attn-4 (:func:`~transformer_engine.pytorch.attention.flash_backend.flash_attention`)."""

    @classmethod
    def availability_reasons(cls, config: AttnConfig) -> List[str]:
        reasons = super().availability_reasons(config)
        unavailable = flash_backend.unavailable_reason()  # read now: the device and whether the package imports
        return reasons + [unavailable] if unavailable else reasons

    @staticmethod
    def run(q, k, v, call: AttnCall):
        p = call.params
        return flash_backend.flash_attention(q, k, v, p.qkv_format, p.attn_mask_type, p.window_size,
                                             p.scaling_factor, *call.sequences, p.deterministic)


class UnfusedAttentionBackend(common.UnfusedDotProductAttention):
    """PyTorch math (:func:`~transformer_engine.pytorch.attention.unfused.unfused_math`)."""

    @staticmethod
    def run(q, k, v, call: AttnCall):
        p = call.params
        return unfused_math(
            q, k, v, fmt=p.qkv_format, mask=p.attn_mask_type, window=p.window_size, softmax_scale=p.scaling_factor,
            bottom_right=p.bottom_right, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_kv=call.cu_seqlens_kv,
            cu_seqlens_q_padded=call.cu_seqlens_q_padded, cu_seqlens_kv_padded=call.cu_seqlens_kv_padded,
            max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv, attention_mask=call.attention_mask,
            bias_type=p.attn_bias_type, core_attention_bias=call.bias, alibi_slopes=call.alibi_slopes,
            dropout_p=p.kernel_dropout, rng_context=call.rng_context, softmax_type=p.softmax_type,
            softmax_offset=call.softmax_offset, return_max_logit=p.return_max_logit)


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
