"""DotProductAttention: TransformerEngine's attention module on the project's backends.

A call's argument checks build one :class:`AttnConfig` (determinism read now: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``
or ``torch.use_deterministic_algorithms(True)``), ask backend selection for a backend (``NVTE_FUSED_ATTN``,
``NVTE_UNFUSED_ATTN``, ``NVTE_FUSED_ATTN_BACKEND``, ``NVTE_DEBUG`` are read then too) and run it.

What the checks and selection decide is a function of the call's signature (``signature_cache``): the
module's settings, the call's non-tensor arguments, each tensor's shape, strides, dtype, device and
alignment, the determinism request and the raw values of the environment variables they read, all read at
every call. A signature seen before reuses that decision (:class:`_PreparedCall`); the rest (the tensors,
their values' checks below the module, the launches) runs per call. Calls whose decisions read tensor values
(an ``attention_mask``; thd without ``max_seqlen_*``), KV-cache steps, packed ``qkv_layer``/``kv_layer``
inputs, context parallelism, tracing, and calls while the ``transformer_engine`` logger logs INFO (the
per-call "Selected backend" line) always take the full path.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple, Union

import torch

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.validation import check_softmax_scale
from transformer_engine.common.quantizer_roles import Scaling
from transformer_engine.pytorch.attention import backends as attn_backends
from transformer_engine.pytorch.attention import config as attn_config
from transformer_engine.pytorch.attention.backends import AttnCall
from transformer_engine.pytorch.attention.inference import InferenceParams, active_step_runner, cached_attention
from transformer_engine.pytorch.attention.signature_cache import (
    SignatureCache, environment_signature, tensor_signature,
)
from transformer_engine.pytorch.attention.unfused import bias_shape_name

__all__ = ["DotProductAttention"]

_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)

# Under thd every mask is per sequence: TransformerEngine's non-padding names map to their padding form.
_THD_MASK = {
    AttnMaskType.NO_MASK: AttnMaskType.PADDING_MASK,
    AttnMaskType.CAUSAL_MASK: AttnMaskType.PADDING_CAUSAL_MASK,
    AttnMaskType.CAUSAL_BOTTOM_RIGHT_MASK: AttnMaskType.PADDING_CAUSAL_BOTTOM_RIGHT_MASK,
}
# A padding mask with no padding information (no attention_mask, no cu_seqlens) is its non-padding form.
_UNPADDED_MASK = {v: k for k, v in _THD_MASK.items()}


def _mask_arg(value, name: str = "attn_mask_type") -> AttnMaskType:
    """An AttnMaskType from TransformerEngine's spellings ('padding,causal', 'causal_padding', ...)."""
    if isinstance(value, str):
        value = value.replace(",", "_")
        if value == "causal_padding":
            value = "padding_causal"
    return _enum_arg(AttnMaskType, value, name)


def _enum_arg(enum, value, name: str):
    try:
        return enum(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}") from None


def _run(step_run, backend, q, k, v, call):
    """``backend.run(q, k, v, call)``, or inside a KV-cache step as the step runs it (``step_run``: the runner
    of :func:`inference.step_runner` that forward read, :func:`_step_runner`)."""
    if step_run is None:
        return backend.run(q, k, v, call)
    return step_run.run(backend, q, k, v, call)


def _step_runner():
    """The KV-cache step's runner this call runs its backend with (:func:`inference.step_runner`), read before
    the backend runs (a checkpointed call's recomputation in the backward reuses it); none while tracing (a
    traced step runs its call as built)."""
    return None if _is_compiling() else active_step_runner()


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


@dataclass(frozen=True)
class _PreparedCall:
    """What DotProductAttention decided for one call signature: the backend, the call's parameters, and
    which of the four cu_seqlens arguments the call carries to the backend (bshd/sbhd without a padding
    mask carry none, and never the padded ones)."""

    backend: Any
    params: AttnParams
    carried_seqlens: Tuple[bool, bool, bool, bool]


_PREPARED_CALLS = SignatureCache("DotProductAttention")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_LOGGER = logging.getLogger("transformer_engine")


def _window_signature(window) -> Optional[tuple]:
    """A window argument as a key: the values and their types (True, 1 and 1.0 are equal keys, but the checks
    tell them apart), and the container's type. Raises TypeError for what is not a sequence (the caller then
    takes the full path, whose checks name the argument)."""
    if window is None:
        return None
    values = tuple(window)
    return (type(window), values, tuple(map(type, values)))


class _TensorMeta:
    """Shape/dtype/device stand-in for a tensor, so a config can be built while tracing."""

    def __init__(self, shape: Tuple[int, ...], dtype: str, device: str) -> None:
        self.shape = torch.Size(shape)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)

    def dim(self) -> int:
        return len(self.shape)


@torch.compiler.assume_constant_result
def _deterministic_while_tracing(torch_deterministic: bool) -> bool:
    """The determinism request under torch.compile, read once while tracing. Dynamo guards on
    ``torch.are_deterministic_algorithms_enabled()`` (passed in), so toggling it retraces; NVTE_* variables are
    read at trace time."""
    return torch_deterministic or attn_config.deterministic_requested()


@torch.compiler.assume_constant_result
def _select_while_tracing(q_shape, k_shape, v_shape, dtype: str, device: str, qkv_format: str, attn_mask_type: str,
                          window: Tuple[int, int], bias_type: str, bias_shape: Optional[str], dropout: float,
                          is_training: bool, deterministic: bool, distinct_kv_lengths: bool,
                          bottom_right_diagonal: bool, return_max_logit: bool, softmax_type: str) -> str:
    """Backend selection under torch.compile: runs once while tracing, its result baked into the graph.

    Takes the call's parameters as constants (enum values; ``window`` normalized) and rebuilds the ones selection
    reads (the softmax scale, which no backend decides by, is left at 1). Sizes that may be dynamic are passed as
    -1.
    """
    metas = [_TensorMeta(s, dtype, device) for s in (q_shape, k_shape, v_shape)]
    params = AttnParams(
        attn_mask_type=AttnMaskType(attn_mask_type), attn_bias_type=AttnBiasType(bias_type),
        qkv_format=QKVFormat(qkv_format), window_size=window, scaling_factor=1.0, dropout_probability=dropout,
        is_training=is_training, deterministic=deterministic, bottom_right_diagonal=bottom_right_diagonal,
        softmax_type=AttnSoftmaxType(softmax_type), return_max_logit=return_max_logit)
    config = attn_config.build_attn_config(*metas, params, bias_shape=bias_shape,
                                           distinct_kv_lengths=distinct_kv_lengths)
    return attn_backends.select(config).name


def _packing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """'qkv' when q, k, v are views of one buffer, 'kv' when k and v are, else 'separate'."""
    def base(t):
        return t.untyped_storage().data_ptr()
    if base(k) == base(v):
        return "qkv" if base(q) == base(k) else "kv"
    return "separate"


def _padding_mask_to_cu_seqlens(mask: torch.Tensor, batch: int, seqlen: int, name: str) -> torch.Tensor:
    """TransformerEngine padding mask ([b, 1, 1, s] or [b, s], True = padded) -> int32 cu_seqlens [b+1].

    Padding must be at the end of each sequence (checked in eager mode; one host sync).
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"`{name}` must be a bool tensor (True = padded out), got {got}")
    if tuple(mask.shape) not in ((batch, 1, 1, seqlen), (batch, seqlen)):
        raise ValueError(f"`{name}` must have shape [{batch}, 1, 1, {seqlen}] for a padding mask, got {tuple(mask.shape)}")
    mask = mask.reshape(batch, seqlen)
    lengths = (~mask).sum(dim=1, dtype=torch.int32)
    if not _is_compiling():
        right_padded = torch.arange(seqlen, device=mask.device)[None, :] >= lengths[:, None]
        if not torch.equal(right_padded, mask):
            raise ValueError(
                f"`{name}` must mark padding at the end of each sequence (True after the real tokens); "
                "pass cu_seqlens_q/cu_seqlens_kv for other layouts"
            )
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpack_packed(qkv_layer, kv_layer, query_layer, key_layer, value_layer, fmt: QKVFormat, interleave_dim: int):
    """(q, k, v) from TransformerEngine's declared packed inputs: views of ``qkv_layer`` (the 3 at
    ``interleave_dim``) or of ``kv_layer`` (the 2) next to ``query_layer``; else the three tensors."""
    if qkv_layer is None and kv_layer is None:
        if query_layer is None or key_layer is None or value_layer is None:
            raise ValueError("`query_layer`, `key_layer` and `value_layer` must be given unless a packed "
                             "`qkv_layer` (or `query_layer` with `kv_layer`) is")
        return query_layer, key_layer, value_layer
    if qkv_layer is not None and kv_layer is not None:
        raise ValueError("give either `qkv_layer` or `kv_layer`, not both")
    if interleave_dim not in (-3, -2):
        raise ValueError(f"`qkv_interleave_dim` must be -3 (e.g. bs3hd) or -2 (e.g. bsh3d), got {interleave_dim!r}")
    packed = qkv_layer if qkv_layer is not None else kv_layer
    name = "qkv_layer" if qkv_layer is not None else "kv_layer"
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"`{name}` must be a torch.Tensor, got {type(packed).__name__}")
    if qkv_layer is not None and any(t is not None for t in (query_layer, key_layer, value_layer)):
        raise ValueError("`query_layer`, `key_layer` and `value_layer` must be None when `qkv_layer` is given")
    if kv_layer is not None:
        if query_layer is None:
            raise ValueError("`query_layer` must be given with `kv_layer` (which packs only K and V)")
        if key_layer is not None or value_layer is not None:
            raise ValueError("`key_layer` and `value_layer` must be None when `kv_layer` is given")
    rank = 4 if fmt == QKVFormat.THD else 5
    count = 3 if qkv_layer is not None else 2
    if packed.dim() != rank or packed.shape[interleave_dim] != count:
        raise ValueError(f"`{name}` must be {rank}-D for qkv_format={fmt.value!r} with size {count} at dim "
                         f"{interleave_dim} (qkv_interleave_dim), got shape {tuple(packed.shape)}")
    views = tuple(packed.select(interleave_dim, i) for i in range(count))
    return views if qkv_layer is not None else (query_layer, *views)


@dataclass
class _Sequences:
    """Where the sequences are: the effective mask type, cu_seqlens and max lengths of one call."""

    mask: AttnMaskType
    batch: Optional[int]
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    attention_mask: Optional[torch.Tensor] = None  # the 'arbitrary' mask; padding masks become cu_seqlens

    @property
    def distinct_kv_lengths(self) -> bool:
        """Per-sequence lengths with a cu_seqlens_kv of its own (cross attention)."""
        return self.cu_seqlens_q is not None and self.cu_seqlens_kv is not self.cu_seqlens_q


def _split_padding_mask(attention_mask, seq_len_q: int, seq_len_kv: int):
    """(q mask, kv mask) of a padding ``attention_mask``: one tensor (self attention, s_q == s_kv) or a pair."""
    if isinstance(attention_mask, (tuple, list)):
        if len(attention_mask) != 2:
            raise ValueError("`attention_mask` must be one tensor or a (q_mask, kv_mask) pair, got "
                             f"{len(attention_mask)} tensors")
        return tuple(attention_mask)
    if seq_len_q != seq_len_kv:
        raise ValueError(
            f"`attention_mask` must be a (q_mask, kv_mask) pair when s_q != s_kv ({seq_len_q} != {seq_len_kv})"
        )
    return attention_mask, attention_mask


def _agree(name: str, cu_seqlens: torch.Tensor, mask: torch.Tensor, batch: int, seqlen: int) -> None:
    """A padding mask given next to ``cu_seqlens``: the cu_seqlens are used (as TransformerEngine's fused
    path uses them); a mask that describes other sequences is a contradiction (checked in eager mode)."""
    from_mask = _padding_mask_to_cu_seqlens(mask, batch, seqlen, "attention_mask")
    if _is_compiling() or not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != from_mask.shape:
        return  # shapes are checked with the other cu_seqlens checks
    if not torch.equal(from_mask, cu_seqlens.to(from_mask.device)):
        raise ValueError(
            f"`attention_mask` and `{name}` must describe the same sequences when both are given, got lengths "
            f"{torch.diff(from_mask).tolist()} from the mask and {torch.diff(cu_seqlens).tolist()} from `{name}`"
        )


def _fp8_scaling(recipe) -> Scaling:
    """The scaling kind FP8 attention runs under ``recipe`` (fp8_attention.attention_scaling)."""
    from transformer_engine.pytorch.attention.fp8_attention import attention_scaling

    return attention_scaling(recipe)


def _fp8_attention_recipe():
    """The autocast's recipe when it asks for FP8 attention (fp8_dpa or fp8_mha), else None."""
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    if getattr(recipe, "fp8_mha", False):
        raise NotImplementedError("`fp8_mha=True` (FP8 attention inputs and output) is not supported yet; use "
                                  "fp8_dpa=True (FP8 attention on bf16/fp16 inputs and output)")
    return recipe if getattr(recipe, "fp8_dpa", False) else None


def _resolve_sequences(q, k, v, fmt: QKVFormat, mask: AttnMaskType, attention_mask, cu_seqlens_q, cu_seqlens_kv,
                       cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv) -> _Sequences:
    """Validate the sequence arguments; padding masks become cu_seqlens (what the fused path takes).

    As in TransformerEngine, given ``cu_seqlens_q``/``cu_seqlens_kv`` win over a padding ``attention_mask``
    (which fills in a side whose cu_seqlens are missing); with qkv_format='thd' a padding mask may
    accompany the cu_seqlens ([b, 1, 1, s] over the padded view of the batch). Either way the mask must
    agree with the cu_seqlens. Mask types other than padding and 'arbitrary' ignore ``attention_mask``."""
    if fmt == QKVFormat.THD:
        if mask == AttnMaskType.ARBITRARY_MASK:
            raise NotImplementedError("attn_mask_type='arbitrary' with qkv_format='thd' is not supported")
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format='thd'")
        batch = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else None
        # As in TransformerEngine, the declared mask type decides: only a padding type reads attention_mask.
        if attention_mask is not None and batch is not None and mask.is_padding():
            masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask, attention_mask)
            if len(masks) != 2:
                raise ValueError("`attention_mask` must be one tensor or a (q_mask, kv_mask) pair")
            for name, cu, m in (("cu_seqlens_q", cu_seqlens_q, masks[0]), ("cu_seqlens_kv", cu_seqlens_kv, masks[1])):
                if not isinstance(m, torch.Tensor) or m.dim() not in (2, 4):
                    got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                    raise ValueError(f"`attention_mask` must be a padding mask [b, 1, 1, s] with qkv_format='thd', "
                                     f"got {got}")
                _agree(name, cu, m, batch, m.shape[-1])
        seqs = _Sequences(_THD_MASK.get(mask, mask), batch, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                          cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
    else:
        batch, seq_len_q, _, _ = attn_config.qkv_dims(q, fmt)
        batch_k, seq_len_kv, _, _ = attn_config.qkv_dims(k, fmt)
        batch_v, seq_len_v, _, _ = attn_config.qkv_dims(v, fmt)
        if batch_k != batch or batch_v != batch:
            raise ValueError(
                f"`query_layer`, `key_layer`, `value_layer` must share the batch size, got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if seq_len_kv != seq_len_v:
            raise ValueError(
                f"`key_layer` and `value_layer` must have the same sequence length, got shapes "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            )
        seqs = _Sequences(mask, batch, max_seqlen_q=seq_len_q, max_seqlen_kv=seq_len_kv)
        if mask.is_padding():
            if attention_mask is not None:
                mask_q, mask_kv = _split_padding_mask(attention_mask, seq_len_q, seq_len_kv)
                if cu_seqlens_q is None:
                    cu_seqlens_q = _padding_mask_to_cu_seqlens(mask_q, batch, seq_len_q, "attention_mask")
                else:
                    _agree("cu_seqlens_q", cu_seqlens_q, mask_q, batch, seq_len_q)
                if cu_seqlens_kv is None:
                    cu_seqlens_kv = (cu_seqlens_q if mask_kv is mask_q and seq_len_q == seq_len_kv
                                     else _padding_mask_to_cu_seqlens(mask_kv, batch, seq_len_kv, "attention_mask"))
                else:
                    _agree("cu_seqlens_kv", cu_seqlens_kv, mask_kv, batch, seq_len_kv)
            elif cu_seqlens_q is None and cu_seqlens_kv is None:
                seqs.mask = _UNPADDED_MASK[mask]  # no padding information: nothing is padded
            elif cu_seqlens_q is None or cu_seqlens_kv is None:
                raise ValueError(
                    f"`cu_seqlens_q` and `cu_seqlens_kv` must be given together for attn_mask_type={mask.value!r}"
                )
            seqs.cu_seqlens_q, seqs.cu_seqlens_kv = cu_seqlens_q, cu_seqlens_kv
        elif mask == AttnMaskType.ARBITRARY_MASK:
            if attention_mask is None:
                raise ValueError("`attention_mask` must be given for attn_mask_type='arbitrary'")
            seqs.attention_mask = attention_mask
        # Other mask types ignore attention_mask, as TransformerEngine does: the mask type alone decides
        # (Megatron passes its dataset's [b, 1, s, s] causal mask along with attn_mask_type='causal').
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        attn_config.check_cu_seqlens(name, getattr(seqs, name), seqs.batch, q.device)
    if fmt == QKVFormat.THD and not _is_compiling():
        # One host sync when the caller did not pass max_seqlen (pass it to avoid the sync).
        if seqs.max_seqlen_q is None:
            seqs.max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        if seqs.max_seqlen_kv is None:
            seqs.max_seqlen_kv = int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max().item())
    return seqs


def _check_bias(q, seqs: _Sequences, bias_type: AttnBiasType, bias: Optional[torch.Tensor],
                alibi_slopes: Optional[torch.Tensor]) -> Optional[str]:
    """Validate the bias arguments; returns the bias shape name ('1hss', ...) or None."""
    heads = q.shape[-2]
    if alibi_slopes is not None:
        if bias_type != AttnBiasType.ALIBI:
            raise ValueError(f"`alibi_slopes` needs core_attention_bias_type='alibi', got {bias_type.value!r}")
        if tuple(alibi_slopes.shape) not in ((heads,), (seqs.batch, heads)):
            raise ValueError(
                f"`alibi_slopes` must have shape [{heads}] or [{seqs.batch}, {heads}], got {tuple(alibi_slopes.shape)}"
            )
    if bias_type not in (AttnBiasType.PRE_SCALE_BIAS, AttnBiasType.POST_SCALE_BIAS):
        if bias is not None:
            raise ValueError(f"`core_attention_bias` must be None with core_attention_bias_type={bias_type.value!r}")
        return None
    if bias is None:
        raise ValueError(f"`core_attention_bias` must be given for core_attention_bias_type={bias_type.value!r}")
    if seqs.max_seqlen_q is None or seqs.max_seqlen_kv is None:
        raise ValueError("`max_seqlen_q` and `max_seqlen_kv` must be given with a bias under torch.compile")
    return bias_shape_name(bias, seqs.batch, heads, seqs.max_seqlen_q, seqs.max_seqlen_kv)


class DotProductAttention(torch.nn.Module):
    """Scaled dot-product attention with TransformerEngine's interface.

    Shapes: ``qkv_format="bshd"`` [b, s, h, d], ``"sbhd"`` [s, b, h, d], ``"thd"`` [t, h, d] (all
    sequences packed, delimited by ``cu_seqlens_*``, int32 [b+1]; ``cu_seqlens_*_padded`` give the
    packed starts when there are gaps). q, k, v may be strided views (e.g. into a packed QKV
    projection). The output has q's format with the heads flattened: [b, s, h*d_v], [s, b, h*d_v]
    or [t, h*d_v].

    Heads: ``num_attention_heads`` query heads share ``num_gqa_groups`` key/value heads; query head
    ``i`` uses key/value head ``i // (num_attention_heads // num_gqa_groups)``.

    Masks (``attn_mask_type``): ``no_mask``, ``causal`` (top-left), ``causal_bottom_right``,
    ``padding``, ``padding_causal``, ``padding_causal_bottom_right``, ``arbitrary``. Padding comes
    from ``cu_seqlens_q/kv`` or a bool ``attention_mask`` (True = padded; [b, 1, 1, s], or a tuple
    of q and kv masks for cross attention; padding at the end of each sequence). ``arbitrary``
    takes a bool ``attention_mask`` broadcastable to [b, h, s_q, s_kv]. Given ``cu_seqlens_q/kv`` win
    over a padding ``attention_mask`` (which must agree with them; it may accompany thd too). As in
    TransformerEngine, the mask type decides: the other types (``no_mask``, the causal ones) ignore
    ``attention_mask``, whatever it holds.
    ``window_size=(left, right)`` follows :func:`normalize_window`. Rows with no visible key output
    zeros; padded positions are zero.

    Diagonal (``bottom_right_diagonal``, constructor or forward): sliding windows and ALiBi align
    with the top-left (False, ``d = 0``) or bottom-right (True, ``d = s_kv - s_q`` per sequence)
    corner of the score matrix. ``causal``/``padding_causal`` force top-left and the
    ``*_bottom_right`` masks bottom-right whatever is passed; None is bottom-right for the other masks.

    Bias (``core_attention_bias``): [1|b, 1|h, s_q, s_kv] or [1, 1, 1, s_kv] (TransformerEngine's
    1hss, b1ss, bhss, 11ss, 111s), with a gradient summed over its broadcast dimensions.

    ``return_max_logit=True``: ``forward`` returns ``(out, max_logit)``, ``max_logit`` [h] in q's
    dtype: the largest ``softmax_scale * q k^T + bias`` over the visible (query, key) pairs of each
    head in the batch (for QK-clip). The fused backend computes it in its forward kernel (each row's max,
    which the kernel has anyway, then a max over rows: order-free, so deterministic); flash-attn-4 does not,
    and context parallelism refuses it. On Hopper such calls take the Triton forward, not the
    warp-specialized one (``explain_plan`` says so).

    Determinism: ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` or ``torch.use_deterministic_algorithms(True)``
    make the next call's backward bitwise reproducible (read at every call, not at construction).
    The fused backend stays selected in deterministic training; a config no deterministic fused
    kernel supports runs unfused, with a one-time WARNING naming why. Under ``torch.compile`` the
    backend is chosen while tracing (dynamo retraces when ``torch.use_deterministic_algorithms``
    changes; NVTE_* changes need a recompile).

    Softmax (``softmax_type``): ``"vanilla"``; ``"off-by-one"``, ``softmax(S)_j = exp(S_j) / (1 + sum_k
    exp(S_k))``; ``"learnable"``, ``exp(S_j) / (exp(softmax_offset[h]) + sum_k exp(S_k))`` with the
    module's parameter ``softmax_offset`` (fp32 ``[num_attention_heads // tp_size]``, zeros at
    construction), added to the scaled (and biased) scores as it is. With ``"off-by-one"``,
    ``softmax_offset`` is that shape's fp32 zero tensor as a plain attribute (as in TransformerEngine:
    no parameter, no buffer); set its ``requires_grad`` to get the sink logit's gradient in its ``.grad``.
    This extra "sink" logit has no value vector: it takes probability from the keys (a row that sees no
    key outputs zeros), and dropout applies to the keys' probabilities. Sink softmax runs fused (our Triton kernels, also in
    deterministic mode, where ``softmax_offset``'s gradient is summed over the batch in a fixed order:
    each sequence's part in any batch is bitwise the same) or unfused; flash-attn-4 is not used for it.

    Context parallelism (``cp_group``, ``cp_global_ranks``, ``cp_stream``, ``cp_comm_type``, or
    :meth:`set_context_parallel_group`): each rank passes its part of the sequence in TransformerEngine's
    load-balanced split; outputs and gradients are bitwise independent of the CP size in deterministic
    mode (docs: context_parallelism.rst).

    KV cache (``inference_params``, an :class:`~transformer_engine.pytorch.attention.inference.InferenceParams`,
    with ``layer_number`` set): the call's q, k, v are a generation step's new tokens (``pre_step``'s counts: bshd
    or sbhd with each sequence's tokens first in its row, or thd packed in step order); k and v are appended to
    the layer's cache and the queries attend to their sequences' cached keys, causal masks aligned bottom-right.
    Each output row is bitwise the training forward's row for the same token (inference.py and
    docs/kv_cache.rst say when); rows past a sequence's new tokens are zero.

    FP8: inside ``autocast`` with a recipe's ``fp8_dpa=True`` (DelayedScaling or Float8CurrentScaling) the
    attention runs on FP8 operands in the same kernels, with a deterministic backward (docs/fp8_attention.rst);
    FP8 tensors as inputs (``fp8_mha``) are refused. The attribute ``fp8_dpa_scaling`` (ours, not a
    constructor argument: the constructor keeps TransformerEngine's signature; None, the default, reads
    ``NVTE_FP8_DPA_SCALING``) picks the scales: ``"per_tensor"`` (TransformerEngine's, when both are unset) or
    ``"per_sequence"`` (Float8CurrentScaling only: one current scale per sequence and kv head, so a sequence's
    bits do not depend on its batch or packing).
    Under DelayedScaling the module's amax histories and scales are its extra state in the state dict.

    Not supported yet (``NotImplementedError``): FP8 input tensors, ``bf16_backward``, ``num_splits`` other than
    1, ``score_mod*``.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        tp_group: Optional[Any] = None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        cp_group: Optional[Any] = None,
        cp_global_ranks: Optional[Any] = None,
        cp_stream: Optional[Any] = None,
        cp_comm_type: str = "p2p",
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: Optional[bool] = False,
        name: Optional[str] = None,
    ) -> None:
        super().__init__()
        softmax_type = _enum_arg(AttnSoftmaxType, softmax_type, "softmax_type")
        if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
            raise ValueError(f"`num_attention_heads` must be a positive int, got {num_attention_heads!r}")
        if isinstance(kv_channels, int):
            kv_channels = (kv_channels, kv_channels)
        if (not isinstance(kv_channels, (tuple, list)) or len(kv_channels) != 2
                or not all(isinstance(c, int) and c > 0 for c in kv_channels)):
            raise ValueError(f"`kv_channels` must be a positive int or a pair (qk, v) of them, got {kv_channels!r}")
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if not isinstance(num_gqa_groups, int) or num_gqa_groups < 1 or num_attention_heads % num_gqa_groups:
            raise ValueError(
                f"`num_gqa_groups` must be a positive divisor of num_attention_heads={num_attention_heads}, "
                f"got {num_gqa_groups!r}"
            )
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)
        if not isinstance(tp_size, int) or tp_size < 1 or num_attention_heads % tp_size or num_gqa_groups % tp_size:
            raise ValueError(
                f"`tp_size` must divide num_attention_heads={num_attention_heads} and num_gqa_groups="
                f"{num_gqa_groups}, got {tp_size!r}"
            )
        if not 0.0 <= float(attention_dropout) < 1.0:
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {attention_dropout!r}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"`attention_type` must be 'self' or 'cross', got {attention_type!r}")
        self.qkv_format = _enum_arg(QKVFormat, qkv_format, "qkv_format").value
        self.attn_mask_type = _mask_arg(attn_mask_type).value
        normalize_window(window_size, AttnMaskType(self.attn_mask_type))  # validate now, apply per call
        self.window_size = window_size
        if bottom_right_diagonal is not None and not isinstance(bottom_right_diagonal, bool):
            raise ValueError(f"`bottom_right_diagonal` must be None or a bool, got {bottom_right_diagonal!r}")
        self.bottom_right_diagonal = bottom_right_diagonal
        if not isinstance(return_max_logit, bool) and return_max_logit is not None:
            raise ValueError(f"`return_max_logit` must be a bool, got {return_max_logit!r}")
        self.return_max_logit = bool(return_max_logit)
        self.name = name
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.tp_size = tp_size
        self.num_heads_per_partition = num_attention_heads // tp_size
        self.num_gqa_groups_per_partition = num_gqa_groups // tp_size
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = kv_channels
        self.kv_channels = tuple(kv_channels)
        self.attention_dropout = float(attention_dropout)
        self.sequence_parallel = sequence_parallel
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_group = tp_group
        self.layer_number = layer_number
        self.attention_type = attention_type
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.softmax_type = softmax_type.value
        # One sink logit per local query head, fp32 zeros at start, as TransformerEngine keeps them: a
        # parameter for "learnable"; for "off-by-one" a plain tensor attribute (neither parameter nor
        # buffer: not trained, not saved, not moved by .to()) whose gradient is reported when the caller
        # sets its requires_grad.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if softmax_type.is_learnable:
            self.softmax_offset = torch.nn.Parameter(
                torch.zeros(self.num_heads_per_partition, dtype=torch.float32, device=device))
        elif softmax_type.has_sink:
            self.softmax_offset = torch.zeros(self.num_heads_per_partition, dtype=torch.float32, device=device)
        else:
            self.softmax_offset = None
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels[0])
        # Name of the backend that ran the most recent call: a record for reporting, never consulted.
        self.last_backend: Optional[str] = None
        # FP8 attention's scales (class docstring; fp8_attention.FP8_DPA_SCALINGS); None: NVTE_FP8_DPA_SCALING.
        self.fp8_dpa_scaling: Optional[str] = None

    def get_extra_state(self) -> torch.Tensor:
        """The FP8 attention's delayed-scaling state as the state dict's ``_extra_state`` entry (a CPU uint8
        tensor; empty when FP8 attention never ran under DelayedScaling). Layout: ``module/_extra_state.py``,
        one "GEMM" of fp8_attention.FWD_SLOTS / BWD_SLOTS."""
        from transformer_engine.pytorch.module import _extra_state

        return _extra_state.save([self.__dict__.get("_fp8_attention_state")])

    def set_extra_state(self, state) -> None:
        """Load the state ``get_extra_state`` saved (None or an empty tensor: nothing to load); the next FP8
        call moves it to its tensors' device."""
        from transformer_engine.pytorch.attention.fp8_attention import BWD_SLOTS, FWD_SLOTS, Fp8AttentionState
        from transformer_engine.pytorch.module import _extra_state

        _extra_state.load(self, state, ["_fp8_attention_state"], torch.device("cpu"),
                          widths=(len(FWD_SLOTS), len(BWD_SLOTS)), state_cls=Fp8AttentionState)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type: str = "p2p",
                                   cp_stripe_size: Optional[int] = None) -> None:
        """Context parallelism for the next calls (TransformerEngine's method): ``cp_group`` a process group
        (a list ``[a2a_group, p2p_group]`` for ``cp_comm_type="a2a+p2p"``), or None to turn it off;
        ``cp_comm_type`` one of "p2p", "all_gather", "a2a", "a2a+p2p". ``cp_stream`` is accepted for
        compatibility (the exchanges run on the current stream). ``cp_stripe_size`` (ours; TransformerEngine's
        PyTorch has only the dual-chunk order): None, each rank passes its chunks of TransformerEngine's
        dual-chunk order; an int, its stripes of the Striped order (stripes of that many tokens dealt
        round-robin to the ranks; thd: over the packed row), as TransformerEngine-JAX's
        ``ReorderStrategy.Striped`` (docs: context_parallelism.rst)."""
        from transformer_engine.pytorch.attention.context_parallel import check_context_parallel_args

        self._context_parallel = check_context_parallel_args(cp_group, cp_global_ranks, cp_stream, cp_comm_type,
                                                             cp_stripe_size)
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self.cp_comm_type = cp_comm_type
        self.cp_stripe_size = cp_stripe_size

    # Floats are kept as exact integer ratios: under torch.compile with dynamic shapes dynamo turns
    # float attributes into symbolic inputs, which backend selection (run while tracing) cannot take.
    @property
    def attention_dropout(self) -> float:
        num, den = self._attention_dropout_ratio
        return num / den

    @attention_dropout.setter
    def attention_dropout(self, value: float) -> None:
        self._attention_dropout_ratio = float(value).as_integer_ratio()

    @property
    def softmax_scale(self) -> float:
        num, den = self._softmax_scale_ratio
        return num / den

    @softmax_scale.setter
    def softmax_scale(self, value: float) -> None:
        self._softmax_scale_ratio = check_softmax_scale(value).as_integer_ratio()

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
            f"qkv_format={self.qkv_format!r}, attn_mask_type={self.attn_mask_type!r}, window_size={self.window_size}, "
            f"attention_dropout={self.attention_dropout}"
        )

    # -- argument checks -------------------------------------------------------------------------

    def _check_tensors(self, q, k, v, fmt: QKVFormat) -> None:
        for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype in _FP8_DTYPES:
                raise NotImplementedError(f"FP8 attention is not supported yet (`{name}` has dtype {t.dtype})")
            if not t.dtype.is_floating_point:
                raise ValueError(f"`{name}` must be a floating-point tensor, got {t.dtype}")
            want = 3 if fmt == QKVFormat.THD else 4
            if t.dim() != want:
                raise ValueError(f"`{name}` must be {want}-D for qkv_format={fmt.value!r}, got shape {tuple(t.shape)}")
        expected = (
            ("query_layer", q, self.num_heads_per_partition, self.hidden_size_per_attention_head_k),
            ("key_layer", k, self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head_k),
            ("value_layer", v, self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head_v),
        )
        for name, t, heads, dim in expected:
            if t.shape[-2] != heads or t.shape[-1] != dim:
                raise ValueError(
                    f"`{name}` must have {heads} heads of size {dim} (num_attention_heads/num_gqa_groups, "
                    f"kv_channels, tp_size={self.tp_size}), got shape {tuple(t.shape)}"
                )

    # -- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        query_layer: Optional[torch.Tensor] = None,
        key_layer: Optional[torch.Tensor] = None,
        value_layer: Optional[torch.Tensor] = None,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params: Optional[InferenceParams] = None,
        pad_between_seqs: Optional[bool] = None,
        fp8_output: bool = False,
        bf16_backward: Optional[bool] = False,
        num_splits: Optional[int] = 1,
        score_mod: Optional[Callable] = None,
        score_mod_bprop: Optional[Callable] = None,
        score_mod_tensors: Optional[dict] = None,
        score_mod_bprop_tensors: Optional[dict] = None,
        qkv_layer: Optional[torch.Tensor] = None,
        kv_layer: Optional[torch.Tensor] = None,
        qkv_interleave_dim: int = -3,
    ):
        """Attention over ``query_layer``, ``key_layer``, ``value_layer``; see the class docstring.

        ``qkv_layer`` (instead of the three) or ``kv_layer`` (with ``query_layer``) pass one packed
        buffer: ``[b, s, 3, h, d]`` / ``[b, s, h, 3, d]`` (``qkv_interleave_dim`` -3 / -2; ``[s, b, ...]``
        for sbhd, ``[t, ...]`` for thd), ``[.., 2, h_kv, d]`` for K/V; q, k, v are views of it.

        ``bottom_right_diagonal`` overrides the constructor's (see the class docstring).
        ``num_splits`` must be 1 (TransformerEngine forwards other values only to FlashAttention-3).
        ``fast_zero_fill`` and ``pad_between_seqs`` are accepted for compatibility: padded
        positions are always zero and gaps between packed sequences come from ``cu_seqlens_*_padded``.

        Returns the output, or ``(output, max_logit)`` when the module was built with
        ``return_max_logit=True``.
        """
        if fp8_output:
            raise NotImplementedError("FP8 output (`fp8_output=True`) is not supported yet")
        if bf16_backward:
            raise NotImplementedError("`bf16_backward=True` (the FP8 attention's backward in bf16) is not supported: "
                                      "FP8 attention is not supported yet")
        if num_splits is not None and num_splits != 1:
            if not isinstance(num_splits, int) or num_splits < 1:
                raise ValueError(f"`num_splits` must be a positive int, got {num_splits!r}")
            raise NotImplementedError(
                f"`num_splits` must be 1, got {num_splits}: only FlashAttention-3 splits its kernels "
                "(TransformerEngine's fused and unfused backends refuse other values too)"
            )
        for mod_name, mod in (("score_mod", score_mod), ("score_mod_bprop", score_mod_bprop),
                              ("score_mod_tensors", score_mod_tensors),
                              ("score_mod_bprop_tensors", score_mod_bprop_tensors)):
            if mod is not None:
                raise NotImplementedError(f"`{mod_name}` (cuDNN's experimental score modification) is not supported")
        key = plan_key = None
        fp8_recipe = _fp8_attention_recipe()
        if fp8_recipe is not None and _is_compiling() and _fp8_scaling(fp8_recipe) is Scaling.DELAYED:
            raise NotImplementedError("FP8 attention (the recipe's fp8_dpa) under DelayedScaling inside torch.compile "
                                      "is not supported yet: its metas are registered and updated outside the graph; "
                                      "use Float8CurrentScaling(fp8_dpa=True) or run the attention eagerly")
        if fp8_recipe is not None and inference_params is not None:
            raise NotImplementedError("FP8 attention (the recipe's fp8_dpa) with `inference_params` (a KV cache) is "
                                      "not supported; run the cached steps outside the FP8 autocast")
        if (fp8_recipe is None and isinstance(inference_params, InferenceParams) and not _is_compiling()
                and _PREPARED_CALLS.enabled
                and attention_mask is None and qkv_layer is None and kv_layer is None and cu_seqlens_q is None
                and cu_seqlens_kv is None and cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None
                and core_attention_bias is None and alibi_slopes is None and not checkpoint_core_attention
                and type(query_layer) in _PLAIN_TENSORS and type(key_layer) in _PLAIN_TENSORS
                and type(value_layer) in _PLAIN_TENSORS and not _LOGGER.isEnabledFor(logging.INFO)
                and (self._context_parallel is None or self._context_parallel.size <= 1)):
            # A KV-cache decode step: its signature (what every check and decision of the step reads) finds the
            # step's kernel call kept by the InferenceParams for this layer and batch size (decode_from_plan).
            try:
                plan_key = self._signature(query_layer, key_layer, value_layer, qkv_format, None, None, None, None,
                                           max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size,
                                           bottom_right_diagonal, False, core_attention_bias_type, None, None)
            except (TypeError, AttributeError):  # as below: the full path's checks name the argument
                plan_key = None
            if plan_key is not None:
                out = inference_params.decode_from_plan(self, plan_key, query_layer, key_layer, value_layer)
                if out is not None:
                    return out
        if (fp8_recipe is None and not _is_compiling()  # first: while tracing, nothing after it is evaluated
                and attention_mask is None and inference_params is None and qkv_layer is None and kv_layer is None
                and type(query_layer) in _PLAIN_TENSORS and type(key_layer) in _PLAIN_TENSORS
                and type(value_layer) in _PLAIN_TENSORS and not _LOGGER.isEnabledFor(logging.INFO)
                and (self._context_parallel is None or self._context_parallel.size <= 1)):
            try:
                key = self._signature(query_layer, key_layer, value_layer, qkv_format, cu_seqlens_q, cu_seqlens_kv,
                                      cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv,
                                      attn_mask_type, window_size, bottom_right_diagonal, checkpoint_core_attention,
                                      core_attention_bias_type, core_attention_bias, alibi_slopes)
                prepared = _PREPARED_CALLS.get(key)
            except (TypeError, AttributeError):  # an argument that makes no key (unhashable, a window that is no
                key = prepared = None  # sequence, a cu_seqlens that is no tensor): the full path's checks name it
            if prepared is not None:
                cu_seqlens = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
                return self._run_prepared(prepared, query_layer, key_layer, value_layer,
                                          *(t if carried else None for t, carried in
                                            zip(cu_seqlens, prepared.carried_seqlens)),
                                          core_attention_bias, alibi_slopes, checkpoint_core_attention)
        fmt = _enum_arg(QKVFormat, qkv_format if qkv_format is not None else self.qkv_format, "qkv_format")
        q, k, v = _unpack_packed(qkv_layer, kv_layer, query_layer, key_layer, value_layer, fmt, qkv_interleave_dim)
        mask = _mask_arg(attn_mask_type if attn_mask_type is not None else self.attn_mask_type)
        bias_type = _enum_arg(AttnBiasType, core_attention_bias_type, "core_attention_bias_type")
        self._check_tensors(q, k, v, fmt)
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(
                f"`query_layer`, `key_layer`, `value_layer` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        if not (q.device == k.device == v.device):
            raise ValueError(
                f"`query_layer`, `key_layer`, `value_layer` must be on one device, got {q.device}, {k.device}, {v.device}"
            )
        if inference_params is not None:  # a generation step with a KV cache: inference.py
            return cached_attention(
                self, inference_params, q, k, v, fmt, mask, window_size=window_size, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                bias_type=bias_type, core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                checkpoint_core_attention=checkpoint_core_attention, plan_key=plan_key,
                forward=functools.partial(DotProductAttention.forward, self))

        seqs = _resolve_sequences(q, k, v, fmt, mask, attention_mask, cu_seqlens_q, cu_seqlens_kv,
                                  cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)
        window = normalize_window(window_size if window_size is not None else self.window_size, seqs.mask)
        bottom_right = resolve_bottom_right_diagonal(
            seqs.mask, bottom_right_diagonal if bottom_right_diagonal is not None else self.bottom_right_diagonal,
            "pytorch")
        bias_shape = _check_bias(q, seqs, bias_type, core_attention_bias, alibi_slopes)

        dropout = self.attention_dropout if self.training else 0.0
        softmax_type = AttnSoftmaxType(self.softmax_type)
        softmax_offset = self.softmax_offset
        if softmax_offset is not None:  # fp32 on q's device whatever the module was cast to, as TE passes it
            softmax_offset = softmax_offset.to(device=q.device, dtype=torch.float32)
        if fp8_recipe is not None:  # FP8 attention: its kernels or a refusal by name, never bf16
            from transformer_engine.pytorch.attention.fp8_attention import dpa_fp8_attention

            self.last_backend = "FusedAttention(FP8)"
            cp = self._context_parallel
            cp_on = cp is not None and cp.size > 1
            # CP under FP8: "a2a" with current scales, each rank attending whole sequences of its heads: per-sequence
            # scales are each kv head's own, per-tensor ones take the amaxes all-reduced over the a2a group, so
            # both are the single-device bits (other CP forms are refused by name).
            cp_a2a = cp_on and cp.comm_type == "a2a" and _fp8_scaling(fp8_recipe) is Scaling.CURRENT

            def fp8_attend(q_, k_, v_):
                return dpa_fp8_attention(self, fp8_recipe, q_, k_, v_, fmt, seqs, window, bottom_right, bias_type,
                                         dropout, softmax_type, cp_on and not cp_a2a, self.return_max_logit,
                                         amax_group=cp.groups[0] if cp_a2a else None)

            attend = fp8_attend
            if cp_a2a:
                from transformer_engine.common.attention import UnfusedDotProductAttention
                from transformer_engine.pytorch.attention.context_parallel import context_parallel_attend

                attend = context_parallel_attend(
                    cp, fp8_attend, backend=UnfusedDotProductAttention, q=q, k=k, v=v, fmt=fmt, mask=seqs.mask,
                    seqs=seqs, window=window, softmax_scale=self.softmax_scale, deterministic=True,
                    num_heads=self.num_heads_per_partition, num_kv_heads=self.num_gqa_groups_per_partition,
                    bias_type=bias_type, dropout=dropout, softmax_type=softmax_type,
                    return_max_logit=self.return_max_logit)
            return self._attend(attend, q, k, v, checkpoint_core_attention)
        # The call's parameters, once: backend selection (its AttnConfig), the backend's run and the launch read
        # this value.
        thd = fmt == QKVFormat.THD
        params = AttnParams(
            attn_mask_type=seqs.mask, attn_bias_type=bias_type, qkv_format=fmt, window_size=window,
            scaling_factor=self.softmax_scale, dropout_probability=float(self.attention_dropout),
            is_training=self.training, deterministic=self._deterministic(), bottom_right_diagonal=bottom_right,
            softmax_type=softmax_type, max_seqlen_q=seqs.max_seqlen_q if thd else None,
            max_seqlen_kv=seqs.max_seqlen_kv if thd else None, return_max_logit=self.return_max_logit)
        backend = self._select(q, k, v, params, seqs, bias_shape)
        self.last_backend = backend.NAME
        call = AttnCall(
            params=params, cu_seqlens_q=seqs.cu_seqlens_q, cu_seqlens_kv=seqs.cu_seqlens_kv,
            cu_seqlens_q_padded=seqs.cu_seqlens_q_padded, cu_seqlens_kv_padded=seqs.cu_seqlens_kv_padded,
            bias=core_attention_bias, alibi_slopes=alibi_slopes, softmax_offset=softmax_offset,
            attention_mask=seqs.attention_mask, rng_context=self._rng_context(),
        )
        if key is not None and (fmt != QKVFormat.THD or (max_seqlen_q is not None and max_seqlen_kv is not None)):
            # Every check above read only what the key holds; thd without max_seqlen_* read cu_seqlens' values.
            carried = tuple(t is not None for t in (seqs.cu_seqlens_q, seqs.cu_seqlens_kv, seqs.cu_seqlens_q_padded,
                                                    seqs.cu_seqlens_kv_padded))
            _PREPARED_CALLS.put(key, _PreparedCall(backend, params, carried))

        step_run = _step_runner()

        def attend(q_, k_, v_):
            return _run(step_run, backend, q_, k_, v_, call)

        cp = self._context_parallel
        if cp is not None and cp.size > 1:  # cp = 1 (or no group) is the plain single-device call
            from transformer_engine.pytorch.attention.context_parallel import context_parallel_attend

            attend = context_parallel_attend(
                cp, attend, backend=backend, q=q, k=k, v=v, fmt=fmt, mask=seqs.mask, seqs=seqs, window=window,
                softmax_scale=self.softmax_scale, deterministic=params.deterministic,
                num_heads=self.num_heads_per_partition,
                num_kv_heads=self.num_gqa_groups_per_partition,
                bias_type=bias_type, dropout=dropout, softmax_type=softmax_type, return_max_logit=self.return_max_logit)
        return self._attend(attend, q, k, v, checkpoint_core_attention)

    def _attend(self, attend, q, k, v, checkpoint_core_attention: bool):
        """``attend(q, k, v)`` (checkpointed when asked and recording gradients), heads flattened."""
        if checkpoint_core_attention and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
        else:
            out = attend(q, k, v)
        max_logit = None
        if self.return_max_logit:
            out, max_logit = out
        out = out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])
        return (out, max_logit) if self.return_max_logit else out

    def _rng_context(self):
        """Where dropout draws its seed: the RNG tracker's fork, or None for torch's default generator."""
        if self.get_rng_state_tracker is not None and not self.sequence_parallel:
            # As in TransformerEngine: with sequence parallelism dropout draws from the default generator.
            tracker = self.get_rng_state_tracker
            return lambda: tracker().fork()
        return None

    def _signature(self, q, k, v, qkv_format, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                   max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size, bottom_right_diagonal,
                   checkpoint_core_attention, core_attention_bias_type, core_attention_bias, alibi_slopes) -> tuple:
        """Everything forward's checks and backend selection read of a call (the module docstring), as a key.
        Scalars with their types (True, 1 and 1.0 are equal keys, but the checks tell them apart)."""
        offset = self.softmax_offset
        scalars = (qkv_format, attn_mask_type, bottom_right_diagonal, checkpoint_core_attention,
                   core_attention_bias_type, max_seqlen_q, max_seqlen_kv, self.bottom_right_diagonal, self.qkv_format,
                   self.attn_mask_type, self.softmax_type, self.training, self.return_max_logit, self.sequence_parallel)
        return (
            scalars, tuple(map(type, scalars)), _window_signature(window_size), _window_signature(self.window_size),
            # the module's other settings
            self._softmax_scale_ratio, self._attention_dropout_ratio, self.num_heads_per_partition,
            self.num_gqa_groups_per_partition, self.hidden_size_per_attention_head_k,
            self.hidden_size_per_attention_head_v, self.tp_size, self.get_rng_state_tracker is None,
            None if offset is None else (offset.shape, offset.dtype, offset.device),
            # the call's tensors
            tensor_signature(q), tensor_signature(k), tensor_signature(v),
            tensor_signature(cu_seqlens_q), tensor_signature(cu_seqlens_kv), tensor_signature(cu_seqlens_q_padded),
            tensor_signature(cu_seqlens_kv_padded), cu_seqlens_kv is cu_seqlens_q,
            tensor_signature(core_attention_bias), tensor_signature(alibi_slopes),
            # what selection reads besides: the determinism request, the settings, the current device
            torch.are_deterministic_algorithms_enabled(), environment_signature(),
            torch.cuda.current_device() if q.is_cuda else None,
        )

    def _run_prepared(self, prepared: _PreparedCall, q, k, v, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                      cu_seqlens_kv_padded, core_attention_bias, alibi_slopes, checkpoint_core_attention: bool):
        """forward for a signature seen before: the decisions from ``prepared``, the tensors from this call."""
        step_run = _step_runner()
        backend = prepared.backend
        self.last_backend = backend.NAME
        softmax_offset = self.softmax_offset
        if softmax_offset is not None:  # as forward does
            softmax_offset = softmax_offset.to(device=q.device, dtype=torch.float32)
        call = AttnCall(prepared.params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                        cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                        bias=core_attention_bias, alibi_slopes=alibi_slopes, softmax_offset=softmax_offset,
                        rng_context=self._rng_context())

        def attend(q_, k_, v_):
            return _run(step_run, backend, q_, k_, v_, call)

        return self._attend(attend, q, k, v, checkpoint_core_attention)

    def _deterministic(self) -> bool:
        """The call's determinism request, read now (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or
        torch.use_deterministic_algorithms(True))."""
        if _is_compiling():
            return _deterministic_while_tracing(torch.are_deterministic_algorithms_enabled())
        return attn_config.deterministic_requested()

    def _select(self, q, k, v, params: AttnParams, seqs: "_Sequences", bias_shape: Optional[str]):
        """The backend class for the call of ``params`` on q, k, v, read now: the AttnConfig of ``params``."""
        if _is_compiling():
            # Sizes that may be dynamic are unknown while tracing; head counts and dims are static.
            def meta(t, heads, dim):
                return (-1,) * (t.dim() - 2) + (heads, dim)
            dk, dv = self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v
            name = _select_while_tracing(
                meta(q, self.num_heads_per_partition, dk), meta(k, self.num_gqa_groups_per_partition, dk),
                meta(v, self.num_gqa_groups_per_partition, dv), str(q.dtype).replace("torch.", ""), q.device.type,
                params.qkv_format.value, params.attn_mask_type.value, tuple(params.window_size),
                params.attn_bias_type.value, bias_shape, float(params.dropout_probability), bool(params.is_training),
                params.deterministic, seqs.distinct_kv_lengths, params.bottom_right_diagonal,
                params.return_max_logit, params.softmax_type.value,
            )
            return attn_backends.backend_named(name)
        config = attn_config.build_attn_config(
            q, k, v, params, bias_shape=bias_shape, batch_size=seqs.batch, max_seqlen_q=seqs.max_seqlen_q,
            max_seqlen_kv=seqs.max_seqlen_kv, packing=_packing(q, k, v), distinct_kv_lengths=seqs.distinct_kv_lengths)
        return attn_backends.select(config).backend
