"""TransformerEngine-JAX's attention enums, as transformer_engine.jax exposes them.

The attention kinds are the project's one family, :mod:`transformer_engine.common.attention.enums`,
under TE-JAX's names: ``transformer_engine.jax.enums.AttnMaskType`` *is*
``transformer_engine.common.attention.enums.AttnMaskType``, and so for ``AttnBiasType``,
``AttnSoftmaxType``, ``QKVFormat`` and ``QKVLayout``. TE-JAX code keeps its calls
(``AttnMaskType.PADDING_MASK.is_padding()``, ``QKVLayout.T3HD.is_thd()``,
``AttnSoftmaxType.from_str('off_by_one')``): the predicates are methods in both frameworks. The
members are string-valued (``AttnMaskType.CAUSAL_MASK == "causal"``); the off-by-one softmax's value
is ``'off-by-one'`` (TE-PyTorch's spelling), and TE-JAX's ``'off_by_one'`` converts to it.

Beyond TE-JAX's members, the layout enum keeps the SBHD layouts (which ``fused_attn`` runs) and
the bias and mask enums keep ``ALIBI`` and ``ARBITRARY_MASK`` (which ``fused_attn`` refuses with
``NotImplementedError``). ``CPStrategy`` and ``ReorderStrategy`` are JAX's own.
"""

from __future__ import annotations

from enum import Enum
from typing import Type

from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat, QKVLayout

__all__ = [
    "AttnBiasType",
    "AttnMaskType",
    "AttnSoftmaxType",
    "QKVFormat",
    "QKVLayout",
    "CPStrategy",
    "ReorderStrategy",
    "canonicalize_attn_mask_type",
    "from_common",
    "to_common",
]


class CPStrategy(Enum):
    """Context-parallel strategy of ``fused_attn`` (:mod:`transformer_engine.jax.context_parallel`):
    ALL_GATHER gathers keys and values with ``all_gather``, RING with ``cp - 1`` ``ppermute`` steps;
    both compute the same bits. DEFAULT is ALL_GATHER."""

    DEFAULT = 0
    ALL_GATHER = 1
    RING = 2


class ReorderStrategy(Enum):
    """Token reordering for causal load balancing across ``cp_size`` context-parallel ranks.

    - DualChunkSwap: the sequence is cut into ``2 * cp_size`` chunks and rank ``r`` holds chunks
      ``r`` and ``2 * cp_size - 1 - r``; 16 tokens on 4 ranks: ``[0, 1, 14, 15]``,
      ``[2, 3, 12, 13]``, ...
    - Striped: token ``t`` (in stripes of ``stripe_size``) goes to rank ``(t // stripe_size) %
      cp_size``; 16 tokens on 4 ranks: ``[0, 4, 8, 12]``, ``[1, 5, 9, 13]``, ...
    """

    DualChunkSwap = 0
    Striped = 1


_MASK_ALIASES = {
    "no_mask": "no_mask",
    "padding": "padding",
    "causal": "causal",
    "causal_bottom_right": "causal_bottom_right",
    "bottom_right_causal": "causal_bottom_right",
    "padding_causal": "padding_causal",
    "causal_padding": "padding_causal",
    "padding_causal_bottom_right": "padding_causal_bottom_right",
    "causal_padding_bottom_right": "padding_causal_bottom_right",
    "bottom_right_causal_padding": "padding_causal_bottom_right",
    "bottom_right_padding_causal": "padding_causal_bottom_right",
}


def canonicalize_attn_mask_type(attn_mask_type: str) -> AttnMaskType:
    """A mask name as TE-JAX's modules take it ('causal_padding', 'bottom_right_causal', ... are
    aliases), or a mask member -> :class:`AttnMaskType`."""
    if isinstance(attn_mask_type, Enum):
        return to_common(attn_mask_type, AttnMaskType, "attn_mask_type")
    key = attn_mask_type.lower() if isinstance(attn_mask_type, str) else attn_mask_type
    if key not in _MASK_ALIASES:
        raise ValueError(
            f"`attn_mask_type` must be one of {', '.join(repr(k) for k in _MASK_ALIASES)}, got {attn_mask_type!r}"
        )
    return AttnMaskType(_MASK_ALIASES[key])


_KINDS = (AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat, QKVLayout)


def to_common(value, common_cls: Type[Enum], arg: str):
    """A member of ``common_cls`` (one of the attention enums above), or a string naming one as TE-JAX's
    modules take them (the value; mask aliases; for layouts, bias and softmax types a member name or
    value in any case) -> the member. ``ValueError`` naming ``arg`` otherwise."""
    if isinstance(value, common_cls):
        return value
    if isinstance(value, str) and not isinstance(value, Enum):
        for member in common_cls:
            if member.value == value:
                return member
        if common_cls is AttnMaskType:
            if value.lower() in _MASK_ALIASES:
                return common_cls(_MASK_ALIASES[value.lower()])
        else:
            by_name = {m.name: m for m in common_cls}
            by_name.update({m.value.upper(): m for m in common_cls})
            if common_cls is AttnSoftmaxType:  # TE-JAX's spelling of the off-by-one value
                by_name["OFF_BY_ONE"] = common_cls.OFF_BY_ONE_SOFTMAX
            if value.upper() in by_name:
                return by_name[value.upper()]
    choices = ", ".join(repr(m.value) for m in common_cls)
    raise ValueError(f"`{arg}` must be one of {choices}, got {value!r}")


def from_common(member: Enum) -> Enum:
    """``member`` itself: the JAX names are the common enums (kept for code written when they were
    two families)."""
    if type(member) not in _KINDS:
        raise ValueError(f"`member` must be a member of an attention enum "
                         f"({', '.join(c.__name__ for c in _KINDS)}), got {member!r}")
    return member
