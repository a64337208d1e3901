"""AttnParams: the non-tensor parameters of one fused attention call, converted and checked once.

A frontend builds one at its boundary (PyTorch: ``fused_attn_func`` and DotProductAttention; JAX:
``fused_attn``, whose ``FusedAttnStatic`` extends this class) and hands it whole down to the launch
description (``launch_description.Call.params``). Every field is already in canonical form: enums, not
strings; the window normalized (:func:`~transformer_engine.common.attention.config.normalize_window`);
the diagonal resolved (:func:`~transformer_engine.common.attention.config.resolve_bottom_right_diagonal`)
by the frontends. A parameter added here travels to the kernels without new arguments on the way: the
frontends' call objects carry the dataclass, and PyTorch's custom ops take its fields as their schema's
scalars (``pytorch/attention/call.py``).

Where the call's tensors are (q, k, v, sequence lengths and offsets, bias, ...) is the frontend's; shapes
and strides are the launch description's (``launch_description.Call``); what selection and planning decide
from is :class:`~transformer_engine.common.attention.config.AttnConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from transformer_engine.common.attention.config import resolve_bottom_right_diagonal
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat

__all__ = ["AttnParams"]


@dataclass(frozen=True)
class AttnParams:
    """The scalars of one fused attention call (TransformerEngine-JAX's names, which ``FusedAttnStatic``
    keeps).

    ``attn_mask_type``: the effective mask (the padding forms where sequences have lengths);
    ``qkv_format``: the user's tensors' format; ``window_size``: normalized, -1 unbounded;
    ``scaling_factor``: the softmax scale (positive by the time it reaches the kernels: the frontends apply
    ``validation.kernel_scale``); ``dropout_probability`` applies when ``is_training``;
    ``bottom_right_diagonal``: the diagonal of sliding windows and ALiBi, resolved by the frontend (None
    takes :attr:`framework`'s default, see :attr:`bottom_right`); ``max_seqlen_q``/``max_seqlen_kv``: the
    longest sequence of each side where the tensors do not say it (PyTorch's thd; None otherwise);
    ``return_max_logit``: the forward also writes each row's max logit (the per-head max logit's parts).
    ``kv_page_size``: keys and values are a paged KV cache's rows, read through the call's page table in pages
    of this many tokens (PyTorch: ``AttnCall.page_table``; forward only); None: rows in place.
    ``deterministic`` changes no launch (both modes run the same fixed-order kernels); it is the call's
    request, which logs and CP read.
    """

    # Whose default a None diagonal takes (resolve_bottom_right_diagonal): a frontend's subclass names its own.
    framework: ClassVar[str] = "pytorch"

    attn_mask_type: AttnMaskType
    attn_bias_type: AttnBiasType
    qkv_format: QKVFormat
    window_size: Tuple[int, int]
    scaling_factor: float
    dropout_probability: float = 0.0
    is_training: bool = True
    deterministic: bool = False
    bottom_right_diagonal: Optional[bool] = None
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    return_max_logit: bool = False
    kv_page_size: Optional[int] = None

    @property
    def bottom_right(self) -> bool:
        """The resolved diagonal alignment of windows and ALiBi (the kernels' BOTTOM_RIGHT)."""
        return resolve_bottom_right_diagonal(self.attn_mask_type, self.bottom_right_diagonal, self.framework)

    @property
    def has_bias(self) -> bool:
        return self.attn_bias_type != AttnBiasType.NO_BIAS

    @property
    def has_dropout(self) -> bool:
        return self.is_training and self.dropout_probability > 0.0

    @property
    def kernel_dropout(self) -> float:
        """The probability the kernels drop with: 0 unless :attr:`has_dropout`."""
        return self.dropout_probability if self.has_dropout else 0.0
