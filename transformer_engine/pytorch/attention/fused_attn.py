"""The fused attention function: one autograd.Function over the custom ops, on one AttnCall."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional, Tuple

import torch

from transformer_engine.common.attention import AttnBiasType, AttnMaskType, AttnSoftmaxType, FusedAttention, QKVFormat
from transformer_engine.common.attention.config import normalize_window, resolve_bottom_right_diagonal
from transformer_engine.common.attention.params import AttnParams
from transformer_engine.common.attention.validation import check_input_dtype, check_softmax_scale, kernel_scale
from transformer_engine.pytorch.attention import ops
from transformer_engine.pytorch.attention.call import AttnCall
from transformer_engine.pytorch.attention.config import (
    can_sync, check_cu_seqlens, check_qkv, check_sequence_values, dtype_name, qkv_dims, sequences_checked,
    triton_interpreting,
)

__all__ = ["fused_attn_func", "fused_attention", "FusedAttnFunc"]


class _FusedAttnGradsNoBackward(torch.autograd.Function):
    """Identity on the fused backward's gradients when the backward itself is recorded
    (``create_graph=True``): differentiating them raises a clear error instead of torch's "element 0 of
    tensors does not require grad". The fused kernels have no backward of their own backward."""

    @staticmethod
    def forward(ctx, count, *tensors):
        # tensors: the gradients, then the backward's inputs, which tie the gradients into the graph.
        return tensors[:count]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            "double backward (differentiating gradients taken with create_graph=True) through the fused "
            "attention backward (FusedAttnFunc, op transformer_engine::fused_attn_bwd) is not supported; "
            "run the attention unfused (NVTE_FUSED_ATTN_BACKEND=unfused) for higher-order gradients"
        )


class FusedAttnFunc(torch.autograd.Function):
    """Forward and backward of fused attention over the custom ops ``transformer_engine::fused_attn_fwd`` and
    ``transformer_engine::fused_attn_bwd``. Takes the differentiable tensors explicitly (q, k, v, and the
    call's bias and sink logits, which are ``call.bias`` and ``call.softmax_offset``) and the
    :class:`AttnCall` whole. Once differentiable: the gradients it returns have no backward (differentiating
    them again raises ``NotImplementedError``)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, softmax_offset, call: AttnCall):
        out, lse, max_logit = ops.forward(q, k, v, call)
        # The call's tensors by role go through save_for_backward (version checks, saved-tensor hooks).
        ctx.save_for_backward(q, k, v, out, lse, *call.tensors)
        ctx.params = call.params
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.offset_grad = softmax_offset is not None and softmax_offset.requires_grad
        ctx.mark_non_differentiable(lse, max_logit)
        # lse has no gradient: without this autograd would zero-fill one for it every backward.
        ctx.set_materialize_grads(False)
        return out, lse, max_logit

    @staticmethod
    def backward(ctx, d_out, _d_lse, _d_max_logit):
        if d_out is None:  # the output took no part in the loss (grads are not materialized)
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        call = AttnCall.of_tensors(ctx.params, tensors)
        dq, dk, dv, dbias, d_offset = ops.backward(q, k, v, out, d_out.contiguous(), lse, call, ctx.bias_grad,
                                                   ctx.offset_grad)
        grads = dict(q=dq, k=dk, v=dv, bias=dbias if ctx.bias_grad else None,
                     softmax_offset=d_offset if ctx.offset_grad else None)
        if torch.is_grad_enabled():  # backward(create_graph=True): the gradients could be differentiated
            names = [name for name, g in grads.items() if g is not None]
            inputs = [t for t in (q, k, v, d_out, call.bias, call.softmax_offset) if t is not None and t.requires_grad]
            grads.update(zip(names, _FusedAttnGradsNoBackward.apply(len(names), *(grads[n] for n in names), *inputs)))
        return tuple(grads.get(name) for name in _FUSED_ATTN_INPUTS)


# forward's inputs after ctx, by name: backward returns one gradient (or None) for each.
_FUSED_ATTN_INPUTS = tuple(inspect.signature(FusedAttnFunc.forward).parameters)[1:]


def new_rng_state(device: torch.device) -> torch.Tensor:
    """int64 [seed, offset] drawn from the current torch generator of ``device`` (so manual_seed
    and RNG trackers reproduce it); the kernels key dropout on it."""
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64, device=device)])


def fused_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qkv_format: str,
    attn_mask_type: str,
    window_size: Tuple[int, int],
    softmax_scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_kv: Optional[torch.Tensor] = None,
    cu_seqlens_q_padded: Optional[torch.Tensor] = None,
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    deterministic: bool = False,
    core_attention_bias: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    rng_state: Optional[torch.Tensor] = None,
    return_softmax_aux: bool = False,
    bottom_right_diagonal: Optional[bool] = None,
    softmax_type: str = "vanilla",
    softmax_offset: Optional[torch.Tensor] = None,
):
    """Fused scaled-dot-product attention on the project's Triton kernels.

    Shapes: ``bshd`` [b, s, h, d], ``sbhd`` [s, b, h, d], ``thd`` [t, h, d] (tokens of all
    sequences packed, delimited by ``cu_seqlens_*``; ``cu_seqlens_*_padded`` give the packed
    starts when sequences are separated by gaps). Any strides. Query head ``i`` uses key/value
    head ``i // (h_q // h_kv)`` (GQA/MQA). For padding masks in bshd/sbhd, ``cu_seqlens_*`` give
    each sequence's real length; outputs and gradients at padded positions are zero. Rows that
    see no key output zeros. The output has q's format and head dim d_v.

    ``core_attention_bias`` (post-scale, [b|1, h|1, s_q, s_kv] or [1, 1, 1, s_kv], padded formats) is added to the
    scaled scores, and gets a gradient when it requires one (summed over its broadcast
    dimensions in a fixed order). ``alibi_slopes`` (fp32 [h] or [b, h]) adds
    ``-slope * |j - (i + d)|`` with the diagonal ``d``, without materialising it.
    ``bottom_right_diagonal`` aligns sliding windows and ALiBi: ``d = s_kv - s_q`` of each sequence
    (True) or 0 (False); the causal masks fix it, and None is bottom-right for the other masks
    (TransformerEngine-PyTorch's rule, ``resolve_bottom_right_diagonal``).
    ``dropout_p`` drops probabilities with a counter-based RNG keyed by ``rng_state``
    (int64 [seed, offset]; drawn from torch's generator when None): the same state gives the
    same mask in forward and backward, run after run. ``return_softmax_aux=True`` returns
    ``(out, (softmax_lse [b, h, s_q] fp32, rng_state))`` like TransformerEngine's aux tensors.

    ``softmax_type``: ``"vanilla"``, ``"off-by-one"`` (one more logit of 0 in every row's
    denominator) or ``"learnable"`` (one more logit ``softmax_offset[h]`` per query head h, added
    as it is, not scaled: ``p_j = exp(s_j) / (exp(offset_h) + sum_k exp(s_k))``). The sink has no
    value vector, so a row that sees no key still outputs zeros. ``softmax_offset``: fp32 [h_q] or
    [1, h_q, 1, 1], required for ``"learnable"`` (and given a gradient when it requires one), None
    otherwise. The saved log-sum-exp includes the sink.

    Determinism: the forward and the backward are deterministic whatever ``deterministic`` says (it is
    TransformerEngine's argument; the same kernels run either way): the backward
    uses no atomics, sums in a fixed order and fixed tiles, so gradients are bitwise
    reproducible and independent of batch composition and of packing (thd vs padded). The
    learnable sink's gradient sums over the batch: each sequence's part is bitwise independent of
    the others (its rows in a fixed order), and the parts are summed as a fixed pairwise tree over
    the sequences in batch order (``kernel_runner.fixed_order_sum``).
    """
    fmt = QKVFormat(qkv_format)
    mask = AttnMaskType(attn_mask_type)
    bottom_right = resolve_bottom_right_diagonal(mask, bottom_right_diagonal, "pytorch")
    check_qkv(q, k, v, fmt)
    check_fused_dtype(q)
    window_size = normalize_window(window_size, mask)
    softmax_scale = check_softmax_scale(softmax_scale)
    if fmt == QKVFormat.THD:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("`cu_seqlens_q` and `cu_seqlens_kv` must be given for qkv_format='thd'")
        batch = None
    else:
        batch = qkv_dims(q, fmt)[0]
        if not mask.is_padding():
            cu_seqlens_q = cu_seqlens_kv = None
        elif cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_kv` must be given for attn_mask_type={mask.value!r}")
        cu_seqlens_q_padded = cu_seqlens_kv_padded = None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv),
                     ("cu_seqlens_q_padded", cu_seqlens_q_padded), ("cu_seqlens_kv_padded", cu_seqlens_kv_padded)):
        check_cu_seqlens(name, cu, batch, q.device)
    if cu_seqlens_q is not None and cu_seqlens_kv is not None and cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(
            f"`cu_seqlens_q` and `cu_seqlens_kv` must have the same length, got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_kv.shape[0]}"
        )
    _check_score_mods(q, fmt, core_attention_bias, alibi_slopes, dropout_p, rng_state)
    stype, softmax_offset = _sink_logits(q, softmax_type, softmax_offset)
    if core_attention_bias is not None:
        bias_type = AttnBiasType.POST_SCALE_BIAS
    else:
        bias_type = AttnBiasType.ALIBI if alibi_slopes is not None else AttnBiasType.NO_BIAS
    thd = fmt == QKVFormat.THD  # (bshd/sbhd: the kernels' lengths come from the shapes)
    params = AttnParams(attn_mask_type=mask, attn_bias_type=bias_type, qkv_format=fmt, window_size=window_size,
                        scaling_factor=softmax_scale, dropout_probability=float(dropout_p),
                        deterministic=bool(deterministic), bottom_right_diagonal=bottom_right, softmax_type=stype,
                        max_seqlen_q=max_seqlen_q if thd else None, max_seqlen_kv=max_seqlen_kv if thd else None)
    call = AttnCall(params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                    bias=core_attention_bias, alibi_slopes=alibi_slopes, rng_state=rng_state,
                    softmax_offset=softmax_offset)
    return fused_attention(q, k, v, call, return_softmax_aux)


def fused_attention(q, k, v, call: AttnCall, return_softmax_aux: bool = False):
    """:func:`fused_attn_func` on a call already converted and checked (DotProductAttention's backend
    runner calls this): in ``call.params`` the window normalized, the diagonal resolved, the scale checked;
    q, k, v, cu_seqlens and score modifiers checked; cu_seqlens only where the format and mask use them,
    ``bias`` only a post-scale bias, ``alibi_slopes`` fp32 on q's device, and the sink logits (fp32 [h_q])
    given whenever the softmax has a sink. What is left, to put the call on the kernels' conventions
    (:class:`AttnCall`): the sequences' values (one host sync), max_seqlen and rng_state when missing, the
    kernels' positive scale. ``params.deterministic`` changes nothing here: both modes run the same
    fixed-order kernels. With ``params.return_max_logit`` (and no ``return_softmax_aux``) returns
    ``(out, max_logit)``: each query head's max logit [h_q] over every visible score, in q's dtype."""
    params = call.params
    fmt = params.qkv_format
    cu_seqlens_q, cu_seqlens_kv = call.cu_seqlens_q, call.cu_seqlens_kv
    cu_seqlens_q_padded, cu_seqlens_kv_padded = call.cu_seqlens_q_padded, call.cu_seqlens_kv_padded
    max_seqlen_q, max_seqlen_kv = params.max_seqlen_q, params.max_seqlen_kv
    if call.page_table is not None or params.kv_page_size is not None:
        _check_paged(q, k, v, call)
    if fmt == QKVFormat.THD:
        if max_seqlen_q is None or max_seqlen_kv is None:
            # One host sync; pass max_seqlen_* to avoid it (and to trace under torch.compile).
            max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
            max_seqlen_kv = int((cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).max().item())
        # A paged call's keys are pages of the cache, not packed rows: each sequence is checked to fit the
        # cache's rows, as if padded to its own length (its pages are checked below).
        paged_kv = cu_seqlens_kv if call.page_table is not None else cu_seqlens_kv_padded
        check_sequence_values(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, paged_kv,
                              max_seqlen_q, max_seqlen_kv)
        max_seqlen_q, max_seqlen_kv = int(max_seqlen_q), int(max_seqlen_kv)
        if call.page_table is not None:
            _check_page_values(k, call.page_table, params.kv_page_size, cu_seqlens_kv, max_seqlen_kv)
    else:
        check_sequence_values(fmt, q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                              qkv_dims(q, fmt)[1], qkv_dims(k, fmt)[1])
        max_seqlen_q = max_seqlen_kv = None  # the kernels' lengths come from the shapes
    if (cu_seqlens_q_padded is None) != (cu_seqlens_kv_padded is None):
        # One side padded: the other side's sequences start where its cu_seqlens say.
        cu_seqlens_q_padded = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
        cu_seqlens_kv_padded = cu_seqlens_kv if cu_seqlens_kv_padded is None else cu_seqlens_kv_padded
    # Self-attention usually passes one tensor for q and kv; autograd.Function.apply under
    # dynamo breaks the graph on duplicate tensor inputs, so "same as q" travels as None.
    if cu_seqlens_kv is cu_seqlens_q:
        cu_seqlens_kv = None
    if cu_seqlens_kv_padded is cu_seqlens_q_padded:
        cu_seqlens_kv_padded = None
    rng_state = call.rng_state
    if params.kernel_dropout > 0 and rng_state is None:
        rng_state = new_rng_state(q.device)
    if params.kernel_dropout == 0:
        rng_state = None
    # The kernels take a positive scale: a zero or negative one runs on 0 * q or -q (autograd maps dq back).
    q_factor, softmax_scale = kernel_scale(params.scaling_factor)
    if q_factor != 1.0:
        q = q * q_factor
    if (softmax_scale is not params.scaling_factor or max_seqlen_q is not params.max_seqlen_q
            or max_seqlen_kv is not params.max_seqlen_kv):  # (Python ints and floats, as the op schema takes them)
        params = dataclasses.replace(params, scaling_factor=softmax_scale, max_seqlen_q=max_seqlen_q,
                                     max_seqlen_kv=max_seqlen_kv)
    call = call.at_kernels(params=params, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                           cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                           rng_state=rng_state)
    out, lse, max_logit = FusedAttnFunc.apply(q, k, v, call.bias, call.softmax_offset, call)
    if return_softmax_aux:
        return out, (lse, rng_state)
    if params.return_max_logit:
        return out, max_logit
    return out


def _check_paged(q, k, v, call: AttnCall) -> None:
    """A paged KV cache call (``call.page_table`` with ``params.kv_page_size``): thd, forward only, the table
    int32 [b, max pages] on q's device with contiguous rows, k and v the cache's rows (whole pages)."""
    params, table, page_size = call.params, call.page_table, call.params.kv_page_size
    if table is None or page_size is None:
        raise ValueError("`page_table` and `kv_page_size` must be given together for a paged KV cache, got "
                         f"page_table={'a tensor' if table is not None else None} kv_page_size={page_size!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"`kv_page_size` must be a positive int, got {page_size!r}")
    if params.qkv_format != QKVFormat.THD:
        raise ValueError(f"`qkv_format` must be 'thd' with a page table (k, v: the cache's rows), got "
                         f"{params.qkv_format.value!r}")
    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 2:
        got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
        raise ValueError(f"`page_table` must be an int32 tensor [batch, max_pages_per_sequence], got {got}")
    batch = call.cu_seqlens_q.shape[0] - 1
    if table.shape[0] < batch or table.stride(1) != 1:
        raise ValueError(f"`page_table` must have a row for each of the {batch} sequences (cu_seqlens_q) and "
                         f"contiguous rows, got shape {tuple(table.shape)} strides {tuple(table.stride())}")
    if table.device != q.device:
        raise ValueError(f"`page_table` must be on the inputs' device {q.device}, got {table.device}")
    if params.max_seqlen_kv is not None and table.shape[1] * page_size < params.max_seqlen_kv:
        raise ValueError(f"`page_table` must list pages for max_seqlen_kv={params.max_seqlen_kv} keys: "
                         f"{table.shape[1]} pages of {page_size} hold {table.shape[1] * page_size}")
    for name, t in (("key_layer", k), ("value_layer", v)):
        if t.shape[0] % page_size or t.shape[0] != k.shape[0]:
            raise ValueError(f"`{name}` must be the paged cache's rows [num_pages * kv_page_size, h, d] "
                             f"(kv_page_size={page_size}), got shape {tuple(t.shape)}")
    if call.cu_seqlens_kv_padded is not None:
        raise ValueError("`cu_seqlens_kv_padded` must be None with a page table (the table says where each "
                         "sequence's keys are), got a tensor")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, call.bias, call.softmax_offset)):
        raise NotImplementedError("a paged KV cache call (`page_table`) is inference only: the fused backward "
                                  "never reads through a page table; run it under torch.no_grad() (or without "
                                  "inputs that require grad), or gather the pages into rows for gradients")


def _check_page_values(k, table: torch.Tensor, page_size: int, cu_seqlens_kv, max_seqlen_kv: int) -> None:
    """Each sequence's pages (those its cu_seqlens_kv length uses) are pages of the cache (one host sync;
    skipped when ``can_sync()`` is false or the caller checked them, ``sequences_checked``)."""
    if not can_sync() or sequences_checked():
        return
    num_pages = k.shape[0] // page_size
    batch = cu_seqlens_kv.shape[0] - 1
    used = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).to(torch.int64).add(page_size - 1).div(page_size,
                                                                                        rounding_mode="floor")
    cols = min(table.shape[1], -(-max_seqlen_kv // page_size))
    pages = table[:batch, :cols].to(torch.int64)
    inside = torch.arange(cols, device=table.device)[None, :] < used[:, None]
    bad = inside & ((pages < 0) | (pages >= num_pages))
    if bool(bad.any()):
        seq, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"`page_table` entries must be pages of the cache, in [0, {num_pages}), got "
                         f"{int(pages[seq, col])} at [{seq}, {col}]")


def check_fused_dtype(q: torch.Tensor) -> None:
    """q's dtype is one the fused kernels compute right here (bf16 not under Triton's interpreter)."""
    check_input_dtype([("query_layer", dtype_name(q.dtype))], sorted(FusedAttention.SUPPORTED_DTYPES),
                      "the fused kernels")
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and triton_interpreting():
        raise NotImplementedError(
            "`query_layer` must not be bfloat16 for the fused kernels under TRITON_INTERPRET=1 (Triton's "
            "interpreter computes bfloat16 tl.dot wrongly), got bfloat16; use float16/float32 or the unfused path")


def _check_score_mods(q, fmt: QKVFormat, bias, alibi_slopes, dropout_p, rng_state) -> None:
    heads = q.shape[-2]
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"`dropout_p` must be in [0, 1), got {dropout_p}")
    if rng_state is not None and (rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,)):
        raise ValueError(f"`rng_state` must be int64 of shape [2] (seed, offset), got {rng_state.dtype} "
                         f"{tuple(rng_state.shape)}")
    if bias is not None:
        if fmt == QKVFormat.THD:
            raise NotImplementedError("`core_attention_bias` is not supported with qkv_format='thd'")
        if bias.dim() != 4 or bias.shape[1] not in (1, heads):
            raise ValueError(f"`core_attention_bias` must be [b|1, {heads}|1, s_q|1, s_kv], got {tuple(bias.shape)}")
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32 or alibi_slopes.shape[-1] != heads or alibi_slopes.dim() not in (1, 2):
            raise ValueError(f"`alibi_slopes` must be fp32 [{heads}] or [b, {heads}], got {alibi_slopes.dtype} "
                             f"{tuple(alibi_slopes.shape)}")


def _sink_logits(q, softmax_type, softmax_offset):
    """(softmax type, fp32 [h_q] sink logits or None) from the user's arguments."""
    try:
        stype = AttnSoftmaxType(softmax_type)
    except ValueError:
        choices = ", ".join(repr(t.value) for t in AttnSoftmaxType)
        raise ValueError(f"`softmax_type` must be one of {choices}, got {softmax_type!r}") from None
    heads = q.shape[-2]
    if not stype.is_learnable:
        if softmax_offset is not None:
            raise ValueError(f"`softmax_offset` must be None with softmax_type={stype.value!r}, got a tensor")
        return stype, sink_logits(q, stype, None)
    if softmax_offset is None:
        raise ValueError("`softmax_offset` must be an fp32 tensor of shape [h] or [1, h, 1, 1] with "
                         "softmax_type='learnable', got None")
    if (not isinstance(softmax_offset, torch.Tensor) or softmax_offset.dtype != torch.float32
            or tuple(softmax_offset.shape) not in ((heads,), (1, heads, 1, 1))):
        got = (f"{softmax_offset.dtype} {tuple(softmax_offset.shape)}" if isinstance(softmax_offset, torch.Tensor)
               else type(softmax_offset).__name__)
        raise ValueError(f"`softmax_offset` must be fp32 of shape [{heads}] or [1, {heads}, 1, 1], got {got}")
    if softmax_offset.device != q.device:
        raise ValueError(f"`softmax_offset` must be on the inputs' device {q.device}, got {softmax_offset.device}")
    return stype, sink_logits(q, stype, softmax_offset)


def sink_logits(q, softmax_type: AttnSoftmaxType, softmax_offset) -> Optional[torch.Tensor]:
    """The kernels' sink logits for a checked ``softmax_offset``: fp32 [h_q], or None without a sink.
    Off-by-one takes zeros, or the zero tensor DotProductAttention keeps for it (TransformerEngine's
    ``softmax_offset`` attribute), which then gets the sink's gradient when it requires one."""
    if softmax_type.has_sink and softmax_offset is not None:
        return softmax_offset.reshape(q.shape[-2]).contiguous()
    if softmax_type.has_sink:  # off-by-one: a zero sink logit
        return torch.zeros(q.shape[-2], dtype=torch.float32, device=q.device)
    return None
