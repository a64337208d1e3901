"""TransformerEngine-JAX's attention enums, as transformer_engine.jax exposes them.

TE-JAX code uses these names and methods (``AttnMaskType.PADDING_MASK.is_padding()``,
``QKVLayout.T3HD.is_thd()``, ``AttnSoftmaxType.from_str('vanilla')``, ``CPStrategy.DEFAULT``,
...). The rest of the project (the framework-free code in :mod:`transformer_engine.common`, the
JAX primitives, context parallelism, the jnp math) reads only the framework-free enums of
:mod:`transformer_engine.common.attention.enums`, shared with PyTorch, which have *properties*
where these have methods (``mask.is_causal`` there, ``mask.is_causal()`` here).

The two families are kept apart: these are plain enums (not ``str``), so a member here never
equals a common member or a string (``AttnMaskType.CAUSAL_MASK != common.AttnMaskType.CAUSAL_MASK``,
``!= "causal"``), and a common enum refuses to be built from one of them. The public entry points
(``fused_attn``, the availability queries, ``mask_to_sequence_descriptor``, the Flax modules)
convert at their boundary with :func:`to_common`: they accept a member of either family, or its
string value. Members of the same name correspond (``to_common`` goes by name, and
:func:`from_common` back), and share the string value except ``AttnSoftmaxType.OFF_BY_ONE_SOFTMAX``
(``'off_by_one'`` here, as TE-JAX spells it; ``'off-by-one'`` there, as TE-PyTorch does).

Beyond TE-JAX's members, the layout enum keeps the SBHD layouts (which ``fused_attn`` runs) and
the bias and mask enums keep ``ALIBI`` and ``ARBITRARY_MASK`` (which ``fused_attn`` refuses with
``NotImplementedError``), so that code written against the earlier enums keeps working.
"""

from __future__ import annotations

from enum import Enum
from typing import Type

from transformer_engine.common.attention import enums as _common

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


class AttnBiasType(Enum):
    """NO_BIAS: softmax(scale * qk); PRE_SCALE_BIAS: softmax(scale * (qk + bias));
    POST_SCALE_BIAS: softmax(scale * qk + bias). (ALIBI: refused by ``fused_attn``.)"""

    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"
    ALIBI = "alibi"


class AttnMaskType(Enum):
    """Mask kinds. Causal is top-left aligned; the bottom-right kinds align the diagonal with the
    last key of each sequence. (ARBITRARY_MASK: refused by ``fused_attn``.)"""

    NO_MASK = "no_mask"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"
    CAUSAL_BOTTOM_RIGHT_MASK = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = "padding_causal_bottom_right"
    ARBITRARY_MASK = "arbitrary"

    def is_causal(self) -> bool:
        """True for the causal masks (top-left and bottom-right, with or without padding)."""
        return "causal" in self.value

    def is_padding(self) -> bool:
        """True for the masks that take which tokens are real from a sequence descriptor."""
        return "padding" in self.value

    def is_bottom_right(self) -> bool:
        """True when the causal diagonal is aligned with the last key (bottom-right)."""
        return "bottom_right" in self.value


class AttnSoftmaxType(Enum):
    """VANILLA_SOFTMAX: exp(s_i) / sum_j exp(s_j); OFF_BY_ONE_SOFTMAX: exp(s_i) / (1 + sum_j exp(s_j));
    LEARNABLE_SOFTMAX: exp(s_i) / (exp(alpha_h) + sum_j exp(s_j)) with a learnable ``alpha`` per head."""

    VANILLA_SOFTMAX = "vanilla"
    OFF_BY_ONE_SOFTMAX = "off_by_one"
    LEARNABLE_SOFTMAX = "learnable"

    @classmethod
    def from_str(cls, softmax_type: str) -> "AttnSoftmaxType":
        """'vanilla', 'off_by_one' (or 'off-by-one') or 'learnable'."""
        key = softmax_type.replace("-", "_") if isinstance(softmax_type, str) else softmax_type
        for member in cls:
            if member.value == key:
                return member
        raise ValueError(
            f"`softmax_type` must be one of 'vanilla', 'off_by_one', 'learnable', got {softmax_type!r}"
        )


class QKVFormat(Enum):
    """SBHD: [s, b, ..., h, d]; BSHD: [b, s, ..., h, d]; THD: BSHD rows packing several sequences."""

    SBHD = "sbhd"
    BSHD = "bshd"
    THD = "thd"


class QKVLayout(Enum):
    """How q, k and v are laid out: qkv-packed (``[b, s, 3, h, d]``), kv-packed (q and
    ``[b, s, 2, h, d]``) or separate, in the BSHD, THD (and SBHD) formats."""

    BS3HD = "bs3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    BSHD_BSHD_BSHD = "bshd_bshd_bshd"
    T3HD = "t3hd"
    THD_T2HD = "thd_t2hd"
    THD_THD_THD = "thd_thd_thd"
    SB3HD = "sb3hd"
    SBHD_SB2HD = "sbhd_sb2hd"
    SBHD_SBHD_SBHD = "sbhd_sbhd_sbhd"

    def _common(self) -> _common.QKVLayout:
        return _common.QKVLayout(self.value)

    def get_qkv_format(self) -> QKVFormat:
        """The format (BSHD, SBHD or THD) of this layout."""
        return QKVFormat(self._common().qkv_format.value)

    @property
    def qkv_format(self) -> QKVFormat:
        """Same as :meth:`get_qkv_format`."""
        return self.get_qkv_format()

    @property
    def packing(self) -> str:
        """'qkv', 'kv' or 'separate'."""
        return self._common().packing

    def is_qkvpacked(self) -> bool:
        return self.packing == "qkv"

    def is_kvpacked(self) -> bool:
        return self.packing == "kv"

    def is_separate(self) -> bool:
        return self.packing == "separate"

    def is_thd(self) -> bool:
        return self.get_qkv_format() == QKVFormat.THD

    def _with_packing(self, packing: str) -> "QKVLayout":
        return QKVLayout(_common.QKVLayout.from_format(self._common().qkv_format, packing).value)

    def to_qkvpacked(self) -> "QKVLayout":
        """The qkv-packed layout of the same format."""
        return self._with_packing("qkv")

    def to_kvpacked(self) -> "QKVLayout":
        """The kv-packed layout of the same format."""
        return self._with_packing("kv")

    def to_separate(self) -> "QKVLayout":
        """The separate-tensors layout of the same format."""
        return self._with_packing("separate")


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
    aliases), or a mask member of either family -> :class:`AttnMaskType`."""
    if isinstance(attn_mask_type, Enum):
        return from_common(to_common(attn_mask_type, _common.AttnMaskType, "attn_mask_type"))
    key = attn_mask_type.lower() if isinstance(attn_mask_type, str) else attn_mask_type
    if key not in _MASK_ALIASES:
        raise ValueError(
            f"`attn_mask_type` must be one of {', '.join(repr(k) for k in _MASK_ALIASES)}, got {attn_mask_type!r}"
        )
    return AttnMaskType(_MASK_ALIASES[key])


# Each enum above with a common counterpart; members of the same name correspond.
_COMMON_OF = {
    AttnBiasType: _common.AttnBiasType,
    AttnMaskType: _common.AttnMaskType,
    AttnSoftmaxType: _common.AttnSoftmaxType,
    QKVFormat: _common.QKVFormat,
    QKVLayout: _common.QKVLayout,
}
_JAX_OF = {common_cls: jax_cls for jax_cls, common_cls in _COMMON_OF.items()}


def to_common(value, common_cls: Type[Enum], arg: str):
    """A member of a JAX enum above, of the common enum ``common_cls``, or a string value (or, for
    layouts, bias and softmax types, a member name in any case, as TE-JAX's modules take them)
    -> the member of ``common_cls``. ``ValueError`` naming ``arg`` otherwise.

    A JAX member converts by name to the common member of the same name; what the project past
    the frontends reads is always the result."""
    if isinstance(value, common_cls):
        return value
    if _COMMON_OF.get(type(value)) is common_cls:
        return common_cls[value.name]
    raw = value.value if isinstance(value, Enum) else value
    if isinstance(raw, str):
        for member in common_cls:
            if member.value == raw:
                return member
        if common_cls is _common.AttnMaskType:
            if raw.lower() in _MASK_ALIASES:
                return common_cls(_MASK_ALIASES[raw.lower()])
        else:
            by_name = {m.name: m for m in common_cls}
            by_name.update({m.value.upper(): m for m in common_cls})
            if common_cls is _common.AttnSoftmaxType:  # TE-JAX's spelling of the off-by-one value
                by_name[AttnSoftmaxType.OFF_BY_ONE_SOFTMAX.value.upper()] = common_cls.OFF_BY_ONE_SOFTMAX
            if raw.upper() in by_name:
                return by_name[raw.upper()]
    choices = ", ".join(repr(m.value) for m in common_cls)
    raise ValueError(f"`{arg}` must be one of {choices}, got {value!r}")


def from_common(member: Enum) -> Enum:
    """A member of a common enum (:mod:`transformer_engine.common.attention.enums`) -> the JAX
    member of the same name (what TE-JAX code reads: ``from_common(m).is_causal()``)."""
    jax_cls = _JAX_OF.get(type(member))
    if jax_cls is None:
        raise ValueError(f"`member` must be a member of a common attention enum "
                         f"({', '.join(c.__name__ for c in _JAX_OF)}), got {member!r}")
    return jax_cls[member.name]
