"""From PyTorch tensors and arguments to one AttnConfig: the PyTorch frontend's argument checks.

Backend selection over the PyTorch backends is :func:`transformer_engine.pytorch.attention.backends.select`.
"""

from __future__ import annotations

import contextvars
import os
from typing import Optional, Tuple

import torch

from transformer_engine.common import settings
from transformer_engine.common.attention import AttnConfig, QKVFormat
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.validation import check_cu_seqlens_values
from transformer_engine.pytorch.attention.buffers import host_values
from transformer_engine.pytorch.attention.device import device_facts

__all__ = ["deterministic_requested", "build_attn_config", "dtype_name", "check_cu_seqlens",
           "check_qkv", "qkv_dims", "triton_interpreting", "check_sequence_values", "can_sync",
           "sequences_checked_on_host", "sequences_checked"]

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def deterministic_requested() -> bool:
    """True when NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch.use_deterministic_algorithms(True); read now."""
    return (not settings.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")) or torch.are_deterministic_algorithms_enabled()


def triton_interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): the fused kernels can run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def qkv_dims(t, qkv_format: QKVFormat) -> Tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim) of one tensor (or shape stand-in) in ``qkv_format``; batch is 1
    and seq the token count for thd. The one place the format says where each dimension is."""
    shape = tuple(t.shape)
    if qkv_format == QKVFormat.BSHD:
        return shape
    if qkv_format == QKVFormat.SBHD:
        s, b, h, d = shape
        return b, s, h, d
    t_, h, d = shape
    return 1, t_, h, d


def split_shape(t: torch.Tensor, qkv_format: QKVFormat, name: str) -> Tuple[int, int, int, int]:
    """:func:`qkv_dims` of one tensor, after checking its rank."""
    expected = 3 if qkv_format == QKVFormat.THD else 4
    if t.dim() != expected:
        raise ValueError(
            f"`{name}` must be {expected}-D for qkv_format={qkv_format.value!r}, got shape {tuple(t.shape)}"
        )
    return qkv_dims(t, qkv_format)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: QKVFormat):
    """Shapes, dtypes and devices of q, k, v agree; returns (b, s_q, h_q, d_qk, s_kv, h_kv, d_v)."""
    bq, sq, hq, dqk = split_shape(q, fmt, "query_layer")
    bk, sk, hk, dk = split_shape(k, fmt, "key_layer")
    bv, sv, hv, dv = split_shape(v, fmt, "value_layer")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"`query_layer`, `key_layer`, `value_layer` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"`query_layer`, `key_layer`, `value_layer` must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if fmt != QKVFormat.THD and not (bq == bk == bv):
        raise ValueError(f"q, k, v must share the batch size, got {bq}, {bk}, {bv}")
    if sk != sv:
        raise ValueError(f"`key_layer` and `value_layer` must have the same sequence length, got {sk} and {sv}")
    if dqk != dk:
        raise ValueError(f"`key_layer` head dim must equal `query_layer`'s ({dqk}), got {dk}")
    if hk != hv:
        raise ValueError(f"`key_layer` and `value_layer` must have the same number of heads, got {hk} and {hv}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads (num_gqa_groups={hk})")
    return bq, sq, hq, dqk, sk, hk, dv


def check_cu_seqlens(name: str, cu: Optional[torch.Tensor], batch: Optional[int], device: torch.device) -> None:
    """Type, dtype, shape and device of one cu_seqlens argument (values: _check_cu_seqlens_values)."""
    if cu is None:
        return
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"`{name}` must be an int32 tensor of shape [batch + 1], got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"`{name}` must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2 or (batch is not None and cu.shape[0] != batch + 1):
        want = f"[{batch + 1}]" if batch is not None else "[batch + 1]"
        raise ValueError(f"`{name}` must have shape {want} (length batch + 1), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"`{name}` must be on the inputs' device {device}, got {cu.device}")


# Set while the attention calls' sequence tensors are ones their caller built from values it checked on the host.
_SEQUENCES_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("te_sequences_checked", default=False)


class sequences_checked_on_host:
    """While open, the attention calls' sequence tensors (cu_seqlens, a page table) are ones the caller built
    from host values it checked (a KV-cache step's, ``inference.py``): the value checks, which would read them
    back (a device-to-host copy, so a sync, per call), are skipped (:func:`sequences_checked`)."""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _SEQUENCES_CHECKED.set(True)

    def __exit__(self, *exc) -> None:
        _SEQUENCES_CHECKED.reset(self._token)


def sequences_checked() -> bool:
    """Inside :class:`sequences_checked_on_host`: the calls' sequence values were checked on the host."""
    return _SEQUENCES_CHECKED.get()


def can_sync() -> bool:
    """Value checks read cu_seqlens on the host: skipped while tracing or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_sequence_values(fmt: QKVFormat, q: torch.Tensor, k: torch.Tensor, cu_q, cu_kv, pad_q, pad_kv,
                          max_q: Optional[int], max_kv: Optional[int]) -> None:
    """The values of the cu_seqlens arguments (one host sync; skipped when ``can_sync()`` is false or the caller
    checked them, :func:`sequences_checked`),
    by :func:`~transformer_engine.common.attention.validation.check_cu_seqlens_values`. A None
    ``cu_kv`` means the same as ``cu_q``; a padded side given alone leaves the other side's
    sequences starting where its cu_seqlens say. bshd/sbhd: lengths within the padded
    sequence lengths ``max_q``/``max_kv``; thd: within ``max_seqlen_*`` and the token counts."""
    if cu_q is None or not can_sync() or sequences_checked():
        return
    thd = fmt == QKVFormat.THD
    cu_kv = cu_q if cu_kv is None else cu_kv
    if thd and (pad_q is None) != (pad_kv is None):
        pad_q = cu_q if pad_q is None else pad_q
        pad_kv = cu_kv if pad_kv is None else pad_kv
    for side, cu, pad, tokens, limit in (("q", cu_q, pad_q, q.shape[0], max_q), ("kv", cu_kv, pad_kv, k.shape[0], max_kv)):
        check_cu_seqlens_values(
            f"cu_seqlens_{side}", host_values(cu), padded=host_values(pad) if (thd and pad is not None) else None,
            tokens=tokens if thd else None, max_seqlen=None if limit is None else int(limit),
            max_seqlen_arg=f"max_seqlen_{side}" if thd else None)


def build_attn_config(
    q, k, v, params: AttnParams, *, bias_shape: Optional[str] = None, batch_size: Optional[int] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None, packing: str = "separate",
    distinct_kv_lengths: bool = False,
) -> AttnConfig:
    """The AttnConfig of a call whose parameters are checked and converted (``params``, the value the launch
    reads: its format says where q, k, v keep their dimensions) on q, k, v (tensors or shape stand-ins that
    agree): no checks, no conversions. ``batch_size``, ``max_seqlen_*``: where the shapes do not say them
    (thd); ``distinct_kv_lengths``: the call has per-sequence lengths with a separate ``cu_seqlens_kv`` (cross
    attention), so keys and queries of one sequence may differ in number. (``testing.attn_config`` checks and
    converts strings first.)"""
    fmt = params.qkv_format
    bq, sq, hq, dqk = qkv_dims(q, fmt)
    _, sk, hk, _ = qkv_dims(k, fmt)
    return AttnConfig(
        batch_size=batch_size if batch_size is not None else bq,
        num_heads_q=hq,
        num_heads_kv=hk,
        head_dim_qk=dqk,
        head_dim_v=v.shape[-1],
        max_seqlen_q=max_seqlen_q if max_seqlen_q is not None else sq,
        max_seqlen_kv=max_seqlen_kv if max_seqlen_kv is not None else sk,
        dtype=dtype_name(q.dtype),
        params=params,
        packing=packing,
        bias_shape=bias_shape,
        distinct_kv_lengths=bool(distinct_kv_lengths),
        framework="pytorch",
        device_type=q.device.type,
        **device_facts(q.device),
        triton_interpret=triton_interpreting(),
    )
