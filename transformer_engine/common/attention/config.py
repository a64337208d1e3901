"""AttnConfig: one attention call as every decision reads it: the call's parameters (the AttnParams value the
launch reads too) with its geometry and device; PlanKey: what launch plans read of it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional, Tuple

from transformer_engine.common.attention.enums import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVLayout,
)
from transformer_engine.common.attention.params import (  # noqa: F401 (the window helpers' historical home)
    NO_WINDOW, AttnParams, normalize_window, resolve_bottom_right_diagonal, window_kind,
)

__all__ = ["AttnConfig", "PlanKey", "normalize_window", "resolve_bottom_right_diagonal", "window_kind", "NO_WINDOW",
           "gfx_target"]


def gfx_target(name: str) -> str:
    """An AMD GPU's gfx target as plans name it: ROCm's full name without its features
    ("gfx942:sramecc+:xnack-" -> "gfx942")."""
    target = str(name).split(":", 1)[0].strip().lower()
    if not target.startswith("gfx"):
        raise ValueError(f"`name` must be an AMD gfx target such as 'gfx942:sramecc+:xnack-', got {name!r}")
    return target


@dataclass(frozen=True)
class PlanKey:
    """What a launch plan reads of a call (``plan.py``, ``explain.py``), and nothing else: head dims,
    dtype, mask and normalized window with the resolved diagonal, score modifiers, softmax type and the
    device. No batch size, no sequence length: the determinism contract's invariance (tiles are functions
    of these only) holds by construction. :meth:`PlanKey.of` builds every one: :attr:`AttnConfig.plan_key` a config's, the launch
    description (``launch_description.plan_key``) one per launch. The names are AttnConfig's and AttnParams'."""

    head_dim_qk: int
    head_dim_v: int
    dtype: str  # "float16", "bfloat16" or "float32"
    attn_mask_type: AttnMaskType = AttnMaskType.NO_MASK
    window_size: Tuple[int, int] = NO_WINDOW
    bottom_right: bool = False  # the resolved diagonal (AttnConfig.bottom_right)
    attn_bias_type: AttnBiasType = AttnBiasType.NO_BIAS
    kernel_dropout: float = 0.0  # the probability the kernels drop with (AttnParams.kernel_dropout)
    softmax_type: AttnSoftmaxType = AttnSoftmaxType.VANILLA_SOFTMAX
    device_type: str = "cuda"
    compute_capability: Optional[Tuple[int, int]] = None
    vendor: str = "nvidia"
    gfx_arch: Optional[str] = None
    return_max_logit: bool = False  # the forward writes row maxima
    # Keys per page where K/V are read through a page table (a paged KV cache's forward; 0: rows in place). The
    # forward sums as the config's contiguous calls do, in the same kernel where its loads can follow pages of this
    # size (plan.pages_keep_bits); AttnParams.kv_page_size (None there for rows in place).
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


# AttnParams' fields and derived values that an AttnConfig reads as its own attributes (``config.window_size`` is
# ``config.params.window_size``), set up below the class. ``max_seqlen_q``/``max_seqlen_kv`` are not among them:
# the config's are the call's longest sequences, always known; the parameters' only where the tensors do not say
# them (thd), as the kernels take them.
_PARAM_FIELDS = tuple(f.name for f in fields(AttnParams))
_PARAM_ONLY = tuple(n for n in _PARAM_FIELDS if n not in ("max_seqlen_q", "max_seqlen_kv"))
_PARAM_VIEWS = _PARAM_ONLY + ("has_bias", "has_dropout", "kernel_dropout")


@dataclass(frozen=True)
class AttnConfig:
    """One attention call as backend selection and launch planning read it: its parameters (``params``, the
    AttnParams value the frontend checked once and the launch reads), the tensors' geometry and the device.
    Nothing here holds tensors and no parameter is held twice: ``config.attn_mask_type``, ``window_size``,
    ``dropout_probability``, ``deterministic`` ... are ``params``' fields read through the config, and the layout
    is ``params.qkv_format`` packed as ``packing`` says. :meth:`of` builds one from flat fields and
    :meth:`replace` changes fields of either kind.
    """

    batch_size: int
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_kv: int
    dtype: str  # "float16", "bfloat16" or "float32"
    params: AttnParams
    packing: str = "separate"  # how the user's q, k, v share buffers: "qkv", "kv" or "separate" (qkv_layout)
    bias_shape: Optional[str] = None  # "1hss", "b1ss", "bhss", "11ss", "111s"
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

    def __post_init__(self):
        if not isinstance(self.params, AttnParams):
            raise TypeError(f"`params` must be an AttnParams, got {type(self.params).__name__}")
        QKVLayout.from_format(self.params.qkv_format, self.packing)  # a packing the format has

    @classmethod
    def of(cls, **fields_) -> "AttnConfig":
        """An AttnConfig from flat fields: its own (``max_seqlen_*`` are the config's), ``params``' by their
        names, and ``qkv_layout`` (the format and packing). Parameters not given take AttnParams' defaults; those it requires: no mask, no window,
        no bias, the layout's format and the softmax scale 1/sqrt(head_dim_qk)."""
        if "params" in fields_:
            raise TypeError("AttnConfig.of: give the parameters' fields, not `params` (use AttnConfig(...))")
        layout = QKVLayout(fields_.pop("qkv_layout", QKVLayout.BSHD_BSHD_BSHD))
        given = {name: fields_.pop(name) for name in list(fields_) if name in _PARAM_ONLY}
        params = dict(attn_mask_type=AttnMaskType.NO_MASK, attn_bias_type=AttnBiasType.NO_BIAS,
                      qkv_format=layout.qkv_format, window_size=NO_WINDOW,
                      scaling_factor=1.0 / math.sqrt(fields_.get("head_dim_qk", 1) or 1))
        params.update(given)
        if params["qkv_format"] != layout.qkv_format:
            raise ValueError(f"`qkv_format` must be qkv_layout's ({layout.qkv_format.value!r}), "
                             f"got {params['qkv_format']!r}")
        return cls(params=AttnParams(**params), packing=layout.packing, **fields_)

    def replace(self, **changes) -> "AttnConfig":
        """This config with ``changes``: its own fields, ``params``' by their names, or ``qkv_layout``."""
        given = {name: changes.pop(name) for name in list(changes) if name in _PARAM_ONLY}
        if "qkv_layout" in changes:
            layout = QKVLayout(changes.pop("qkv_layout"))
            given["qkv_format"], changes["packing"] = layout.qkv_format, layout.packing
        if given:
            changes["params"] = dataclasses.replace(changes.get("params", self.params), **given)
        return dataclasses.replace(self, **changes)

    @property
    def qkv_layout(self) -> QKVLayout:
        return QKVLayout.from_format(self.params.qkv_format, self.packing)

    @property
    def gqa_group_size(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def bottom_right(self) -> bool:
        """The resolved diagonal alignment of windows and ALiBi (what the kernels' BOTTOM_RIGHT is), by this
        config's framework where ``params`` leave it open."""
        return resolve_bottom_right_diagonal(self.attn_mask_type, self.params.bottom_right_diagonal, self.framework)

    @property
    def window_kind(self) -> str:
        """'none', 'causal', 'sliding' — what a tile configuration may depend on."""
        return window_kind(self.attn_mask_type, self.window_size)

    @property
    def plan_key(self) -> PlanKey:
        """What launch plans read of this config (:class:`PlanKey`)."""
        return PlanKey.of(self, kv_page_size=self.params.kv_page_size or 0)

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
            f"dropout={self.dropout_probability} "
            f"softmax={self.softmax_type.value} "
            f"training={self.is_training} deterministic={self.deterministic} "
            f"device={self.device_type} arch={self.arch} framework={self.framework}"
        )


def _param_view(name: str) -> property:
    return property(lambda self: getattr(self.params, name), doc=f"``params.{name}``")


for _name in _PARAM_VIEWS:
    setattr(AttnConfig, _name, _param_view(_name))
del _name
