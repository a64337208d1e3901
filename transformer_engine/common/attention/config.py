"""AttnConfig: the one frozen description of an attention call that every decision reads."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Optional, Tuple

from transformer_engine.common.attention.enums import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVFormat,
    QKVLayout,
)

__all__ = ["AttnConfig", "PlanKey", "normalize_window", "resolve_bottom_right_diagonal", "window_kind", "NO_WINDOW",
           "gfx_target"]

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


def gfx_target(name: str) -> str:
    """An AMD GPU's gfx target as plans name it: ROCm's full name without its features
    ("gfx942:sramecc+:xnack-" -> "gfx942")."""
    target = str(name).split(":", 1)[0].strip().lower()
    if not target.startswith("gfx"):
        raise ValueError(f"`name` must be an AMD gfx target such as 'gfx942:sramecc+:xnack-', got {name!r}")
    return target


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
class PlanKey:
    """What a launch plan reads of a call (``plan.py``, ``explain.py``), and nothing else: head dims,
    dtype, mask and normalized window with the resolved diagonal, score modifiers, softmax type and the
    device. No batch size, no sequence length: the determinism contract's invariance (tiles are functions
    of these only) holds by construction. :meth:`PlanKey.of` builds every one: :attr:`AttnConfig.plan_key` a config's, the launch
    description (``launch_description.Call.plan_key``) one per call. The names are AttnConfig's."""

    head_dim_qk: int
    head_dim_v: int
    dtype: str  # "float16", "bfloat16" or "float32"
    attn_mask_type: AttnMaskType = AttnMaskType.NO_MASK
    window_size: Tuple[int, int] = NO_WINDOW
    bottom_right: bool = False  # the resolved diagonal (AttnConfig.bottom_right)
    attn_bias_type: AttnBiasType = AttnBiasType.NO_BIAS
    dropout: float = 0.0
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    device_type: str = "cuda"
    compute_capability: Optional[Tuple[int, int]] = None
    vendor: str = "nvidia"
    gfx_arch: Optional[str] = None
    return_max_logit: bool = False  # the forward writes row maxima
    # Keys per page where K/V are read through a page table (a paged KV cache's forward; 0: rows in place). The
    # forward sums as the config's contiguous calls do, in the same kernel where its loads can follow pages of this
    # size (plan.pages_keep_bits). A launch fact, not an AttnConfig one: AttnConfig.plan_key leaves it 0.
    kv_page_size: int = 0

    @property
    def window_kind(self) -> str:
        return window_kind(self.attn_mask_type, self.window_size)

    @classmethod
    def of(cls, source, **given) -> "PlanKey":
        """The one PlanKey builder: each field from ``given``, else ``source``'s attribute of that name
        (an AttnConfig has them all but ``kv_page_size``), else the field's default."""
        values = {}
        for f in fields(cls):
            if f.name in given:
                values[f.name] = given.pop(f.name)
            elif hasattr(source, f.name):
                values[f.name] = getattr(source, f.name)
            elif f.default is MISSING:
                raise TypeError(f"PlanKey.of: {f.name!r} is neither given nor an attribute of {type(source).__name__}")
        if given:
            raise TypeError(f"PlanKey.of: no PlanKey field named {', '.join(sorted(given))}")
        return cls(**values)


@dataclass(frozen=True)
class AttnConfig:
    """Everything backend selection and launch planning need to know about one call.

    Frontends build it from their arguments; nothing here holds tensors.
    """

    batch_size: int
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_kv: int
    dtype: str  # "float16", "bfloat16" or "float32"
    qkv_layout: QKVLayout = QKVLayout.BSHD_BSHD_BSHD
    attn_mask_type: AttnMaskType = AttnMaskType.NO_MASK
    window_size: Tuple[int, int] = NO_WINDOW
    # Diagonal of sliding windows and ALiBi (resolve_bottom_right_diagonal; None: the framework's default).
    bottom_right_diagonal: Optional[bool] = None
    attn_bias_type: AttnBiasType = AttnBiasType.NO_BIAS
    bias_shape: Optional[str] = None  # "1hss", "b1ss", "bhss", "11ss", "111s"
    dropout: float = 0.0
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX  # sink softmax: off-by-one, learnable
    is_training: bool = True
    deterministic: bool = False
    # The call returns each head's max logit (PyTorch's return_max_logit=True); only some backends compute it.
    return_max_logit: bool = False
    # Per-sequence lengths with a cu_seqlens_kv of their own (cross attention): keys and queries of one
    # sequence may differ in number, which static shapes do not show.
    distinct_kv_lengths: bool = False
    framework: str = "pytorch"
    device_type: str = "cuda"  # "cuda" or "cpu"
    compute_capability: Optional[Tuple[int, int]] = None  # NVIDIA GPUs (None on AMD: see gfx_arch)
    vendor: str = "nvidia"  # of a "cuda" device: "nvidia" or "amd" (ROCm GPUs are "cuda" devices to PyTorch)
    gfx_arch: Optional[str] = None  # AMD GPUs: the gfx target without its features, e.g. "gfx942"
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels run on the CPU
    extra: Tuple[Tuple[str, str], ...] = field(default=())  # frontend-specific facts as (name, reason)

    @property
    def qkv_format(self) -> QKVFormat:
        return self.qkv_layout.qkv_format

    @property
    def gqa_group_size(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def bottom_right(self) -> bool:
        """The resolved diagonal alignment of windows and ALiBi (what the kernels' BOTTOM_RIGHT is)."""
        return resolve_bottom_right_diagonal(self.attn_mask_type, self.bottom_right_diagonal, self.framework)

    @property
    def window_kind(self) -> str:
        """'none', 'causal', 'sliding' — what a tile configuration may depend on."""
        return window_kind(self.attn_mask_type, self.window_size)

    @property
    def plan_key(self) -> PlanKey:
        """What launch plans read of this config (:class:`PlanKey`; kv_page_size 0)."""
        return PlanKey.of(self)

    @property
    def arch(self) -> Optional[str]:
        """The GPU architecture as plans name it ("sm90", "gfx942"), None off GPUs or when unknown."""
        if self.device_type != "cuda":
            return None
        if self.vendor == "amd":
            return self.gfx_arch
        if self.compute_capability is None:
            return None
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"

    def describe(self) -> str:
        """One line for logs and errors."""
        return (
            f"b={self.batch_size} h_q={self.num_heads_q} h_kv={self.num_heads_kv} "
            f"s_q={self.max_seqlen_q} s_kv={self.max_seqlen_kv} d_qk={self.head_dim_qk} d_v={self.head_dim_v} "
            f"dtype={self.dtype} layout={self.qkv_layout.value} mask={self.attn_mask_type.value} "
            f"window={self.window_size} bottom_right={self.bottom_right} bias={self.attn_bias_type.value} "
            f"dropout={self.dropout} "
            f"softmax={self.softmax_type.value} "
            f"training={self.is_training} deterministic={self.deterministic} "
            f"device={self.device_type} arch={self.arch} framework={self.framework}"
        )
