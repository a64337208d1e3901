"""AttnCall: one attention call as one object, from the module boundary to the kernel launch.

DotProductAttention (and ``fused_attn_func``) build it once from their arguments: the call's scalars as
one :class:`~transformer_engine.common.attention.params.AttnParams` and its tensors by role (not q, k, v,
which every layer takes as arguments). The backends, the fused path's autograd Function and its custom
ops, and the kernel runner take it whole. Two boundaries need flat arguments, and only they flatten it:

- the ``torch.library`` custom ops, whose schema holds tensors and scalars: :func:`flatten` gives the
  tensors by role, then every AttnParams field as a schema scalar (:func:`op_schema_args`: enums as their
  string values, ints as SymInt, the window as an int list), and :func:`unflatten` rebuilds the call right
  inside the op's implementation;
- the autograd Function's ``save_for_backward`` (tensors only): :attr:`AttnCall.tensors` and
  :meth:`AttnCall.of_tensors`.

A field added to AttnParams thus reaches the kernel runner without a new argument anywhere on the way.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from dataclasses import dataclass
from typing import Callable, ClassVar, ContextManager, Optional, Tuple

import torch

from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.enums import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.pytorch.attention.buffers import host_values

__all__ = ["AttnCall", "fused_call", "flatten", "unflatten", "op_schema_args", "FLAT_SIZE"]


@dataclass(frozen=True)
class AttnCall:
    """One attention call: ``params`` (mask, window, diagonal, scale, dropout, softmax type, ...) and its
    tensors by role.

    ``cu_seqlens_q``/``cu_seqlens_kv``: int32 [b + 1] per-sequence extents (thd; padding masks in bshd/sbhd);
    ``cu_seqlens_*_padded``: thd's packed starts where sequences are separated by gaps; ``bias``: a
    post-scale bias [b|1, h|1, s_q|1, s_kv]; ``alibi_slopes``: fp32 [h] or [b, h]; ``rng_state``: dropout's
    int64 [seed, offset]; ``softmax_offset``: the sink logits of sink softmax (fp32 [h_q] at the kernels);
    ``page_table``: a paged KV cache's int32 [b, max pages] (with ``params.kv_page_size``; k and v are then the
    cache's rows, thd, and the call is forward only).

    At the fused kernels (from ``fused_attention`` on) the tensors follow the launch's conventions: a None
    kv-side sequence tensor next to a q-side one means "the same as q's", ``params.max_seqlen_*`` are set
    for thd, ``params.scaling_factor`` is positive, ``rng_state`` is set exactly when dropout is on and
    ``softmax_offset`` whenever the softmax has a sink. The last two fields are DotProductAttention's,
    for its other backends (the arbitrary mask, the RNG tracker's fork); the fused path drops them.
    """

    params: AttnParams
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    rng_state: Optional[torch.Tensor] = None
    softmax_offset: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None  # the 'arbitrary' mask (unfused backend)
    rng_context: Optional[Callable[[], ContextManager]] = None  # where dropout draws its seed (RNG tracker)

    # The kernels' tensors, in field order: what save_for_backward and the custom ops take.
    TENSOR_ROLES: ClassVar[Tuple[str, ...]] = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                               "cu_seqlens_kv_padded", "bias", "alibi_slopes", "rng_state",
                                               "softmax_offset", "page_table")

    @property
    def tensors(self) -> Tuple[Optional[torch.Tensor], ...]:
        """The kernels' tensors by :attr:`TENSOR_ROLES` (:meth:`of_tensors` rebuilds the call)."""
        return (self.cu_seqlens_q, self.cu_seqlens_kv, self.cu_seqlens_q_padded, self.cu_seqlens_kv_padded,
                self.bias, self.alibi_slopes, self.rng_state, self.softmax_offset, self.page_table)

    @classmethod
    def of_tensors(cls, params: AttnParams, tensors) -> "AttnCall":
        """The call of ``params`` and the kernels' tensors in :attr:`TENSOR_ROLES` order (:attr:`tensors`)."""
        return cls(params, **dict(zip(cls.TENSOR_ROLES, tensors)))

    def at_kernels(self, **changes) -> "AttnCall":
        """This call with ``changes`` and without DotProductAttention's own fields (the arbitrary mask, the
        RNG tracker's fork), which the fused path drops."""
        return dataclasses.replace(self, attention_mask=None, rng_context=None, **changes)

    @property
    def sequences(self) -> tuple:
        """(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded, max_seqlen_q, max_seqlen_kv)."""
        return (self.cu_seqlens_q, self.cu_seqlens_kv, self.cu_seqlens_q_padded, self.cu_seqlens_kv_padded,
                self.params.max_seqlen_q, self.params.max_seqlen_kv)


def fused_call(
    qkv_format="bshd",
    attn_mask_type="no_mask",
    window_size: Optional[Tuple[int, int]] = None,
    softmax_scale: float = 1.0,
    *,
    bottom_right_diagonal: Optional[bool] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    bias: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    softmax_type="vanilla",
    softmax_offset: Optional[torch.Tensor] = None,
    deterministic: bool = True,
) -> AttnCall:
    """The AttnCall the fused kernels launch for these arguments (enums or their strings), for
    ``kernel_runner.forward`` / ``backward`` and ``kernel_runner.plan_key``: the window normalized and the diagonal
    resolved as PyTorch resolves them, thd's ``max_seqlen_*`` from the cu_seqlens when not given (one host
    sync; a call run with sequence extents of its own, ``seqs=``, needs no cu_seqlens). Nothing else is
    checked or converted: ``softmax_scale`` must be positive, ``rng_state`` given with dropout and
    ``softmax_offset`` (fp32 [h_q]) with a sink softmax, as at the kernels."""
    fmt, mask = QKVFormat(qkv_format), AttnMaskType(attn_mask_type)
    if fmt == QKVFormat.THD:
        if max_seqlen_q is None and cu_seqlens_q is not None:
            max_seqlen_q = max(host_values(cu_seqlens_q[1:] - cu_seqlens_q[:-1]))
        cu = cu_seqlens_kv if cu_seqlens_kv is not None else cu_seqlens_q
        if max_seqlen_kv is None and cu is not None:
            max_seqlen_kv = max(host_values(cu[1:] - cu[:-1]))
    else:
        max_seqlen_q = max_seqlen_kv = None
    if bias is not None:
        bias_type = AttnBiasType.POST_SCALE_BIAS
    else:
        bias_type = AttnBiasType.ALIBI if alibi_slopes is not None else AttnBiasType.NO_BIAS
    params = AttnParams(attn_mask_type=mask, attn_bias_type=bias_type, qkv_format=fmt,
                        window_size=normalize_window(window_size, mask), scaling_factor=float(softmax_scale),
                        dropout_probability=float(dropout_p), deterministic=deterministic,
                        bottom_right_diagonal=resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "pytorch"),
                        softmax_type=AttnSoftmaxType(softmax_type), max_seqlen_q=max_seqlen_q,
                        max_seqlen_kv=max_seqlen_kv)
    return AttnCall(params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded, bias=bias,
                    alibi_slopes=alibi_slopes, rng_state=rng_state if dropout_p > 0 else None,
                    softmax_offset=softmax_offset)


# -- the custom ops' flat form -----------------------------------------------------------------------------


def _codec(tp) -> Tuple[str, Callable]:
    """(schema type, decode) of an AttnParams field of annotation ``tp`` (:func:`_encode` is the inverse)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:  # Optional[X]
        (inner,) = [a for a in args if a is not type(None)]
        kind, decode = _codec(inner)
        return kind + "?", (lambda x: None if x is None else decode(x))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str", tp
    if tp is bool:
        return "bool", bool
    if tp is int:
        return "SymInt", (lambda x: x)  # SymInts stay symbolic while tracing
    if tp is float:
        return "float", float
    if typing.get_origin(tp) is tuple and all(a is int for a in args):
        return "SymInt[]", tuple
    raise TypeError(f"AttnParams fields must be enums, bools, ints, floats, int tuples or Optional of one for "
                    f"the custom ops' schema, got {tp!r}")


_HINTS = typing.get_type_hints(AttnParams)
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(AttnParams))
_CODECS = tuple(_codec(_HINTS[name]) for name in _PARAM_FIELDS)
_DECODERS = tuple(decode for _, decode in _CODECS)
_NUM_TENSORS = len(AttnCall.TENSOR_ROLES)
FLAT_SIZE = _NUM_TENSORS + len(_PARAM_FIELDS)  # how many of the ops' arguments one call takes


def op_schema_args() -> str:
    """The custom ops' schema arguments of an :class:`AttnCall`: its tensors by role (``Tensor?``), then every
    AttnParams field (``params_<name>``)."""
    tensors = [f"Tensor? {role}" for role in AttnCall.TENSOR_ROLES]
    params = [f"{kind} params_{name}" for name, (kind, _) in zip(_PARAM_FIELDS, _CODECS)]
    return ", ".join(tensors + params)


def flatten(call: AttnCall) -> tuple:
    """The custom ops' arguments of ``call`` (:func:`op_schema_args`); :func:`unflatten` inverts it."""
    if torch.compiler.is_compiling():  # traced once: the graph holds the values
        return call.tensors + _encoded(call.params)
    return call.tensors + _encoded_once(call.params)


def _encoded(params: AttnParams) -> tuple:
    return tuple([_encode(getattr(params, name)) for name in _PARAM_FIELDS])


# Eager calls through the ops (fake or subclass tensors) encode each distinct AttnParams once.
_encoded_once = functools.lru_cache(maxsize=1024)(_encoded)


def _encode(value):
    """A parameter's schema value: an enum's string, else the value (the schema takes a tuple for a list; one
    function for every field, so that tracing flatten under torch.compile guards on little)."""
    return value.value if isinstance(value, enum.Enum) else value


# The op schema's lists arrive as Python lists: their positions among the parameters, made tuples for the key.
_LIST_POSITIONS = tuple(i for i, (kind, _) in enumerate(_CODECS) if kind.startswith("SymInt[]"))
_decoded = {}  # the parameters' values -> their AttnParams (a compiled step calls the op with the same ones)
_MAX_DECODED = 1024


def unflatten(flat) -> AttnCall:
    """The :class:`AttnCall` of the custom ops' arguments (:func:`flatten`)."""
    values = list(flat[_NUM_TENSORS:])
    for i in _LIST_POSITIONS:
        if values[i] is not None:
            values[i] = tuple(values[i])
    key = tuple(values)
    try:
        params = _decoded.get(key)
    except TypeError:  # a symbolic size (a traced call with dynamic shapes) makes no key: decoded each time
        return AttnCall.of_tensors(AttnParams(*(decode(x) for decode, x in zip(_DECODERS, key))), flat[:_NUM_TENSORS])
    if params is None:
        params = AttnParams(*(decode(x) for decode, x in zip(_DECODERS, key)))
        if len(_decoded) >= _MAX_DECODED:
            _decoded.clear()
        _decoded[key] = params
    return AttnCall.of_tensors(params, flat[:_NUM_TENSORS])
