"""torch.library custom ops for the fused attention forward and backward.

Opaque to torch.compile (with fake implementations for shapes), so a compiled model traces
the attention call without graph breaks. The ops' schema holds tensors and scalars only: an
:class:`~transformer_engine.pytorch.attention.call.AttnCall` crosses it flattened (``call.flatten``: its
tensors by role, then its parameters field by field) and is rebuilt first thing inside. Eager calls on
plain tensors skip the op's dispatch (:func:`forward` / :func:`backward`) and pass the call whole: the
dispatch costs more host time than the launches themselves, and a small step's kernels wait for it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.common.attention import BackwardGrads, QKVFormat
from transformer_engine.pytorch.attention import kernel_runner
from transformer_engine.pytorch.attention.call import FLAT_SIZE, AttnCall, flatten, op_schema_args, unflatten
from transformer_engine.pytorch.attention.config import qkv_dims

__all__ = ["fused_attn_fwd", "fused_attn_bwd", "forward", "backward", "fp8_attn_fwd", "fp8_attn_bwd", "fp8_forward",
           "fp8_backward"]

_CALL_ARGS = op_schema_args()


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             call: AttnCall) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, max_logit) of ``call`` (AttnCall's conventions at the kernels): ``max_logit`` [h_q] in q's
    dtype with ``call.params.return_max_logit``, else an empty tensor."""
    got = kernel_runner.forward(q, k, v, call)
    if call.params.return_max_logit:
        out, lse, row_max = got
        return out, lse, kernel_runner.max_logit(row_max, q.dtype)
    return got + (q.new_empty(0),)


def _forward_op(q, k, v, *flat):
    return _forward(q, k, v, unflatten(flat))


fused_attn_fwd = torch.library.custom_op(
    "transformer_engine::fused_attn_fwd", _forward_op, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_CALL_ARGS}) -> (Tensor, Tensor, Tensor)")


def _fake_out_lse(q, v, call: AttnCall, out_dtype=None):
    """The forward's output and log-sum-exp as empty tensors of their shapes (the ops' fake kernels)."""
    p = call.params
    if p.qkv_format == QKVFormat.THD:
        batch, sq = call.cu_seqlens_q.shape[0] - 1, p.max_seqlen_q
    else:
        batch, sq = qkv_dims(q, p.qkv_format)[:2]
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=out_dtype)
    return out, q.new_empty((batch, q.shape[-2], sq), dtype=torch.float32)


@fused_attn_fwd.register_fake
def _(q, k, v, *flat):
    call = unflatten(flat)
    p = call.params
    out, lse = _fake_out_lse(q, v, call)
    max_logit = q.new_empty((q.shape[-2],) if p.return_max_logit else (0,))
    return out, lse, max_logit


def _backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, d_out: torch.Tensor, lse: torch.Tensor,
    call: AttnCall, bias_grad: bool, softmax_offset_grad: bool = False, grads: str = BackwardGrads.DQ_DKDV.value,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, d_softmax_offset) of ``call``; dbias is an empty tensor unless ``bias_grad``,
    d_softmax_offset (fp32 [h_q]) unless ``softmax_offset_grad``. ``grads`` (a :class:`BackwardGrads`
    value): ``"dq+dkdv"`` the whole backward; ``"dq"`` runs no dK/dV pass and returns dk, dv as empty
    tensors (numel 0); ``"dkdv"`` no dQ pass, dq empty. A requested gradient is bitwise the whole
    backward's (the same launches, fewer of them). The same kernels in both determinism modes (each sum
    in a fixed order, no atomics), so the op takes no determinism flag."""
    which = _grads(grads)
    dq, dk, dv, dbias, d_offset = kernel_runner.backward(q, k, v, out, d_out, lse, call, bias_grad=bias_grad,
                                                         softmax_offset_grad=softmax_offset_grad, grads=which)
    return (dq if dq is not None else q.new_empty(0), dk if dk is not None else k.new_empty(0),
            dv if dv is not None else v.new_empty(0), dbias if dbias is not None else q.new_empty(0),
            d_offset if d_offset is not None else lse.new_empty(0))


def _flags(bias_grad: bool, softmax_offset_grad: bool = False, grads: str = BackwardGrads.DQ_DKDV.value):
    return bias_grad, softmax_offset_grad, grads


def _split(args, kwargs):
    """(call, (bias_grad, softmax_offset_grad, grads)) of the backward op's arguments after its six tensors (the
    op passes the schema's trailing defaults only when given)."""
    return unflatten(args[:FLAT_SIZE]), _flags(*args[FLAT_SIZE:], **kwargs)


def _backward_op(q, k, v, out, d_out, lse, *args, **kwargs):
    call, flags = _split(args, kwargs)
    return _backward(q, k, v, out, d_out, lse, call, *flags)

fused_attn_bwd = torch.library.custom_op(
    "transformer_engine::fused_attn_bwd", _backward_op, mutates_args=(),
    schema=(f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor d_out, Tensor lse, {_CALL_ARGS}, bool bias_grad, "
            f'bool softmax_offset_grad=False, str grads="{BackwardGrads.DQ_DKDV.value}") '
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"))


@fused_attn_bwd.register_fake
def _(q, k, v, out, d_out, lse, *args, **kwargs):
    call, (bias_grad, softmax_offset_grad, grads) = _split(args, kwargs)
    which = _grads(grads)
    bias = call.bias
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    d_offset = lse.new_empty((q.shape[-2],)) if softmax_offset_grad else lse.new_empty(0)
    dq = q.new_empty(q.shape if which.has_dq else (0,))
    dk, dv = (t.new_empty(t.shape if which.has_dkdv else (0,)) for t in (k, v))
    return (dq, dk, dv, dbias, d_offset)


def _grads(grads: str) -> BackwardGrads:
    try:
        return BackwardGrads(grads)
    except ValueError:
        choices = ", ".join(repr(g.value) for g in BackwardGrads)
        raise ValueError(f"`grads` must be one of {choices}, got {grads!r}") from None


def _eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call may skip the op: not traced (torch.compile, export) and only plain tensors (no fake,
    functional or other subclass tensors, which need the op's dispatch)."""
    if torch.compiler.is_compiling():
        return False
    return all(t is None or type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def forward(q, k, v, call: AttnCall):
    """``fused_attn_fwd`` of ``call`` on q, k, v: the implementation directly, with the call whole, when
    :func:`_eager`; else the op on the call's flat form."""
    if _eager(q, k, v):
        return _forward(q, k, v, call)
    return fused_attn_fwd(q, k, v, *flatten(call))


def backward(q, k, v, out, d_out, lse, call: AttnCall, bias_grad: bool = False, softmax_offset_grad: bool = False,
             grads: str = BackwardGrads.DQ_DKDV.value):
    """``fused_attn_bwd`` of ``call``: the implementation directly when :func:`_eager`, else the op."""
    if _eager(q, k, v, out, d_out, lse):
        return _backward(q, k, v, out, d_out, lse, call, bias_grad, softmax_offset_grad, grads)
    return fused_attn_bwd(q, k, v, out, d_out, lse, *flatten(call), bias_grad, softmax_offset_grad, grads)


# --- FP8 attention (fp8_launch.py): FP8 q, k, v (and dO) with their descale factors as call arguments ------------

def _fp8_forward_op(q, k, v, descale, out_dtype, *flat):
    from transformer_engine.pytorch.attention.fp8_launch import fp8_forward_impl

    return fp8_forward_impl(q, k, v, descale, unflatten(flat), out_dtype)


fp8_attn_fwd = torch.library.custom_op(
    "transformer_engine::fp8_attn_fwd", _fp8_forward_op, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor descale, ScalarType out_dtype, {_CALL_ARGS}) -> (Tensor, Tensor, "
           "Tensor)")


@fp8_attn_fwd.register_fake
def _(q, k, v, descale, out_dtype, *flat):
    out, lse = _fake_out_lse(q, v, unflatten(flat), out_dtype)
    return out, lse, q.new_empty((3,), dtype=torch.float32)


def _fp8_backward_op(q, k, v, out, d_out, lse, descale, grad_dtype, *flat):
    from transformer_engine.pytorch.attention.fp8_launch import fp8_backward_impl

    return fp8_backward_impl(q, k, v, out, d_out, lse, descale, unflatten(flat), grad_dtype)


fp8_attn_bwd = torch.library.custom_op(
    "transformer_engine::fp8_attn_bwd", _fp8_backward_op, mutates_args=(),
    schema=(f"(Tensor q, Tensor k, Tensor v, Tensor out, Tensor d_out, Tensor lse, Tensor descale, "
            f"ScalarType grad_dtype, {_CALL_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)"))


@fp8_attn_bwd.register_fake
def _(q, k, v, out, d_out, lse, descale, grad_dtype, *flat):
    return (q.new_empty(q.shape, dtype=grad_dtype), k.new_empty(k.shape, dtype=grad_dtype),
            v.new_empty(v.shape, dtype=grad_dtype), lse.new_empty((3,)))


def fp8_forward(q, k, v, descale, call: AttnCall, out_dtype: torch.dtype):
    """``fp8_attn_fwd``: (out, lse, fwd_amax) of FP8 attention on FP8 q, k, v with ``descale`` (fp32 [4] or
    [batch, h_kv, 4]); the implementation directly when :func:`_eager`, else the op."""
    if _eager(q, k, v, descale):
        from transformer_engine.pytorch.attention.fp8_launch import fp8_forward_impl

        return fp8_forward_impl(q, k, v, descale, call, out_dtype)
    return fp8_attn_fwd(q, k, v, descale, out_dtype, *flatten(call))


def fp8_backward(q, k, v, out, d_out, lse, descale, call: AttnCall, grad_dtype: torch.dtype):
    """``fp8_attn_bwd``: (dq, dk, dv, bwd_amax); the implementation directly when :func:`_eager`, else the op."""
    if _eager(q, k, v, out, d_out, lse, descale):
        from transformer_engine.pytorch.attention.fp8_launch import fp8_backward_impl

        return fp8_backward_impl(q, k, v, out, d_out, lse, descale, call, grad_dtype)
    return fp8_attn_bwd(q, k, v, out, d_out, lse, descale, grad_dtype, *flatten(call))
