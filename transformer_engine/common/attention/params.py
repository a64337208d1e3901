"""AttnParams: the non-tensor parameters of one fused attention call, converted and checked once.

A frontend builds one at its boundary (PyTorch: ``fused_attn_func`` and DotProductAttention; JAX:
``fused_attn``, whose ``FusedAttnStatic`` extends this class) and hands it whole down to the launch
description (``launch_description.Call.params``). Every field is already in canonical form: enums, not
strings; the window normalized (:func:`normalize_window`);
the diagonal resolved (:func:`resolve_bottom_right_diagonal`)
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

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat

__all__ = ["AttnParams", "normalize_window", "resolve_bottom_right_diagonal", "window_kind", "NO_WINDOW"]

NO_WINDOW = (-1, -1)


def normalize_window(window_size: Optional[Tuple[int, int]], attn_mask_type: AttnMaskType) -> Tuple[int, int]:
    """TransformerEngine's window semantics, validated.

    ``(left, right)``: query ``i`` sees keys ``j`` with ``i + d - left <= j <= i + d + right``, where
    ``d`` is ``s_kv - s_q`` when the diagonal is aligned bottom-right and 0 when it is aligned top-left
    (:func:`resolve_bottom_right_diagonal`); -1 means unbounded. Causal masks bound ``right`` at 0.
    """
    mask = AttnMaskType(attn_mask_type)
    if window_size is None:
        window_size = NO_WINDOW
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"`window_size` must be a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"`window_size` entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    if mask.is_causal():
        if right not in (-1, 0):
            raise ValueError(
                f"`window_size` must have right in (-1, 0) with attn_mask_type={mask.value!r}, got {window_size!r}"
            )
        right = 0
    elif mask == AttnMaskType.ARBITRARY_MASK and (left, right) != NO_WINDOW:
        raise ValueError(f"`window_size` must be (-1, -1) with attn_mask_type='arbitrary', got {window_size!r}")
    return (left, right)


def resolve_bottom_right_diagonal(attn_mask_type: AttnMaskType, bottom_right_diagonal: Optional[bool],
                                  framework: str = "pytorch") -> bool:
    """Whether sliding windows and ALiBi align their diagonal with the bottom-right corner of each
    sequence's [s_q, s_kv] score matrix (``d = s_kv - s_q``) rather than the top-left (``d = 0``).

    TransformerEngine's rule: the causal masks fix it (``causal``/``padding_causal``: top-left;
    ``*_causal_bottom_right``: bottom-right) whatever is passed; for the other masks an explicit
    ``bottom_right_diagonal`` decides, and ``None`` takes the framework's default: bottom-right in
    PyTorch, top-left in JAX (TransformerEngine-JAX aligns windows bottom-right only for the
    bottom-right causal masks).
    """
    mask = AttnMaskType(attn_mask_type)
    if mask.is_top_left_causal():
        return False
    if mask.is_causal():  # the bottom-right causal masks
        return True
    if bottom_right_diagonal is None:
        return framework != "jax"
    if not isinstance(bottom_right_diagonal, bool):
        raise ValueError(f"`bottom_right_diagonal` must be None or a bool, got {bottom_right_diagonal!r}")
    return bottom_right_diagonal


def window_kind(attn_mask_type: AttnMaskType, window_size: Tuple[int, int]) -> str:
    """'none', 'causal', 'sliding' — what a tile configuration may depend on (a normalized window)."""
    if window_size[0] >= 0 or window_size[1] > 0:
        return "sliding"
    if attn_mask_type.is_causal():
        return "causal"
    return "none"



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
