"""TransformerEngine's attention enums, as string-valued enums shared by both frontends.

These are the only attention enums: ``transformer_engine.jax.enums`` re-exports them under
TransformerEngine-JAX's names, so a JAX member *is* the member here. The mask and layout predicates
are methods (``mask.is_causal()``, ``layout.is_thd()``), the form TE-JAX user code calls: a property
of the same name could not also be called. A predicate read without its call is a bound method,
always true, so ``tests/common/test_enums.py`` checks that the package never reads one so.
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    """Base of the enums below: members are their string values (``AttnMaskType("causal")``,
    ``AttnMaskType.CAUSAL_MASK == "causal"``). A member of any other enum is refused, even one
    with a matching value (a ``CPStrategy`` is no mask)."""

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, Enum):
            raise ValueError(
                f"`value` must be a member of {cls.__module__}.{cls.__qualname__} or its string value, got "
                f"{value!r}, a member of {type(value).__module__}.{type(value).__qualname__}"
            )
        return None


class QKVFormat(_StrEnum):
    """Axis order of one tensor: batch-major, sequence-major, or packed tokens."""

    BSHD = "bshd"
    SBHD = "sbhd"
    THD = "thd"


class QKVLayout(_StrEnum):
    """How q, k and v are laid out: separate, kv-packed or qkv-packed, per format."""

    BS3HD = "bs3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    BSHD_BSHD_BSHD = "bshd_bshd_bshd"
    SB3HD = "sb3hd"
    SBHD_SB2HD = "sbhd_sb2hd"
    SBHD_SBHD_SBHD = "sbhd_sbhd_sbhd"
    T3HD = "t3hd"
    THD_T2HD = "thd_t2hd"
    THD_THD_THD = "thd_thd_thd"

    @property
    def qkv_format(self) -> QKVFormat:
        return QKVFormat(self.value[:2] + "hd" if self.value[0] != "t" else "thd")

    @property
    def packing(self) -> str:
        """'qkv', 'kv' or 'separate'."""
        if "3" in self.value:
            return "qkv"
        if "2" in self.value:
            return "kv"
        return "separate"

    def get_qkv_format(self) -> QKVFormat:
        """:attr:`qkv_format` (TE-JAX's spelling)."""
        return self.qkv_format

    def is_thd(self) -> bool:
        return self.qkv_format == QKVFormat.THD

    def is_qkvpacked(self) -> bool:
        return self.packing == "qkv"

    def is_kvpacked(self) -> bool:
        return self.packing == "kv"

    def is_separate(self) -> bool:
        return self.packing == "separate"

    def to_qkvpacked(self) -> "QKVLayout":
        """The qkv-packed layout of the same format."""
        return QKVLayout.from_format(self.qkv_format, "qkv")

    def to_kvpacked(self) -> "QKVLayout":
        """The kv-packed layout of the same format."""
        return QKVLayout.from_format(self.qkv_format, "kv")

    def to_separate(self) -> "QKVLayout":
        """The separate-tensors layout of the same format."""
        return QKVLayout.from_format(self.qkv_format, "separate")

    @classmethod
    def from_format(cls, qkv_format: QKVFormat, packing: str = "separate") -> "QKVLayout":
        table = {
            (QKVFormat.BSHD, "qkv"): cls.BS3HD,
            (QKVFormat.BSHD, "kv"): cls.BSHD_BS2HD,
            (QKVFormat.BSHD, "separate"): cls.BSHD_BSHD_BSHD,
            (QKVFormat.SBHD, "qkv"): cls.SB3HD,
            (QKVFormat.SBHD, "kv"): cls.SBHD_SB2HD,
            (QKVFormat.SBHD, "separate"): cls.SBHD_SBHD_SBHD,
            (QKVFormat.THD, "qkv"): cls.T3HD,
            (QKVFormat.THD, "kv"): cls.THD_T2HD,
            (QKVFormat.THD, "separate"): cls.THD_THD_THD,
        }
        return table[(QKVFormat(qkv_format), packing)]


class AttnMaskType(_StrEnum):
    """Mask kinds. Causal is top-left aligned; *_bottom_right aligns the diagonal to the last key."""

    NO_MASK = "no_mask"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"
    CAUSAL_BOTTOM_RIGHT_MASK = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = "padding_causal_bottom_right"
    ARBITRARY_MASK = "arbitrary"

    def is_causal(self) -> bool:
        """The causal masks (top-left and bottom-right, with or without padding)."""
        return "causal" in self.value

    def is_padding(self) -> bool:
        """The masks that take which tokens are real from the sequence lengths."""
        return "padding" in self.value

    def is_bottom_right(self) -> bool:
        """The causal diagonal is aligned with the last key."""
        return "bottom_right" in self.value

    def is_top_left_causal(self) -> bool:
        """causal / padding_causal: the diagonal starts at the first key whatever the lengths."""
        return self.is_causal() and not self.is_bottom_right()


class AttnBiasType(_StrEnum):
    """Bias added to the attention scores: none, before or after scaling (``post_scale_bias`` is
    ``softmax(q k^T * scale + bias)``), or ALiBi's per-head linear bias."""

    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"
    ALIBI = "alibi"


class AttnSoftmaxType(_StrEnum):
    """Softmax kinds. ``off-by-one`` adds 1 (a zero sink logit) to each row's denominator,
    ``learnable`` adds ``exp(softmax_offset[h])`` with a learnable per-head sink logit. The sink
    takes probability but has no value vector: it only shrinks the row's weights."""

    VANILLA_SOFTMAX = "vanilla"
    OFF_BY_ONE_SOFTMAX = "off-by-one"
    LEARNABLE_SOFTMAX = "learnable"

    @classmethod
    def _missing_(cls, value):
        # TransformerEngine-JAX spells it "off_by_one"; the PyTorch side "off-by-one".
        if isinstance(value, str) and value.replace("_", "-") == cls.OFF_BY_ONE_SOFTMAX.value:
            return cls.OFF_BY_ONE_SOFTMAX
        return super()._missing_(value)

    @classmethod
    def from_str(cls, softmax_type: str) -> "AttnSoftmaxType":
        """'vanilla', 'off-by-one' (or TE-JAX's 'off_by_one') or 'learnable'."""
        if isinstance(softmax_type, str):
            key = softmax_type.replace("_", "-")
            for member in cls:
                if member.value == key:
                    return member
        raise ValueError(
            f"`softmax_type` must be one of 'vanilla', 'off_by_one', 'learnable', got {softmax_type!r}"
        )

    @property
    def has_sink(self) -> bool:
        return self != AttnSoftmaxType.VANILLA_SOFTMAX

    @property
    def is_learnable(self) -> bool:
        return self == AttnSoftmaxType.LEARNABLE_SOFTMAX


class BackwardGrads(_StrEnum):
    """Which gradient passes a fused backward runs (this project's, not a TransformerEngine enum):
    ``dq+dkdv`` (the default, the whole backward), ``dq`` (preprocess and the dQ pass) or ``dkdv``
    (preprocess and the dK/dV pass). Context parallelism keeps dQ of one call and dK/dV of another,
    so it asks each call for its part only. The kernels are the same, so a part's gradients are
    bitwise the whole backward's; dBias and d softmax_offset are asked for apart from this."""

    DQ_DKDV = "dq+dkdv"
    DQ = "dq"
    DKDV = "dkdv"

    @property
    def has_dq(self) -> bool:
        return self != BackwardGrads.DKDV

    @property
    def has_dkdv(self) -> bool:
        return self != BackwardGrads.DQ
