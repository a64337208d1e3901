"""FP8 attention on the project's Triton kernels (kernels/fp8.py): launches, one autograd.Function, a
functional entry point with explicit scales.

Scales follow TransformerEngine: ``x_fp8 = saturate(x * scale)`` and ``x ~ x_fp8 * scale_inv``. The launches
take the descale factors (``scale_inv``) of Q, K, V and dO as one fp32 device array (no host sync). Amaxes are
written into a caller's fp32 array by the names of :data:`AMAX_SLOTS` (maxima: order-free, deterministic).

Determinism: the forward and the FP8 backward are bitwise reproducible (fixed tiles from
``common.attention.fp8.fp8_plan``, fixed summation orders, no atomics but the amax maxima).
``NVTE_FP8_DPA_BWD=0`` (or ``fp8_backward=False``) runs the backward on the bf16/fp16 fused kernels
(``ops.backward``, deterministic too) from the dequantized Q, K, V, the FP8 forward's output and its
log-sum-exp, as TransformerEngine does.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from transformer_engine.common import settings
from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, QKVFormat
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.fp8 import (
    FP8_DTYPES, backward_dtype_name, explain_fp8, fp8_reasons,
)
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.validation import check_softmax_scale
from transformer_engine.common.quantization import FP8_MAX, scale_from_current_amax
from transformer_engine.common.quantizer_roles import Scaling, quantizers_for
from transformer_engine.pytorch.quantization import amax_of, cast_to_fp8
from transformer_engine.pytorch.attention.call import AttnCall
from transformer_engine.pytorch.attention.config import check_cu_seqlens, qkv_dims, triton_interpreting
from transformer_engine.pytorch.attention.fp8_launch import fp8_arch
from transformer_engine.pytorch.attention.kernel_runner import sequences

__all__ = ["AMAX_SLOTS", "FWD_SLOTS", "BWD_SLOTS", "Fp8AttnMeta", "Fp8AttnFunc", "Fp8AttentionState", "fp8_attn_func",
           "fp8_attn_call", "fp8_attn_forward", "fp8_attn_backward", "quantize", "fp8_arch", "FLOAT8_DTYPES",
           "sequence_amax", "per_token", "FP8_DPA_SCALINGS"]

_LOGGER = logging.getLogger("transformer_engine")
# Where each amax lands in the fp32 array a call records into.
AMAX_SLOTS = {"q": 0, "k": 1, "v": 2, "o": 3, "s": 4, "dp": 5, "do": 6, "dq": 7, "dk": 8, "dv": 9}
FLOAT8_DTYPES = {getattr(torch, name): fmt for fmt, name in FP8_DTYPES.items()}


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` in the FP8 ``dtype`` (round to nearest even; +-max where it overflows)."""
    return cast_to_fp8(x.float() * scale, FLOAT8_DTYPES[dtype])


def _token_sequence(seqs, side: str, tokens: int) -> torch.Tensor:
    """thd: the sequence of each packed token (``seqs.batch`` for a token in no sequence: a gap)."""
    start, length = (seqs.start_q, seqs.len_q) if side == "q" else (seqs.start_k, seqs.len_k)
    pos = torch.arange(tokens, device=start.device, dtype=torch.int64)
    idx = torch.searchsorted(start.to(torch.int64), pos, right=True) - 1
    safe = idx.clamp(min=0)
    inside = (idx >= 0) & (pos < start.to(torch.int64)[safe] + length.to(torch.int64)[safe])
    return torch.where(inside, safe, torch.full_like(safe, seqs.batch))


def sequence_amax(x: torch.Tensor, fmt: QKVFormat, seqs, side: str, hk: int) -> torch.Tensor:
    """max |x| per sequence and kv head (a query head counts for its kv head), fp32 [batch, h_kv], over each
    sequence's own tokens only (padding and gaps excluded): a maximum, so the same whatever else is in the
    batch or pack."""
    a = x.detach().abs().amax(-1).to(torch.float32)  # [..., h]
    a = a.reshape(*a.shape[:-1], hk, a.shape[-1] // hk).amax(-1)  # [..., h_kv]
    if fmt == QKVFormat.THD:
        idx = _token_sequence(seqs, side, a.shape[0])
        out = torch.zeros(seqs.batch + 1, hk, dtype=torch.float32, device=x.device)
        out = out.scatter_reduce(0, idx[:, None].expand(-1, hk), a, "amax", include_self=True)
        return out[:seqs.batch]
    if fmt == QKVFormat.SBHD:
        a = a.transpose(0, 1)  # [b, s, h_kv]
    length = seqs.len_q if side == "q" else seqs.len_k
    if length is not None:
        pos = torch.arange(a.shape[1], device=a.device)
        a = torch.where((pos[None, :] < length[:, None])[..., None], a, torch.zeros((), device=a.device))
    return a.amax(1)


def per_token(scale: torch.Tensor, x: torch.Tensor, fmt: QKVFormat, seqs, side: str) -> torch.Tensor:
    """A per-sequence, per-kv-head ``scale`` [batch, h_kv] broadcast to ``x``'s layout ([..., h, 1]); a 0-d
    per-tensor scale as it is."""
    if scale.dim() == 0:
        return scale
    h = x.shape[-2]
    s = scale.repeat_interleave(h // scale.shape[1], dim=1)  # [batch, h]
    if fmt == QKVFormat.THD:
        idx = _token_sequence(seqs, side, x.shape[0])
        s = torch.cat([s, torch.ones(1, h, dtype=s.dtype, device=s.device)])[idx]  # [t, h]
        return s[:, :, None]
    if fmt == QKVFormat.SBHD:
        return s[None, :, :, None]
    return s[:, None, :, None]


def fp8_attn_forward(q8, k8, v8, descale: torch.Tensor, call: AttnCall, out_dtype: torch.dtype,
                     amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of FP8 attention on E4M3 ``q8, k8, v8`` (``call``'s format), ``descale`` fp32 [4] or
    [batch, h_kv, 4] (q, k, v, dO descales per tensor, or per sequence and kv head; dO's unused here). Writes the
    amaxes of O and of the softmax (its largest probability) into ``amax`` (fp32, :data:`AMAX_SLOTS`) when given.
    The launches are ``launch_description.fp8_forward_launches`` through the launch cache, behind the custom op
    ``transformer_engine::fp8_attn_fwd`` (ops.py) when traced."""
    from transformer_engine.pytorch.attention import ops

    out, lse, fwd_amax = ops.fp8_forward(q8, k8, v8, descale, call, out_dtype)
    if amax is not None:
        amax[AMAX_SLOTS["o"]] = fwd_amax[0]
        amax[AMAX_SLOTS["s"]] = fwd_amax[1]
    return out, lse


def fp8_attn_backward(q8, k8, v8, out, do8, lse, descale: torch.Tensor, call: AttnCall, grad_dtype: torch.dtype,
                      amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in ``grad_dtype`` of FP8 attention from E4M3 q8, k8, v8, the forward's ``out`` and ``lse``,
    and dO in FP8 (E5M2 or E4M3) ``do8``; ``descale`` fp32 [4] or [batch, h_kv, 4] (q, k, v, dO). dS stays in
    fp32 and meets Q, K in ``grad_dtype`` (kernels/fp8.py). Records the amax of dS (TransformerEngine's dP) into
    ``amax``. The launches are ``launch_description.fp8_backward_launches`` through the launch cache, behind the
    custom op ``transformer_engine::fp8_attn_bwd`` (ops.py) when traced."""
    from transformer_engine.pytorch.attention import ops

    dq, dk, dv, bwd_amax = ops.fp8_backward(q8, k8, v8, out, do8, lse, descale, call, grad_dtype)
    if amax is not None:
        amax[AMAX_SLOTS["dp"]] = bwd_amax[2]
        for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
            amax[AMAX_SLOTS[name]] = g.abs().amax().float()
    return dq, dk, dv


# The delayed-scaling state of a module's FP8 attention: which AMAX_SLOTS entries each direction's meta holds.
FWD_SLOTS = ("q", "k", "v", "o", "s")
BWD_SLOTS = ("do", "dp", "dq", "dk", "dv")


@dataclass(frozen=True)
class Fp8AttnMeta:
    """One FP8 attention call's scaling (a plain value, passed whole): fp32 ``q_scale``, ``k_scale``,
    ``v_scale``, each 0-d (one scale per tensor) or [batch, h_kv] (per sequence and kv head); ``d_out_scale``
    (None: current scaling from dO's own amax, per sequence and kv head when q's scale is); dO's FP8 dtype;
    whether the backward runs in FP8; ``amax``: an fp32 array the call writes its amaxes into
    (:data:`AMAX_SLOTS`), or None. A module's delayed scaling adds its metas: ``fwd_meta`` / ``bwd_meta``
    (``DelayedScalingMeta`` over :data:`FWD_SLOTS` / :data:`BWD_SLOTS`; None: record nothing, as a recompute)
    take this call's amaxes, and ``reduce_bwd`` (the first FP8 module of the forward, whose backward runs last)
    updates every registered backward meta at the end of its backward."""

    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    d_out_scale: Optional[torch.Tensor] = None
    d_out_dtype: torch.dtype = torch.float8_e5m2
    fp8_backward: bool = True
    amax: Optional[torch.Tensor] = None
    fwd_meta: Optional[object] = None
    bwd_meta: Optional[object] = None
    reduce_bwd: bool = False
    # Per-tensor current scaling under a2a context parallelism: the process group whose ranks hold the other
    # heads; dO's amax is all-reduced (MAX) over it, so the scale is the single-device one.
    amax_group: Optional[object] = None

    @property
    def per_sequence(self) -> bool:
        return self.q_scale.dim() == 2


def _record(amax: Optional[torch.Tensor], name: str, x: torch.Tensor) -> None:
    if amax is not None:
        amax[AMAX_SLOTS[name]] = x.detach().abs().amax().float()


def _fold(meta, amax: Optional[torch.Tensor], names) -> None:
    """This call's amaxes into a delayed-scaling meta's current row (a max over the step's calls)."""
    if meta is not None and amax is not None:
        for i, name in enumerate(names):
            meta.record_amax(i, amax[AMAX_SLOTS[name]])


def _group_max(amax: torch.Tensor, group) -> torch.Tensor:
    """``amax`` all-reduced (MAX: exact in any order) over ``group``; as it is without one."""
    if group is not None:
        amax = amax.clone()
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _descales(scales, batch: int, hk: int) -> torch.Tensor:
    """The kernels' DESCALE from (q, k, v, dO) scales: fp32 [4] when all are per tensor, else [batch, h_kv, 4]."""
    inv = [1.0 / x.float() for x in scales]
    if all(x.dim() == 0 for x in inv):
        return torch.stack([x.reshape(()) for x in inv])
    return torch.stack([x.expand(batch, hk) for x in inv], dim=-1).contiguous()


class Fp8AttnFunc(torch.autograd.Function):
    """FP8 attention on high-precision q, k, v: quantized here with the meta's scales (straight-through:
    gradients are those of the quantized function, returned for the high-precision inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, meta: Fp8AttnMeta, call: AttnCall):
        e4m3 = torch.float8_e4m3fn
        fmt = call.params.qkv_format
        seqs = sequences(q, k, call) if meta.per_sequence else None
        amax = meta.amax
        if amax is None and (meta.fwd_meta is not None or meta.bwd_meta is not None):
            amax = torch.zeros(len(AMAX_SLOTS), dtype=torch.float32, device=q.device)
        for name, x in (("q", q), ("k", k), ("v", v)):
            _record(amax, name, x)
        q8 = quantize(q, per_token(meta.q_scale, q, fmt, seqs, "q"), e4m3)
        k8 = quantize(k, per_token(meta.k_scale, k, fmt, seqs, "k"), e4m3)
        v8 = quantize(v, per_token(meta.v_scale, v, fmt, seqs, "k"), e4m3)
        if meta.per_sequence:
            batch, hk = meta.q_scale.shape
            descale = _descales((meta.q_scale, meta.k_scale, meta.v_scale, torch.ones((), device=q.device)),
                                batch, hk)
        else:
            descale = torch.stack([1.0 / meta.q_scale.float().reshape(()), 1.0 / meta.k_scale.float().reshape(()),
                                   1.0 / meta.v_scale.float().reshape(()), torch.ones((), device=q.device)])
        out, lse = fp8_attn_forward(q8, k8, v8, descale, call, q.dtype, amax)
        _fold(meta.fwd_meta, amax, FWD_SLOTS)
        ctx.save_for_backward(q8, k8, v8, out, lse, descale, *call.tensors)
        ctx.meta, ctx.params, ctx.dtype, ctx.amax = meta, call.params, q.dtype, amax
        return out

    @staticmethod
    def backward(ctx, d_out):
        q8, k8, v8, out, lse, descale, *tensors = ctx.saved_tensors
        call = AttnCall.of_tensors(ctx.params, tensors)
        meta, amax = ctx.meta, ctx.amax
        fmt = ctx.params.qkv_format
        seqs = sequences(q8, k8, call) if meta.per_sequence else None
        if not meta.fp8_backward:
            from transformer_engine.pytorch.attention import ops

            if descale.dim() == 1:
                deq = [(x.float() * descale[i]).to(ctx.dtype) for i, x in enumerate((q8, k8, v8))]
            else:
                deq = [(x.float() * per_token(descale[..., i], x, fmt, seqs, side)).to(ctx.dtype)
                       for i, (x, side) in enumerate(((q8, "q"), (k8, "k"), (v8, "k")))]
            dq, dk, dv, _, _ = ops.backward(*deq, out, d_out.contiguous(), lse, call)
        else:
            _record(amax, "do", d_out)
            fp8_fmt = FLOAT8_DTYPES[meta.d_out_dtype]
            if meta.d_out_scale is not None:
                d_scale = meta.d_out_scale.float()
                d_scale = d_scale.reshape(()) if d_scale.numel() == 1 else d_scale
            elif meta.per_sequence:
                d_scale = scale_from_current_amax(torch, sequence_amax(d_out, fmt, seqs, "q", k8.shape[-2]),
                                                  FP8_MAX[fp8_fmt])
            else:
                d_scale = scale_from_current_amax(torch, _group_max(amax_of(d_out.detach()), meta.amax_group),
                                                  FP8_MAX[fp8_fmt])
            do8 = quantize(d_out, per_token(d_scale, d_out, fmt, seqs, "q"), meta.d_out_dtype)
            if descale.dim() == 1 and d_scale.dim() == 0:
                descale = torch.cat([descale[:3], (1.0 / d_scale).reshape(1)])
            else:
                batch, hk = (descale.shape[0], descale.shape[1]) if descale.dim() == 3 else d_scale.shape
                full = descale.expand(batch, hk, 4) if descale.dim() == 1 else descale
                descale = torch.cat([full[..., :3], (1.0 / d_scale).expand(batch, hk)[..., None]], dim=-1)
            dq, dk, dv = fp8_attn_backward(q8, k8, v8, out, do8, lse, descale, call, ctx.dtype, amax)
        _fold(meta.bwd_meta, amax, BWD_SLOTS)
        if meta.reduce_bwd:
            from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

            # The first FP8 module of the forward runs its backward last: the step's backward amaxes are in.
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return dq, dk, dv, None, None


def _scale_tensor(name: str, value, device, per_sequence: Tuple[int, int]) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.numel() == 1:
        t = t.reshape(())
    elif tuple(t.shape) != tuple(per_sequence):
        raise ValueError(f"`{name}` must be one per-tensor scale (a float or a 1-element tensor) or one per sequence "
                         f"and kv head {tuple(per_sequence)}, got shape {tuple(t.shape)}")
    # A number or a host tensor is checked here; a device tensor (a recipe's scale) is not read back: no host sync.
    # Traced (torch.compile), a tensor's values are not read either.
    checkable = not isinstance(value, torch.Tensor) or (value.device.type == "cpu"
                                                         and not torch.compiler.is_compiling())
    if checkable and not (
            bool(torch.isfinite(t).all()) and bool((t > 0).all())):
        raise ValueError(f"`{name}` must be finite and positive, got {t.tolist()}")
    return t


def fp8_attn_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    qkv_format: str = "bshd", attn_mask_type: str = "no_mask", window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None, *,
    q_scale, k_scale, v_scale, d_out_scale=None, fp8_format: str = "HYBRID", fp8_backward: Optional[bool] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None, cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
    bottom_right_diagonal: Optional[bool] = None, amax: Optional[torch.Tensor] = None,
) -> Tuple[Fp8AttnMeta, AttnCall]:
    """The checked (scaling, call) values of :func:`fp8_attn_func`'s arguments, for ``Fp8AttnFunc.apply``.

    FP8 attention with explicit scales on the Triton kernels.

    ``q, k, v``: high-precision tensors (bf16/fp16 on a GPU; fp32/fp16 under TRITON_INTERPRET=1) in
    ``qkv_format`` (bshd [b, s, h, d], sbhd [s, b, h, d], thd [t, h, d] with ``cu_seqlens_*``). They are
    quantized to E4M3 as ``saturate(x * scale)`` with ``q_scale``, ``k_scale``, ``v_scale``: floats or 1-element
    fp32 tensors (one scale per tensor), or fp32 [batch, h_kv] tensors (one per sequence and kv head, a query
    head taking its kv head's; flash-attn 3's descale layout); the output has q's dtype. Query head i uses kv
    head ``i // (h_q // h_kv)``. Masks as
    :func:`fused_attn_func`: no_mask, padding, causal, padding_causal, the bottom-right causal masks and sliding
    windows. Backward: dO quantized to E5M2 under ``fp8_format="HYBRID"``, E4M3 under ``"E4M3"``, with
    ``d_out_scale`` (None: current scaling from dO's amax, per sequence and kv head when the scales are).
    ``fp8_backward`` None reads NVTE_FP8_DPA_BWD (0: the
    bf16/fp16 kernels' backward). ``amax``: an fp32 tensor of at least len(AMAX_SLOTS) the call writes
    its amaxes into. Deterministic: bitwise run to run.
    """
    fmt = QKVFormat(qkv_format)
    mask = AttnMaskType(attn_mask_type)
    for name, x in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"`{name}` must be a high-precision tensor (float32, float16 or bfloat16) quantized "
                             f"here with its scale, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"`query_layer`, `key_layer`, `value_layer` must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if q.device.type == "cpu" and (q.dtype == torch.bfloat16 or not triton_interpreting()):
        # Both requirements of the CPU at once: a caller fixing one should not meet the other next.
        raise NotImplementedError(
            "FP8 attention on CPU tensors runs under Triton's interpreter: it needs TRITON_INTERPRET=1 (set before "
            "Python starts) and `query_layer` in float16 or float32 (the interpreter's bfloat16 products are "
            f"wrong), got TRITON_INTERPRET={'1' if triton_interpreting() else 'unset or 0'} and {q.dtype}")
    hq, hk = q.shape[-2], k.shape[-2]
    if k.shape[-2] != v.shape[-2] or hq % hk:
        raise ValueError(f"`key_layer` and `value_layer` must have the same number of heads dividing the query's "
                         f"{hq}, got {hk} and {v.shape[-2]}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    softmax_scale = check_softmax_scale(softmax_scale)
    if softmax_scale <= 0:
        raise NotImplementedError(f"`softmax_scale` must be positive for FP8 attention, got {softmax_scale}")
    reasons = fp8_reasons(attn_mask_type=mask, attn_bias_type=AttnBiasType.NO_BIAS, dropout=0.0,
                          softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX, head_dim_qk=q.shape[-1],
                          head_dim_v=v.shape[-1])
    if reasons:
        raise NotImplementedError("FP8 attention cannot run this call: " + "; ".join(reasons))
    d_out_dtype = getattr(torch, backward_dtype_name(fp8_format))
    if fp8_backward is None:
        fp8_backward = bool(settings.get("NVTE_FP8_DPA_BWD"))
    window = normalize_window(window_size, mask)
    bottom_right = resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "pytorch")
    if fmt == QKVFormat.THD:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format='thd'")
        batch = None
        if max_seqlen_q is None or max_seqlen_kv is None:
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
            max_seqlen_kv = int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max().item())
    else:
        batch = qkv_dims(q, fmt)[0]
        if not mask.is_padding():
            cu_seqlens_q = cu_seqlens_kv = None
        elif cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must be given for attn_mask_type={mask.value!r}")
        cu_seqlens_q_padded = cu_seqlens_kv_padded = None
        max_seqlen_q = max_seqlen_kv = None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                     ("cu_seqlens_q_padded", cu_seqlens_q_padded), ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
        check_cu_seqlens(name, cu, batch, q.device)
    if amax is not None and (amax.dtype != torch.float32 or amax.numel() < len(AMAX_SLOTS)):
        raise ValueError(f"`amax` must be an fp32 tensor of at least {len(AMAX_SLOTS)} elements, got {amax.dtype} "
                         f"{tuple(amax.shape)}")
    dev = q.device
    nseq = cu_seqlens_q.shape[0] - 1 if fmt == QKVFormat.THD else batch
    scales = [None if value is None and name == "d_out_scale" else _scale_tensor(name, value, dev, (nseq, hk))
              for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale),
                                  ("d_out_scale", d_out_scale))]
    if len({x.dim() for x in scales[:3]}) != 1:
        raise ValueError("`q_scale`, `k_scale` and `v_scale` must all be per tensor or all per sequence and kv "
                         f"head, got shapes {[tuple(x.shape) for x in scales[:3]]}")
    meta = Fp8AttnMeta(*scales, d_out_dtype, bool(fp8_backward), amax)
    params = AttnParams(attn_mask_type=mask, attn_bias_type=AttnBiasType.NO_BIAS, qkv_format=fmt, window_size=window,
                        scaling_factor=softmax_scale, deterministic=True, bottom_right_diagonal=bottom_right,
                        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
    call = AttnCall(params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded)
    return meta, call


def fp8_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """FP8 attention with explicit scales (per tensor, or per sequence and kv head) on the Triton kernels:
    the arguments and their meaning are :func:`fp8_attn_call`'s."""
    return Fp8AttnFunc.apply(q, k, v, *fp8_attn_call(q, k, v, *args, **kwargs))


class _Scales:
    """The delayed scales one attention call used, as activation recompute keeps them for its replay."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def frozen(self) -> "_Scales":
        return _Scales(self.scale.clone())


class Fp8AttentionState:
    """A DotProductAttention's delayed-scaling state, as a linear module's (``LinearFP8State``): a forward
    ``DelayedScalingMeta`` over :data:`FWD_SLOTS` and a backward one over :data:`BWD_SLOTS`, registered in
    FP8GlobalStateManager's buffer with the modules' metas, so they are reduced over the amax group and
    updated with them (forward at the outermost autocast's exit, backward at the end of the first FP8
    module's backward). Saved as the module's extra state (``module/_extra_state.py`` layout)."""

    def __init__(self) -> None:
        self.fwd_meta = None
        self.bwd_meta = None
        self.steps = 0  # forward calls that recorded amaxes

    def metas(self, recipe, device: torch.device):
        from transformer_engine.pytorch.quantization import DelayedScalingMeta

        if self.fwd_meta is None:
            self.fwd_meta = DelayedScalingMeta(len(FWD_SLOTS), recipe, True, device)
            self.bwd_meta = DelayedScalingMeta(len(BWD_SLOTS), recipe, False, device)
        else:
            if self.fwd_meta.scale.device != device:  # moved, or loaded before the move: the state follows
                for meta in (self.fwd_meta, self.bwd_meta):
                    meta.scale, meta.amax_history = meta.scale.to(device), meta.amax_history.to(device)
            self.fwd_meta.set_recipe(recipe)
            self.bwd_meta.set_recipe(recipe)
        return self.fwd_meta, self.bwd_meta


def attention_scaling(recipe) -> Scaling:
    """How FP8 attention scales Q, K, V under ``recipe``: its input role's scaling kind
    (common.quantizer_roles), read as the linear modules read it."""
    return quantizers_for(recipe).input.scaling


def attention_state(module) -> Fp8AttentionState:
    """``module``'s FP8 attention state (made on first use)."""
    state = module.__dict__.get("_fp8_attention_state")
    if state is None:
        state = module.__dict__["_fp8_attention_state"] = Fp8AttentionState()
    return state


FP8_DPA_SCALINGS = ("per_tensor", "per_sequence")


def dpa_fp8_attention(module, recipe, q, k, v, fmt: QKVFormat, seqs, window, bottom_right, bias_type, dropout,
                      softmax_type, context_parallel: bool, return_max_logit: bool, amax_group=None):
    """DotProductAttention's call under an autocast whose recipe has ``fp8_dpa=True``: the FP8 kernels, with
    scales from the module's delayed-scaling metas (DelayedScaling) or from this call's amaxes
    (Float8CurrentScaling: per tensor, or per sequence and kv head under ``fp8_dpa_scaling="per_sequence"``).
    ``amax_group``: the a2a context-parallel group whose ranks hold the other heads (per-tensor current
    scales then take the amaxes all-reduced over it: the single-device scales). Anything the FP8 kernels do not
    support is refused by name."""
    from transformer_engine.pytorch import distributed
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.recompute_frames import in_checkpointed_training_forward
    from transformer_engine.common.quantization import format_dtypes

    reasons = fp8_reasons(attn_mask_type=seqs.mask, attn_bias_type=bias_type, dropout=dropout,
                          softmax_type=softmax_type, head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1],
                          context_parallel=context_parallel, return_max_logit=return_max_logit)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"query_layer dtype {q.dtype} (FP8 attention quantizes bf16/fp16/fp32 inputs)")
    scaling = getattr(module, "fp8_dpa_scaling", None) or settings.get("NVTE_FP8_DPA_SCALING") or "per_tensor"
    if scaling not in FP8_DPA_SCALINGS:
        raise ValueError(f"`fp8_dpa_scaling` must be one of {FP8_DPA_SCALINGS}, got {scaling!r}")
    kind = attention_scaling(recipe)
    if scaling == "per_sequence" and kind is not Scaling.CURRENT:
        reasons.append(f"fp8_dpa_scaling='per_sequence' under {type(recipe).__name__} (per-sequence scales are "
                       "current scales: use Float8CurrentScaling(fp8_dpa=True))")
    if reasons:
        raise NotImplementedError("FP8 attention (the recipe's fp8_dpa=True) cannot run this call: "
                                  + "; ".join(reasons))
    # NVTE_DEBUG=1: why FP8 attention runs, and its plan (eager calls: a traced call logs nothing)
    if not torch.compiler.is_compiling() and _LOGGER.isEnabledFor(logging.INFO):
        _LOGGER.info("Selected backend = FusedAttention(FP8) (%s, %s scaling): %s", type(recipe).__name__, scaling,
                    explain_fp8(q.shape[-1], v.shape[-1], fp8_arch(q.device)))
    fwd_fmt, _ = format_dtypes(recipe.fp8_format)
    kw = dict(qkv_format=fmt.value, attn_mask_type=seqs.mask.value, window_size=window,
              softmax_scale=module.softmax_scale, fp8_format=recipe.fp8_format,
              cu_seqlens_q=seqs.cu_seqlens_q, cu_seqlens_kv=seqs.cu_seqlens_kv,
              cu_seqlens_q_padded=seqs.cu_seqlens_q_padded, cu_seqlens_kv_padded=seqs.cu_seqlens_kv_padded,
              max_seqlen_q=seqs.max_seqlen_q, max_seqlen_kv=seqs.max_seqlen_kv, bottom_right_diagonal=bottom_right)
    if kind is Scaling.DELAYED:
        state = attention_state(module)
        fwd_meta, bwd_meta = state.metas(recipe, q.device)
        # Activation recompute (transformer_engine.pytorch.checkpoint): the first call's scales, no amax record.
        replayed = distributed.replayed_fp8_plan(module, "attention")
        if replayed is not distributed.NOT_REPLAYING:
            sc, record = replayed.scale, None
        else:
            fwd_meta.group = bwd_meta.group = FP8GlobalStateManager.get_fp8_group()
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(fwd_meta, True)
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(bwd_meta, False)
            state.steps += 1
            sc, record = fwd_meta.scale, fwd_meta
            distributed.record_fp8_plan(module, "attention", _Scales(sc))
        training = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        # As the linear modules: the forward's first FP8 module updates the backward metas after its backward.
        first = (training or in_checkpointed_training_forward()) and FP8GlobalStateManager.is_first_fp8_module()
        meta, call = fp8_attn_call(q, k, v, q_scale=sc[0], k_scale=sc[1], v_scale=sc[2],
                                   d_out_scale=bwd_meta.scale[0], **kw)
        meta = dataclasses.replace(meta, fwd_meta=record, bwd_meta=bwd_meta, reduce_bwd=training and first)
        return Fp8AttnFunc.apply(q, k, v, meta, call)
    if kind is Scaling.CURRENT:
        fmax = FP8_MAX[fwd_fmt]
        if scaling == "per_sequence":
            meta, call = fp8_attn_call(q, k, v, q_scale=1.0, k_scale=1.0, v_scale=1.0, **kw)
            seq = sequences(q, k, call)
            hk = k.shape[-2]
            scales = [scale_from_current_amax(torch, sequence_amax(x, fmt, seq, side, hk), fmax)
                      for x, side in ((q, "q"), (k, "k"), (v, "k"))]
            meta = dataclasses.replace(meta, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2])
            return Fp8AttnFunc.apply(q, k, v, meta, call)
        scales = [scale_from_current_amax(torch, _group_max(amax_of(x.detach()), amax_group), fmax) for x in (q, k, v)]
        meta, call = fp8_attn_call(q, k, v, q_scale=scales[0], k_scale=scales[1], v_scale=scales[2], **kw)
        return Fp8AttnFunc.apply(q, k, v, dataclasses.replace(meta, amax_group=amax_group), call)
    raise NotImplementedError(f"FP8 attention takes DelayedScaling or Float8CurrentScaling recipes, got "
                              f"{type(recipe).__name__}")
