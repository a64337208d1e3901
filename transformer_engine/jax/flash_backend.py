"""flash-attn-4 (``flash_attn.cute``) behind ``fused_attn`` on NVIDIA Hopper and Blackwell GPUs.

The route: ``jax.experimental.buffer_callback``. XLA calls Python with its device buffers and its CUDA
stream; the buffers become torch tensors by DLPack (no copy), XLA's stream becomes torch's current stream
(flash-attn-4 launches on the stream TVM-FFI reads from torch), and flash-attn-4's own ``_flash_attn_fwd`` /
``_flash_attn_bwd`` run with the arguments its autograd Functions pass (``FlashAttnFunc``,
``FlashAttnVarlenFunc``), writing into XLA's output buffers. The PyTorch backend
(:mod:`transformer_engine.pytorch.attention.flash_backend`) calls the same functions through those
Functions, so a call gets the same compiled kernels, configuration and bits in both frameworks (a JAX
binding that compiled the kernels itself would have to repeat flash-attn-4's host-side configuration and
prove the bits equal again).

Calls, on the frontend's canonical BSHD operands:

- masks without padding: flash-attn's dense call on ``[b, s, h, d]``; a top-left causal mask with
  s_kv > s_q gets the first s_q keys only (no query sees the others), as in PyTorch;
- padding masks and THD: the varlen call on the ``[b * s]`` tokens: segment ``j`` of row ``r`` starts at
  token ``r * s + offset[r, j]`` and has ``seqlens[r, j]`` tokens (``cu_seqlens`` = starts, ``seqused`` =
  lengths, ``max_seqlen`` = s); rows outside every sequence, which flash-attn leaves unwritten, are set to
  zero in the output and the gradients by the PyTorch backend's own kernel.

The log-sum-exp flash-attn saves is ``[b, h, s_q]`` (dense) or ``[h, b * s_q]`` (varlen), kept as the
custom_vjp's residual. ``deterministic`` goes to flash-attn's backward. Under ``vmap`` each instance is its
own call. With a mesh in effect (outside ``shard_map``), the call runs in a ``shard_map`` that splits the batch
over the ``MeshResource`` dp/fsdp axes and the heads over tp, where they divide the shapes (a host callback
cannot be partitioned by ``custom_partitioning``); inside a ``shard_map`` it runs on the local arrays.

Costs of the route: torch in the JAX process (flash-attn-4 needs it anyway), Python on the host per call (as
PyTorch's path has), no CUDA-graph capture of the call, and no ``jax.export`` of a program that uses it.
Selection (:class:`~transformer_engine.common.attention.backends.FlashAttention`) never routes a call here
that flash-attn-4 cannot run; :func:`availability_reasons` adds what only JAX knows.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from transformer_engine.common.attention.backends import FlashAttention
from transformer_engine.common.attention.enums import AttnMaskType, QKVFormat
from transformer_engine.common.attention.validation import kernel_scale
from transformer_engine.jax import context_parallel, jax_compat
from transformer_engine.jax.attention_math import SeqInfo
from transformer_engine.jax.primitives.attention import _vary_like as operands_vary_alike
from transformer_engine.jax.sharding import batch_axes, global_mesh_resource, head_axes

__all__ = ["FlashStatic", "flash_static", "flash_attention", "availability_reasons", "unavailable_reason"]

# The flash-attn-4 functions called, and the keywords of theirs this module passes (checked once, so an
# interface change is a reason, not a failure inside XLA's callback).
_INTERFACE = "flash_attn.cute.interface"
_REQUIRED_KEYWORDS = {
    "_flash_attn_fwd": ("softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "num_splits",
                        "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                        "out", "lse"),
    "_flash_attn_bwd": ("softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
                        "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k",
                        "deterministic", "dq", "dk", "dv"),
}


# ================================================================================================
# Availability (what only the JAX frontend knows; the backend class has the rest)
# ================================================================================================


def _interface():
    return importlib.import_module(_INTERFACE)


@functools.lru_cache(maxsize=1)
def _import_error() -> Optional[str]:
    """Why flash-attn-4 cannot be called from JAX in this process (None when it can); tried once."""
    try:
        importlib.import_module("jax.experimental.buffer_callback")
    except ImportError as err:
        return f"jax {jax.__version__} has no jax.experimental.buffer_callback ({err})"
    try:  # before torch: a JAX process without flash-attn-4 never imports torch for this
        found = importlib.util.find_spec("flash_attn") is not None
    except ValueError:  # imported already, without a spec
        found = sys.modules.get("flash_attn") is not None
    except ImportError:
        found = False
    if not found:
        return "flash-attn-4 is not installed (pip install .[flash])"
    try:
        importlib.import_module("torch")
    except ImportError:
        return "torch is not installed (flash-attn-4 is a PyTorch package; JAX calls it through torch tensors)"
    try:
        interface = _interface()
    except ModuleNotFoundError as err:
        if err.name in ("flash_attn", "flash_attn.cute", _INTERFACE):
            return "flash-attn-4 is not installed (pip install .[flash])"
        return f"{_INTERFACE} failed to import: ModuleNotFoundError: {err}"
    except Exception as err:  # any import failure means the backend cannot run
        return f"{_INTERFACE} failed to import: {type(err).__name__}: {err}"
    for name, keywords in _REQUIRED_KEYWORDS.items():
        fn = getattr(interface, name, None)
        if fn is None:
            return f"{_INTERFACE} has no {name} (the JAX route calls flash-attn-4 4.0.0b36's internal entry points)"
        missing = [kw for kw in keywords if kw not in inspect.signature(fn).parameters]
        if missing:
            return f"{_INTERFACE}.{name} takes no {', '.join(missing)} (the JAX route follows flash-attn-4 4.0.0b36)"
    return None


def unavailable_reason() -> Optional[str]:
    """None when flash-attn-4 can run from JAX here, else why not: torch must see a CUDA device (it shares
    JAX's), and the packages must import. Only asked on an NVIDIA GPU that the backend class accepts, so a
    machine without one never imports torch or the CuTe DSL for this."""
    reason = _import_error()
    if reason:
        return reason
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device (flash-attn-4 runs through torch on the GPU JAX uses)"
    return None


def availability_reasons(device_type: str, vendor: str, compute_capability: Optional[Tuple[int, int]],
                         context_parallel_axis: bool, top_left_causal_lengths_may_differ: bool) -> List[str]:
    """Reasons ``fused_attn`` cannot run a call on flash-attn-4 that the backend class cannot see:
    context parallelism (the fused primitives run it), a top-left causal padding mask whose key lengths
    may differ from the query lengths (flash-attn-4 aligns causal masks bottom-right; PyTorch checks the
    lengths on the host, under ``jit`` they are not known), and whether the packages run here."""
    reasons = []
    if context_parallel_axis:
        reasons.append("context parallelism (context_parallel_axis) runs on the fused primitives only")
    if top_left_causal_lengths_may_differ:
        reasons.append("top-left causal padding mask with key/value lengths that may differ from the query lengths "
                       "(separate arrays in the SequenceDescriptor): flash-attn-4 aligns causal masks bottom-right; "
                       "pass one array for both, or use padding_causal_bottom_right")
    if (device_type == "cuda" and vendor == "nvidia" and compute_capability is not None
            and compute_capability[0] in FlashAttention.SUPPORTED_ARCHS):
        unavailable = unavailable_reason()
        if unavailable:
            reasons.append(unavailable)
    return reasons


# ================================================================================================
# Static arguments
# ================================================================================================


@dataclass(frozen=True)
class FlashStatic:
    """What a call passes flash-attn-4 besides tensors (the same values the PyTorch backend passes)."""

    varlen: bool  # the varlen call on packed tokens (padding masks, THD), else the dense one
    causal: bool  # bottom-right causal (flash-attn-4's only alignment)
    window_left: Optional[int]  # None: unbounded
    window_right: Optional[int]
    softmax_scale: float  # positive: q carries the sign (validation.kernel_scale)
    deterministic: bool
    top_left: bool = False  # a top-left causal mask: keys past s_q are hidden from a dense call
    checkpoint_name: str = "context"


def flash_static(static) -> Tuple[FlashStatic, float]:
    """``(FlashStatic, q_factor)`` of a call's fused-attention static arguments (``FusedAttnStatic``):
    ``q`` is multiplied by ``q_factor`` first when the scale is not positive, as the fused path does."""
    mask = AttnMaskType(static.attn_mask_type)
    left, right = FlashAttention.window_arguments(mask, static.window_size)
    q_factor, scale = kernel_scale(static.scaling_factor)
    varlen = mask.is_padding() or QKVFormat(static.qkv_format) == QKVFormat.THD
    return FlashStatic(varlen=varlen, causal=mask.is_causal(), window_left=left, window_right=right,
                       softmax_scale=float(scale), deterministic=bool(static.deterministic),
                       top_left=mask.is_top_left_causal(), checkpoint_name=static.checkpoint_name), q_factor


# ================================================================================================
# Implementation: the callbacks XLA runs (torch on XLA's buffers and stream)
# ================================================================================================

_KDL_CPU = 1
# XLA runs the callbacks of a multi-device program on one thread per device. flash-attn-4's compile caches,
# the CuTe DSL compiler and Triton's launcher (and its interpreter) are not known to be thread-safe: one call
# at a time. Launches are asynchronous, so this serializes host work only.
_CALL_LOCK = threading.Lock()


@contextlib.contextmanager
def _on_xla_stream(ctx, buffer):
    """Torch's current device and stream are XLA's for the block (GPU buffers; nothing to set on CPU, for
    tests), one callback at a time."""
    import torch

    device_type, device_id = buffer.__dlpack_device__()
    with _CALL_LOCK:
        if device_type == _KDL_CPU:
            yield
            return
        device = torch.device("cuda", device_id)
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=device)):
            yield


def _tensors(*buffers):
    import torch

    return [None if b is None else torch.from_dlpack(b) for b in buffers]


def _options(static: FlashStatic) -> dict:
    return dict(softmax_scale=static.softmax_scale, causal=static.causal, window_size_left=static.window_left,
                window_size_right=static.window_right, softcap=0.0)


def _packed(x):
    """``[b, s, h, d]`` as flash-attn's varlen ``[b * s, h, d]`` (a view)."""
    return x.view(x.shape[0] * x.shape[1], *x.shape[2:])


def _zero_outside(x, starts, used) -> None:
    from transformer_engine.common.attention.kernels.fill import zero_outside_sequences  # (imports Triton)

    zero_outside_sequences(x, starts, used)


def _fwd_callback(static: FlashStatic, ctx, results, q, k, v, cu_q=None, cu_k=None, used_q=None, used_k=None) -> None:
    with _on_xla_stream(ctx, q):
        tq, tk, tv, cu_q, cu_k, used_q, used_k = _tensors(q, k, v, cu_q, cu_k, used_q, used_k)
        out, lse = _tensors(*results)
        interface = _interface()
        if not static.varlen:
            interface._flash_attn_fwd(tq, tk, tv, **_options(static), num_splits=1, out=out, lse=lse)
            return
        out = _packed(out)
        interface._flash_attn_fwd(
            _packed(tq), _packed(tk), _packed(tv), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
            seqused_k=used_k, max_seqlen_q=tq.shape[1], max_seqlen_k=tk.shape[1], **_options(static), num_splits=1,
            out=out, lse=lse.view(lse.shape[0], -1))
        _zero_outside(out, cu_q, used_q)


def _bwd_callback(static: FlashStatic, ctx, results, q, k, v, out, dout, lse, cu_q=None, cu_k=None, used_q=None,
                  used_k=None) -> None:
    with _on_xla_stream(ctx, q):
        tq, tk, tv, out, dout, lse, cu_q, cu_k, used_q, used_k = _tensors(
            q, k, v, out, dout, lse, cu_q, cu_k, used_q, used_k)
        dq, dk, dv = _tensors(*results)
        interface = _interface()
        if not static.varlen:
            interface._flash_attn_bwd(tq, tk, tv, out, dout, lse, **_options(static),
                                      deterministic=static.deterministic, dq=dq, dk=dk, dv=dv)
            return
        dq, dk, dv = _packed(dq), _packed(dk), _packed(dv)
        interface._flash_attn_bwd(
            _packed(tq), _packed(tk), _packed(tv), _packed(out), _packed(dout), lse.view(lse.shape[0], -1),
            **_options(static), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
            max_seqlen_q=tq.shape[1], max_seqlen_k=tk.shape[1], deterministic=static.deterministic, dq=dq, dk=dk,
            dv=dv)
        _zero_outside(dq, cu_q, used_q)
        _zero_outside(dk, cu_k, used_k)
        _zero_outside(dv, cu_k, used_k)


# ================================================================================================
# The calls (buffer_callback: one custom call each; under vmap each instance is called in turn)
# ================================================================================================


def _buffer_callback(callback, results):
    from jax.experimental.buffer_callback import buffer_callback

    return buffer_callback(callback, results, vmap_method="sequential")


@functools.lru_cache(maxsize=None)
def _callbacks(static: FlashStatic):
    """The (forward, backward) callbacks of ``static``: one object per configuration, so that an eager call
    finds the executable compiled for the last one (the callback is part of what JAX caches it by)."""
    return functools.partial(_fwd_callback, static), functools.partial(_bwd_callback, static)


def _lse_shape(static: FlashStatic, q) -> Tuple[int, ...]:
    b, s_q, h = q.shape[:3]
    return (h, b, s_q) if static.varlen else (b, h, s_q)


def _vary_like(results, operands):
    """``results`` made to vary over the manual mesh axes the operands vary over (inside ``shard_map``): a
    callback's results carry no such type, and the custom_vjp's cotangents must have their primals' type.
    Identity outside shard_map."""
    axes = frozenset().union(*(jax_compat.varying_axes(jax.typeof(x)) for x in operands))
    if not axes:
        return results

    def vary(x):
        missing = tuple(sorted(axes - jax_compat.varying_axes(jax.typeof(x))))
        if not missing:
            return x
        return jax.lax.pcast(x, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(x, missing)

    return tuple(vary(x) for x in results)


def _fwd(static: FlashStatic, q, k, v, seqs):
    results = (jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype),
               jax.ShapeDtypeStruct(_lse_shape(static, q), jnp.float32))
    out = _buffer_callback(_callbacks(static)[0], results)(q, k, v, *seqs)
    return _vary_like(out, (q, k, v, *seqs))


def _bwd(static: FlashStatic, q, k, v, out, dout, lse, seqs):
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    grads = _buffer_callback(_callbacks(static)[1], results)(q, k, v, out, dout, lse, *seqs)
    return _vary_like(grads, (q, k, v, out, dout, lse, *seqs))


# ================================================================================================
# custom_vjp
# ================================================================================================


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(static: FlashStatic, q, k, v, seqs):
    return _flash_fwd_rule(static, q, k, v, seqs)[0]


def _flash_fwd_rule(static: FlashStatic, q, k, v, seqs):
    out, lse = _fwd(static, q, k, v, seqs)
    out = checkpoint_name(out, static.checkpoint_name)
    lse = checkpoint_name(lse, static.checkpoint_name)
    return out, (q, k, v, seqs, out, lse)


def _flash_bwd_rule(static: FlashStatic, residuals, dout):
    q, k, v, seqs, out, lse = residuals
    dq, dk, dv = _bwd(static, q, k, v, out, dout, lse, seqs)
    return dq, dk, dv, tuple(None for _ in seqs)


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


# ================================================================================================
# Public function
# ================================================================================================


def _sequences(static: FlashStatic, q, k, seq: SeqInfo):
    """flash-attn's ``(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)`` of the local rows: segment ``j`` of
    row ``r`` starts at token ``r * s + offset[r, j]``; the last entry is the number of tokens. ``()`` for the
    dense call."""
    if not static.varlen:
        return ()
    b = q.shape[0]
    m = seq.q_seqlens.shape[1]
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]

    def starts(offsets, s):
        first = (rows * s + offsets[:, :m].astype(jnp.int32)).reshape(-1)
        return jnp.concatenate([first, jnp.full((1,), b * s, jnp.int32)])

    return (starts(seq.q_offsets, q.shape[1]), starts(seq.kv_offsets, k.shape[1]),
            seq.q_seqlens.astype(jnp.int32).reshape(-1), seq.kv_seqlens.astype(jnp.int32).reshape(-1))


def _local_attention(static: FlashStatic, q, k, v, seq: SeqInfo):
    s_q = q.shape[1]
    if static.top_left and not static.varlen and k.shape[1] > s_q:
        # Keys past s_q are never visible under a top-left causal mask: there it equals bottom-right.
        k, v = k[:, :s_q], v[:, :s_q]
    # Inside shard_map: one manual-axes type for all operands, so that each cotangent has its primal's
    # type (the cast's transpose sums a replicated operand's cotangent over the axes).
    q, k, v, seqs = operands_vary_alike(q, k, v, _sequences(static, q, k, seq))
    return _flash(static, q, k, v, seqs)


def flash_attention(q, k, v, seq: SeqInfo, static) -> jax.Array:
    """Attention of canonical BSHD ``q``, ``k``, ``v`` (``seq``: the per-row segments) on flash-attn-4, with
    ``static`` the call's ``FusedAttnStatic``; differentiable in q, k and v. Returns ``[b, s_q, h_q, d_v]``,
    zeros at padded positions."""
    flash, q_factor = flash_static(static)
    if q_factor != 1.0:
        q = q * jnp.asarray(q_factor, q.dtype)
    seq = SeqInfo(*(x.astype(jnp.int32) for x in seq))
    run = functools.partial(_local_attention, flash)
    meshes = context_parallel._current_meshes()
    if not meshes or context_parallel._manual_axes():
        return run(q, k, v, seq)
    mesh = meshes[0]
    resource = global_mesh_resource()
    batch = context_parallel._divisible_axes(batch_axes(resource), mesh, q.shape[0])
    heads = context_parallel._divisible_axes(head_axes(resource), mesh, q.shape[2], k.shape[2])
    spec = PartitionSpec(batch, None, heads, None)
    seq_spec = SeqInfo(*(PartitionSpec(batch, None) for _ in seq))
    return jax.shard_map(run, mesh=mesh, in_specs=(spec, spec, spec, seq_spec), out_specs=spec)(q, k, v, seq)
