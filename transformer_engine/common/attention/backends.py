"""Attention backends as capability data, and selection: first backend with no reasons.

The registry of backends: each is a class that carries its identity (``NAME``, the ``SHORT_NAME``
that NVTE_FUSED_ATTN_BACKEND forces it by, the ``ENABLE_VAR`` that disables it) and what it
supports as class attributes. Capabilities are opt-in: a framework, device, dtype, qkv format,
mask type, bias type or softmax type a backend does not declare, and a feature (dropout, sliding
windows, GQA, d_qk != d_v, the max logit, a deterministic backward) it does not claim, is refused
with a reason. ``not_supported_reasons`` turns a config into those human-readable reasons (empty =
can run). Frontends subclass these classes to add their runner hook and the facts only they know
(``availability_reasons``); ``BACKENDS`` lists them all, ``backends_for`` those of one framework.

``select_backend`` applies the user's switches (NVTE_* variables, forcing), orders candidates with
:func:`policy.order_backends`, logs per NVTE_DEBUG, and returns the choice with every rejected
backend's reasons.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Type

from transformer_engine.common import settings
from transformer_engine.common.attention.config import AttnConfig
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.policy import order_backends
from transformer_engine.common.log import get_logger, warn_once

__all__ = [
    "AttentionBackend",
    "FusedAttention",
    "FlashAttention",
    "UnfusedDotProductAttention",
    "BACKENDS",
    "backends_for",
    "backend_named",
    "Selection",
    "select_backend",
    "NoBackendError",
]

_ALL_MASKS = frozenset(AttnMaskType)
_ALL_FORMATS = frozenset(QKVFormat)


class NoBackendError(NotImplementedError):
    """No backend can run the call, or the forced one cannot."""


class AttentionBackend:
    """Base class: capabilities as data (nothing is supported until declared), reasons derived from them."""

    NAME: str = "base"
    SHORT_NAME: str = "base"  # value of NVTE_FUSED_ATTN_BACKEND that forces this backend
    ENABLE_VAR: Optional[str] = None  # NVTE_* switch that disables it when 0
    PRIORITY: int = 0  # default order of trial (lower first); policy.order_backends may reorder
    FRAMEWORKS: frozenset = frozenset()
    DEVICE_TYPES: frozenset = frozenset()
    SUPPORTED_VENDORS: frozenset = frozenset()  # of "cuda" devices
    MIN_COMPUTE_CAPABILITY: Tuple[int, int] = (0, 0)  # NVIDIA
    SUPPORTED_ARCHS: Optional[frozenset] = None  # NVIDIA: exact major versions, when limited
    SUPPORTED_AMD_ARCHS: Optional[frozenset] = None  # AMD: gfx targets, when limited
    SUPPORTED_DTYPES: frozenset = frozenset()
    MAX_HEAD_DIM: int = 1 << 30
    HEAD_DIM_MULTIPLE: int = 1
    SUPPORTED_MASKS: frozenset = frozenset()
    SUPPORTED_FORMATS: frozenset = frozenset()
    SUPPORTED_BIAS_TYPES: frozenset = frozenset()
    SUPPORTED_SOFTMAX_TYPES: frozenset = frozenset()
    SUPPORTS_DROPOUT: bool = False
    SUPPORTS_WINDOW: bool = False
    SUPPORTS_GQA: bool = False
    SUPPORTS_DIFFERENT_HEAD_DIMS: bool = False  # d_qk != d_v
    SUPPORTS_MAX_LOGIT: bool = False  # returns each head's max logit (return_max_logit=True)
    IS_DETERMINISTIC: bool = False  # has a deterministic backward
    IS_FUSED: bool = True
    # Where this backend was measured faster than the fused kernels, as (GPU major, d_qk, d_v); None:
    # not a measured alternative (policy.order_backends keeps its PRIORITY).
    MEASURED_FASTER: Optional[frozenset] = None
    # The same for deterministic calls where that differs (None: MEASURED_FASTER holds for both modes).
    MEASURED_FASTER_DETERMINISTIC: Optional[frozenset] = None

    @classmethod
    def availability_reasons(cls, config: AttnConfig) -> List[str]:
        """Reasons the backend cannot run at all here (missing package, wrong device). Facts only a
        frontend knows come from its subclass's override (PyTorch: whether flash-attn-4 imports) or
        as ``config.extra`` (name, reason) pairs it computed when it built the config (JAX)."""
        return [reason for name, reason in config.extra if name == cls.NAME]

    @classmethod
    def not_supported_reasons(cls, config: AttnConfig) -> List[str]:
        reasons: List[str] = []
        if config.framework not in cls.FRAMEWORKS:
            reasons.append(f"framework={config.framework} (supported: {', '.join(sorted(cls.FRAMEWORKS))})")
        if config.device_type not in cls.DEVICE_TYPES:
            reasons.append(f"device={config.device_type} (supported: {', '.join(sorted(cls.DEVICE_TYPES))})")
        elif config.device_type == "cuda" and config.vendor not in cls.SUPPORTED_VENDORS:
            reasons.append(f"vendor={config.vendor} (supported: {', '.join(sorted(cls.SUPPORTED_VENDORS))})")
        elif config.device_type == "cuda" and config.vendor == "amd":
            if cls.SUPPORTED_AMD_ARCHS is not None and config.gfx_arch not in cls.SUPPORTED_AMD_ARCHS:
                reasons.append(f"gfx_arch={config.gfx_arch} (supported: {', '.join(sorted(cls.SUPPORTED_AMD_ARCHS))})")
        elif config.device_type == "cuda" and config.compute_capability is not None:
            if config.compute_capability < cls.MIN_COMPUTE_CAPABILITY:
                reasons.append(
                    f"compute capability {config.compute_capability} < {cls.MIN_COMPUTE_CAPABILITY}"
                )
            if cls.SUPPORTED_ARCHS is not None and config.compute_capability[0] not in cls.SUPPORTED_ARCHS:
                reasons.append(
                    f"compute capability {config.compute_capability} (supported majors: "
                    f"{', '.join(str(a) for a in sorted(cls.SUPPORTED_ARCHS))})"
                )
        if config.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(f"dtype={config.dtype} (supported: {', '.join(sorted(cls.SUPPORTED_DTYPES))})")
        for name, dim in (("head_dim_qk", config.head_dim_qk), ("head_dim_v", config.head_dim_v)):
            if dim > cls.MAX_HEAD_DIM:
                reasons.append(f"{name}={dim} > {cls.MAX_HEAD_DIM}")
            elif dim % cls.HEAD_DIM_MULTIPLE:
                reasons.append(f"{name}={dim} is not a multiple of {cls.HEAD_DIM_MULTIPLE}")
        if config.head_dim_qk != config.head_dim_v and not cls.SUPPORTS_DIFFERENT_HEAD_DIMS:
            reasons.append(f"head_dim_qk={config.head_dim_qk} != head_dim_v={config.head_dim_v}")
        if config.attn_mask_type not in cls.SUPPORTED_MASKS:
            reasons.append(f"attn_mask_type={config.attn_mask_type.value}")
        if config.qkv_format not in cls.SUPPORTED_FORMATS:
            reasons.append(f"qkv_format={config.qkv_format.value}")
        if config.attn_bias_type not in cls.SUPPORTED_BIAS_TYPES:
            reasons.append(f"attn_bias_type={config.attn_bias_type.value}")
        if config.has_dropout and not cls.SUPPORTS_DROPOUT:
            reasons.append(f"dropout={config.dropout_probability} (dropout not supported)")
        if config.softmax_type not in cls.SUPPORTED_SOFTMAX_TYPES:
            names = ", ".join(sorted(t.value for t in cls.SUPPORTED_SOFTMAX_TYPES))
            reasons.append(f"softmax_type={config.softmax_type.value} (supported: {names})")
        if config.window_kind == "sliding" and not cls.SUPPORTS_WINDOW:
            reasons.append(f"window_size={config.window_size} (sliding windows not supported)")
        if config.num_heads_q != config.num_heads_kv and not cls.SUPPORTS_GQA:
            reasons.append(f"num_heads_q={config.num_heads_q} != num_heads_kv={config.num_heads_kv} (no GQA)")
        if config.deterministic and config.is_training and not cls.IS_DETERMINISTIC:
            reasons.append("deterministic backward requested and this backend has none")
        if config.return_max_logit and not cls.SUPPORTS_MAX_LOGIT:
            # flash-attn-4 returns no max logit.
            reasons.append("return_max_logit=True (the kernels do not return the row maxima)")
        reasons.extend(cls.availability_reasons(config))
        return reasons


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


class FusedAttention(AttentionBackend):
    """The project's Triton kernels (transformer_engine.common.attention.kernels)."""

    NAME = "FusedAttention"
    SHORT_NAME = "fused"
    ENABLE_VAR = "NVTE_FUSED_ATTN"
    PRIORITY = 1
    FRAMEWORKS = frozenset({"pytorch", "jax"})
    DEVICE_TYPES = frozenset({"cuda", "cpu"})
    SUPPORTED_VENDORS = frozenset({"nvidia", "amd"})
    MIN_COMPUTE_CAPABILITY = (8, 0)
    # CDNA2/3/4, the AMD targets with plans (plan.AMD_ARCHS) and compiled for in CI
    # (tests/common/test_kernel_compile_archs.py).
    SUPPORTED_AMD_ARCHS = frozenset({"gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"})
    SUPPORTED_DTYPES = frozenset({"float16", "bfloat16", "float32"})
    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 8
    SUPPORTED_FORMATS = _ALL_FORMATS
    SUPPORTED_MASKS = _ALL_MASKS - {AttnMaskType.ARBITRARY_MASK}
    SUPPORTED_BIAS_TYPES = frozenset({AttnBiasType.NO_BIAS, AttnBiasType.POST_SCALE_BIAS, AttnBiasType.ALIBI})
    SUPPORTED_SOFTMAX_TYPES = frozenset(AttnSoftmaxType)
    SUPPORTS_DROPOUT = True
    SUPPORTS_WINDOW = True
    SUPPORTS_GQA = True
    SUPPORTS_DIFFERENT_HEAD_DIMS = True
    SUPPORTS_MAX_LOGIT = True  # the Triton forward writes row maxima (the plan keeps the Gluon forward off)
    IS_DETERMINISTIC = True

    @classmethod
    def availability_reasons(cls, config: AttnConfig) -> List[str]:
        reasons = super().availability_reasons(config)
        if config.attn_bias_type == AttnBiasType.POST_SCALE_BIAS and config.qkv_format == QKVFormat.THD:
            reasons.append("attn_bias_type=post_scale_bias with qkv_format=thd (bias needs a padded layout)")
        if not _triton_importable():
            return reasons + ["triton is not installed"]
        if config.device_type == "cpu" and not config.triton_interpret:
            reasons.append("device=cpu needs TRITON_INTERPRET=1 (the Triton interpreter) to run fused kernels")
        if config.device_type == "cpu" and config.triton_interpret and config.dtype == "bfloat16":
            reasons.append("dtype=bfloat16 under TRITON_INTERPRET=1 (Triton's interpreter computes bfloat16 tl.dot "
                           "wrongly: results far from the reference)")
        return reasons


class FlashAttention(AttentionBackend):
    """flash-attn-4 (CuTe DSL), Hopper and Blackwell: every fact about it that selection and ordering
    read is here, and how it takes TransformerEngine's window (:meth:`window_arguments`, which both
    frontends pass it). Whether the package runs on this device each frontend says: PyTorch in its
    subclass (``transformer_engine.pytorch.attention.backends``), JAX as ``config.extra`` reasons
    (``transformer_engine.jax.flash_backend``).

    Capabilities read from its ``flash_attn/cute/interface.py`` and tested on the GPU by
    tests/pytorch/test_flash_backend.py.
    """

    NAME = "FlashAttention"
    SHORT_NAME = "flash"
    ENABLE_VAR = "NVTE_FLASH_ATTN"
    PRIORITY = 0
    FRAMEWORKS = frozenset({"pytorch", "jax"})
    DEVICE_TYPES = frozenset({"cuda"})
    SUPPORTED_VENDORS = frozenset({"nvidia"})
    # GPU generations flash-attn-4 runs on: Hopper (SM90) and Blackwell (SM100).
    SUPPORTED_ARCHS = frozenset({9, 10})
    SUPPORTED_DTYPES = frozenset({"float16", "bfloat16"})
    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 8
    SUPPORTED_FORMATS = _ALL_FORMATS
    SUPPORTED_MASKS = _ALL_MASKS - {AttnMaskType.ARBITRARY_MASK}
    SUPPORTED_BIAS_TYPES = frozenset({AttnBiasType.NO_BIAS})
    SUPPORTS_DROPOUT = False
    SUPPORTS_WINDOW = True
    SUPPORTS_GQA = True
    SUPPORTS_DIFFERENT_HEAD_DIMS = True
    IS_DETERMINISTIC = True  # ordered dQ/dK/dV accumulation behind semaphores
    # (GPU major, head_dim_qk, head_dim_v) where it was measured faster than our kernels
    # (benchmarks/results/attention.md); elsewhere our kernels come first (policy.order_backends).
    MEASURED_FASTER = frozenset({(9, 64, 64), (9, 128, 128), (9, 192, 128), (9, 256, 256)})
    MEASURED_FASTER_DETERMINISTIC = frozenset({(9, 64, 64), (9, 128, 128), (9, 192, 128)})
    # flash-attn-4 has a forward-only sink argument; this wrapper passes none, so sink softmax
    # (off-by-one, learnable) goes to our kernels.
    SUPPORTED_SOFTMAX_TYPES = frozenset({AttnSoftmaxType.VANILLA_SOFTMAX})
    # Blackwell (SM10x) kernels: d_qk and d_v both <= 128, or one of these pairs (Hopper: any up to 256).
    SM100_HEAD_DIMS_BEYOND_128 = frozenset({(192, 128), (256, 256)})
    # Hopper (SM90) head dims (d_qk, d_v) whose backward matched the reference on the GPU
    # (tests/pytorch/test_flash_backend.py); other head dims go to our kernels until a GPU run shows them right.
    SM90_VERIFIED_HEAD_DIMS = frozenset({(64, 64), (128, 128), (192, 128), (256, 256)})
    # GPU generations where its deterministic mode passed our invariance tests on the GPU (same bits
    # for a sequence in any batch, packed or padded); elsewhere deterministic calls go to another backend.
    DETERMINISTIC_INVARIANT_ARCHS = frozenset({9})

    @staticmethod
    def window_arguments(attn_mask_type: AttnMaskType, window_size: Tuple[int, int]
                         ) -> Tuple[Optional[int], Optional[int]]:
        """TransformerEngine's normalized ``(left, right)`` window, -1 = unbounded, as flash-attn-4's
        ``(window_size_left, window_size_right)``, None = unbounded; a causal mask bounds the right side
        itself (flash-attn-4's ``causal=True``)."""
        left, right = (int(w) for w in window_size)
        return (left if left >= 0 else None, None if attn_mask_type.is_causal() or right < 0 else right)

    @classmethod
    def not_supported_reasons(cls, config: AttnConfig) -> List[str]:
        reasons = super().not_supported_reasons(config)
        major = config.compute_capability[0] if config.compute_capability is not None else None
        dims = (config.head_dim_qk, config.head_dim_v)
        if major == 9 and dims not in cls.SM90_VERIFIED_HEAD_DIMS:
            reasons.append(f"(head_dim_qk, head_dim_v)={dims} on sm90 is not verified against the reference "
                           f"(verified: {', '.join(str(d) for d in sorted(cls.SM90_VERIFIED_HEAD_DIMS))}; "
                           "d=72 gave a wrong dQ)")
        # Its Hopper backward takes GQA/MQA only with equal head dims (an assertion in flash-attn-4).
        if major == 9 and dims[0] != dims[1] and config.num_heads_kv != config.num_heads_q:
            reasons.append(f"GQA/MQA (num_heads_q={config.num_heads_q}, num_heads_kv={config.num_heads_kv}) with "
                           f"head_dim_qk != head_dim_v ({dims}) on sm90: flash-attn-4's Hopper backward needs "
                           "equal head dims for GQA")
        if major == 10 and max(dims) > 128 and dims not in cls.SM100_HEAD_DIMS_BEYOND_128:
            reasons.append(f"(head_dim_qk, head_dim_v)={dims} on sm10x (supported: both <= 128, "
                           f"{', '.join(str(d) for d in sorted(cls.SM100_HEAD_DIMS_BEYOND_128))})")
        # flash-attn-4 aligns causal masks bottom-right; top-left ones equal them only when s_kv >= s_q
        # (the wrapper then hides the keys no query can see).
        if config.attn_mask_type.is_top_left_causal() and config.max_seqlen_q > config.max_seqlen_kv:
            reasons.append(f"attn_mask_type={config.attn_mask_type.value} (top-left) with s_q={config.max_seqlen_q} "
                           f"> s_kv={config.max_seqlen_kv}: flash-attn-4 aligns causal masks bottom-right")
        # flash-attn-4 aligns sliding windows bottom-right; a top-left causal mask is made equal by hiding
        # the keys no query sees, other masks are not.
        if config.window_kind == "sliding" and not config.attn_mask_type.is_causal() and not config.bottom_right:
            reasons.append(f"window_size={config.window_size} aligned top-left (bottom_right_diagonal=False): "
                           "flash-attn-4 aligns sliding windows bottom-right")
        if config.deterministic and major is not None and major not in cls.DETERMINISTIC_INVARIANT_ARCHS:
            reasons.append(f"deterministic mode is not batch/packing invariant (not shown on sm{major}x)")
        if config.deterministic and config.distinct_kv_lengths and config.attn_mask_type.is_top_left_causal():
            # flash-attn-4 runs a top-left causal batch only if every sequence has at least as many keys as
            # queries: which backend runs would depend on the other sequences of the batch, and the same
            # sequence could get different bits in another batch.
            reasons.append(f"attn_mask_type={config.attn_mask_type.value} (top-left) with separate cu_seqlens_q/kv "
                           "in deterministic mode: the backend would depend on the batch's other sequences")
        return reasons


class UnfusedDotProductAttention(AttentionBackend):
    """Framework math (softmax(QK^T)V): every feature, always deterministic, slow."""

    NAME = "UnfusedDotProductAttention"
    SHORT_NAME = "unfused"
    ENABLE_VAR = "NVTE_UNFUSED_ATTN"
    PRIORITY = 2
    FRAMEWORKS = frozenset({"pytorch", "jax"})
    DEVICE_TYPES = frozenset({"cuda", "cpu"})
    SUPPORTED_VENDORS = frozenset({"nvidia", "amd"})
    SUPPORTED_DTYPES = frozenset({"float16", "bfloat16", "float32"})
    SUPPORTED_FORMATS = _ALL_FORMATS
    SUPPORTED_MASKS = _ALL_MASKS
    SUPPORTED_BIAS_TYPES = frozenset(AttnBiasType)
    SUPPORTED_SOFTMAX_TYPES = frozenset(AttnSoftmaxType)
    SUPPORTS_DROPOUT = True
    SUPPORTS_WINDOW = True
    SUPPORTS_GQA = True
    SUPPORTS_DIFFERENT_HEAD_DIMS = True
    SUPPORTS_MAX_LOGIT = True
    IS_DETERMINISTIC = True
    IS_FUSED = False


# The registry: every backend, in default priority order (PRIORITY).
BACKENDS: Tuple[Type[AttentionBackend], ...] = (FlashAttention, FusedAttention, UnfusedDotProductAttention)


def backends_for(framework: str) -> Tuple[Type[AttentionBackend], ...]:
    """The registered backends that declare ``framework`` ("pytorch" or "jax")."""
    return tuple(b for b in BACKENDS if framework in b.FRAMEWORKS)


def backend_named(short_name: str, candidates: Sequence[Type[AttentionBackend]] = BACKENDS
                  ) -> Type[AttentionBackend]:
    """The backend of ``candidates`` whose ``SHORT_NAME`` (or ``NAME``) is ``short_name``."""
    for backend in candidates:
        if short_name in (backend.SHORT_NAME, backend.NAME):
            return backend
    names = ", ".join(b.SHORT_NAME for b in candidates)
    raise ValueError(f"`backend` must be one of {names}, got {short_name!r}")


@dataclass
class Selection:
    """The chosen backend and why the others were not chosen."""

    backend: Type[AttentionBackend]
    rejected: Dict[str, List[str]] = field(default_factory=dict)
    # Whether selection warned of a deterministic training call falling back from the fused backends
    # (fallback_message), so that a frontend does not say it a second time.
    fallback_reported: bool = False

    @property
    def name(self) -> str:
        return self.backend.NAME


def fallback_message(chosen: str, fused_reasons: Dict[str, List[str]], deterministic: bool) -> str:
    """The one wording of "no fused backend runs this call": the backend used instead and each fused backend's
    reasons."""
    head = "Deterministic attention requested; no" if deterministic else "No"
    return (f"{head} fused backend supports this call, using {chosen}. Reasons: "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in fused_reasons.items()))


def _disabled_reason(backend: Type[AttentionBackend]) -> Optional[str]:
    if backend.ENABLE_VAR is not None and not settings.get(backend.ENABLE_VAR):
        return f"disabled by {backend.ENABLE_VAR}=0"
    return None


def _format_reasons(rejected: Dict[str, List[str]]) -> str:
    return "\n".join(f"  `{name}` is not supported because:\n    " + "\n    ".join(r) for name, r in rejected.items())


def select_backend(
    config: AttnConfig,
    candidates: Sequence[Type[AttentionBackend]],
    force: Optional[str] = None,
) -> Selection:
    """Pick the first backend (in policy order) that can run ``config``.

    ``force`` (or NVTE_FUSED_ATTN_BACKEND) names one backend by ``SHORT_NAME``: that backend or
    a :class:`NoBackendError` with its reasons, never a silent fallback.
    """
    logger = get_logger()
    if logger.isEnabledFor(logging.INFO):  # describe() is a string built on every call otherwise
        logger.info("Running with config: %s", config.describe())
    forced = force if force is not None else settings.get("NVTE_FUSED_ATTN_BACKEND")
    rejected: Dict[str, List[str]] = {}
    if forced:
        matches = [b for b in candidates if b.SHORT_NAME == forced]
        if not matches:
            names = ", ".join(b.SHORT_NAME for b in candidates)
            raise NoBackendError(f"backend {forced!r} was forced but is not offered here (offered: {names})")
        backend = matches[0]
        reasons = backend.not_supported_reasons(config)
        if reasons:
            raise NoBackendError(
                f"attention backend `{backend.NAME}` was forced (NVTE_FUSED_ATTN_BACKEND={forced!r}) but cannot run "
                f"this call:\n  {config.describe()}\n" + _format_reasons({backend.NAME: reasons})
            )
        logger.info("Selected backend = %s (forced)", backend.NAME)
        return Selection(backend, rejected)

    chosen = None
    for backend in order_backends(list(candidates), config):
        disabled = _disabled_reason(backend)
        reasons = [disabled] if disabled else backend.not_supported_reasons(config)
        if reasons:
            rejected[backend.NAME] = reasons
            logger.debug("Disabling %s: %s", backend.NAME, "; ".join(reasons))
            continue
        chosen = backend
        break
    if chosen is None:
        raise NoBackendError(
            f"no attention backend can run this call:\n  {config.describe()}\n" + _format_reasons(rejected)
        )
    if config.deterministic and config.is_training and not chosen.IS_FUSED:
        by_name = {b.NAME: b for b in candidates}
        fused_reasons = {
            name: r
            for name, r in rejected.items()
            if not any(reason.startswith("disabled by") for reason in r) and by_name[name].IS_FUSED
        }
        if fused_reasons:
            warn_once(f"det-fallback:{config.describe()}", fallback_message(chosen.NAME, fused_reasons, True))
            logger.info("Selected backend = %s", chosen.NAME)
            return Selection(chosen, rejected, fallback_reported=True)
    logger.info("Selected backend = %s", chosen.NAME)
    return Selection(chosen, rejected)
