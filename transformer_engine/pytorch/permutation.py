"""MoE token permutation, as TransformerEngine's ``pytorch.permutation`` names it.

Megatron's ``moe_permute_fusion`` dispatches through these five functions. They are plain torch
code with the same layout TE produces: the permuted buffer holds the tokens grouped by expert in
ascending expert order and, within one expert, in ascending token order (index maps: stable in
``(token, k)``); rows past ``num_out_tokens`` are dropped.

Determinism: every forward and backward is a gather followed, where rows meet, by a sum over a
fixed, per-token slot order (ascending expert / k) in float32. No ``index_add_``/``scatter_add_``
with repeated indices is used, so results do not depend on thread scheduling and agree bitwise
run to run on every device.

``row_id_map`` is opaque to callers (Megatron only hands it back to :func:`moe_unpermute`). Here it
is an int32 tensor ``[num_tokens, num_experts]`` (mask maps) or ``[num_tokens, topk]`` (index maps)
holding the permuted row of each (token, slot) pair, or -1 when that pair is not routed or was
dropped.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from transformer_engine.pytorch.tensor import QuantizedTensor

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_unpermute",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
]


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                 "float8_e5m2fnuz") if hasattr(torch, n))


def _refuse_quantized(name: str, arg: str, tensor) -> None:
    if isinstance(tensor, QuantizedTensor) or getattr(tensor, "dtype", None) in _FP8_DTYPES:
        raise NotImplementedError(
            f"`{arg}=<{type(tensor).__name__} {tensor.dtype}>` is not implemented in {name}: FP8 (quantized) tokens "
            "are not permuted here; permute in high precision and quantize afterwards")


def _check_2d(name: str, arg: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"`{arg}` of {name} must be a 2-D tensor, got {shape}")


def _rows_from_flat(selected: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    """Destination row of each selected flat slot (slot order = output order), -1 if not kept."""
    rank = torch.cumsum(selected.to(torch.int64), 0) - 1
    keep = selected & (rank < num_out_tokens)
    return torch.where(keep, rank, torch.full_like(rank, -1))


def _compact(row_id_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token, its routed slots in ascending slot order, padded with -1.

    Returns ``(rows [T, K], cols [T, K])``: the permuted row and the slot (expert or k) of each of
    the at most K routed slots of a token, K the largest number any token has."""
    rows = row_id_map.to(torch.int64)
    num_tokens, num_slots = rows.shape
    routed = rows >= 0
    k = int(routed.sum(1).max().item()) if num_tokens and num_slots else 0
    slot = torch.arange(num_slots, device=rows.device).expand(num_tokens, num_slots)
    # Routed slots first, each group in ascending slot order: a fixed order for the sums below.
    key = torch.where(routed, slot, slot + num_slots)
    cols = torch.argsort(key, dim=1, stable=True)[:, :k]
    picked = torch.gather(rows, 1, cols)
    cols = torch.where(picked >= 0, cols, torch.full_like(cols, -1))
    return picked, cols


def _take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0 with zeros where ``index`` is -1 (no autograd)."""
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0)
    safe = torch.where(index >= 0, index, torch.full_like(index, x.shape[0]))
    return padded.index_select(0, safe.reshape(-1)).reshape(tuple(index.shape) + tuple(x.shape[1:]))


def _source_of_rows(rows: torch.Tensor, num_out: int) -> torch.Tensor:
    """For each permuted row, the flat (token * K + k) slot of ``rows`` that fills it, or -1."""
    flat = rows.reshape(-1)
    src = torch.full((num_out + 1,), -1, dtype=torch.int64, device=rows.device)
    # Every row index >= 0 occurs once, so this assignment has no colliding writes.
    target = torch.where(flat >= 0, flat, torch.full_like(flat, num_out))
    ok = flat >= 0
    src[target[ok]] = torch.arange(flat.numel(), device=rows.device)[ok]
    return src[:num_out]


class _Permute(torch.autograd.Function):
    """out[r] = inp[token of r]; grad_inp[t] = sum over t's slots (fixed order) of grad_out."""

    @staticmethod
    def forward(ctx, inp, rows, num_out):
        num_slots = rows.shape[1]
        src = _source_of_rows(rows, num_out)
        token = torch.where(src >= 0, torch.div(src, max(num_slots, 1), rounding_mode="floor"), src)
        ctx.save_for_backward(rows)
        ctx.num_out = num_out
        return _take_rows(inp, token)

    @staticmethod
    def backward(ctx, grad_out):
        (rows,) = ctx.saved_tensors
        compact, _ = _compact(rows)
        gathered = _take_rows(grad_out.float(), compact)         # [T, K, H], slots ascending
        return gathered.sum(1).to(grad_out.dtype), None, None


class _Unpermute(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * inp[rows[t, k]] in float32, k ascending."""

    @staticmethod
    def forward(ctx, inp, weight, rows):
        gathered = _take_rows(inp.float(), rows)                 # [T, K, H]
        if weight is not None:
            out = (gathered * weight.float().unsqueeze(-1)).sum(1)
        else:
            out = gathered.sum(1)
        ctx.save_for_backward(inp, weight, rows)
        ctx.has_weight = weight is not None
        return out.to(inp.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight, rows = ctx.saved_tensors
        num_tokens, k = rows.shape
        g = grad_out.float()
        src = _source_of_rows(rows, inp.shape[0])
        token = torch.where(src >= 0, torch.div(src, max(k, 1), rounding_mode="floor"), src)
        grad_rows = _take_rows(g, token)                         # [N, H]
        grad_weight = None
        if ctx.has_weight:
            w_of_row = _take_rows(weight.float().reshape(-1, 1), src).reshape(-1, 1)
            grad_rows = grad_rows * w_of_row
            if ctx.needs_input_grad[1]:
                gathered = _take_rows(inp.float(), rows)
                grad_weight = (gathered * g.unsqueeze(1)).sum(-1).to(weight.dtype)
        return grad_rows.to(inp.dtype), grad_weight, None


def _mask_rows(routing_map: torch.Tensor, num_out_tokens: int) -> torch.Tensor:
    num_tokens, num_experts = routing_map.shape
    selected = (routing_map != 0).t().reshape(-1)               # expert-major, tokens ascending
    rows = _rows_from_flat(selected, num_out_tokens)
    return rows.view(num_experts, num_tokens).t().contiguous()


def _index_rows(index: torch.Tensor, num_out_tokens: int):
    num_tokens, topk = index.shape
    flat = index.reshape(-1).to(torch.int64)
    # Stable sort by expert: within one expert, (token, k) ascending, as TE orders it.
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=index.device)
    rows = torch.where(rank < num_out_tokens, rank, torch.full_like(rank, -1))
    return rows.view(num_tokens, topk)


def _resolve_out(num_out_tokens: Optional[int], routed: int) -> int:
    if num_out_tokens is None or num_out_tokens < 0:
        return routed
    return int(num_out_tokens)


def moe_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group the rows of ``inp`` ``[num_tokens, hidden]`` by the expert ``routing_map`` sends them to.

    ``routing_map``: ``map_type="mask"``: ``[num_tokens, num_experts]``, nonzero where a token goes
    to an expert; ``"index"``: ``[num_tokens, topk]`` expert indices. ``num_out_tokens``: rows of
    the output; rows past it are dropped (-1 or None: every routed pair; for index maps 0 also
    means ``num_tokens * topk``). A value larger than the routed count leaves zero rows at the end.
    ``max_token_num`` is a workspace hint of TE's kernels and has no effect here.
    Returns ``(permuted, row_id_map)``.
    """
    _refuse_quantized("moe_permute", "inp", inp)
    _check_2d("moe_permute", "inp", inp)
    _check_2d("moe_permute", "routing_map", routing_map)
    if routing_map.shape[0] != inp.shape[0]:
        raise ValueError(f"`routing_map` must have one row per token of `inp` ({inp.shape[0]}), "
                         f"got {tuple(routing_map.shape)}")
    if map_type == "index":
        if routing_map.dtype.is_floating_point:
            raise ValueError(f"`routing_map` of map_type='index' must be an integer tensor, got {routing_map.dtype}")
        routed = routing_map.numel()
        n_out = routed if num_out_tokens is None or num_out_tokens <= 0 else int(num_out_tokens)
        rows = _index_rows(routing_map, n_out)
    elif map_type == "mask":
        routed = int((routing_map != 0).sum().item())
        n_out = _resolve_out(num_out_tokens, routed)
        rows = _mask_rows(routing_map, n_out)
    else:
        raise ValueError(f"`map_type` must be 'mask' or 'index', got {map_type!r}")
    out = _Permute.apply(inp, rows, n_out)
    return out, rows.to(torch.int32)


def moe_permute_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_permute` with a mask map that also permutes ``probs`` ``[num_tokens, num_experts]``.

    Returns ``(permuted, permuted_probs, row_id_map)``; ``permuted_probs[r]`` is the probability of
    the (token, expert) pair that fills row ``r``.
    """
    _refuse_quantized("moe_permute_with_probs", "inp", inp)
    _check_2d("moe_permute_with_probs", "probs", probs)
    if tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(f"`probs` must have the shape of `routing_map` {tuple(routing_map.shape)}, "
                         f"got {tuple(probs.shape)}")
    out, row_id_map = moe_permute(inp, routing_map, num_out_tokens=num_out_tokens, map_type="mask")
    rows = row_id_map.to(torch.int64)
    n_out = out.shape[0]
    num_experts = routing_map.shape[1]
    src = _source_of_rows(rows, n_out)                          # flat token * E + expert
    # Gather (unique positions): its backward writes each probs entry at most once.
    flat = probs.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(1)])
    safe = torch.where(src >= 0, src, torch.full_like(src, flat.numel()))
    permuted_probs = padded.index_select(0, safe) if num_experts else flat.new_zeros(n_out)
    return out, permuted_probs, row_id_map


def moe_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: Optional[torch.Tensor] = None,
    restore_shape: Optional[torch.Size] = None,
    map_type: str = "mask",
    probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Undo :func:`moe_permute`: each token's rows, weighted by ``merging_probs`` when given, summed.

    ``merging_probs``: ``[num_tokens, num_experts]`` (mask maps) or ``[num_tokens, topk]`` (index
    maps). The sum over a token's rows runs in float32 in ascending expert (k) order; the result
    has ``inp``'s dtype. ``probs`` is the deprecated name of ``merging_probs``.
    """
    if probs is not None:
        if merging_probs is not None:
            raise ValueError("`merging_probs` and the deprecated `probs` were both given; pass one")
        warnings.warn("moe_unpermute: `probs` is deprecated, use `merging_probs`", FutureWarning)
        merging_probs = probs
    _refuse_quantized("moe_unpermute", "inp", inp)
    _check_2d("moe_unpermute", "inp", inp)
    _check_2d("moe_unpermute", "row_id_map", row_id_map)
    if map_type not in ("mask", "index"):
        raise ValueError(f"`map_type` must be 'mask' or 'index', got {map_type!r}")
    num_tokens = row_id_map.shape[0]
    if restore_shape is not None:
        restore_shape = tuple(restore_shape)
        if restore_shape != (num_tokens, inp.shape[1]):
            raise ValueError(f"`restore_shape` must be (num_tokens, hidden) = {(num_tokens, inp.shape[1])} "
                             f"for this `row_id_map`, got {restore_shape}")
    rows, cols = _compact(row_id_map)
    weight = None
    if merging_probs is not None:
        if tuple(merging_probs.shape) != tuple(row_id_map.shape):
            raise ValueError(f"`merging_probs` must have shape {tuple(row_id_map.shape)}, "
                             f"got {tuple(merging_probs.shape)}")
        safe = torch.where(cols >= 0, cols, torch.zeros_like(cols))
        weight = torch.gather(merging_probs, 1, safe)
        weight = torch.where(cols >= 0, weight, torch.zeros_like(weight))
    return _Unpermute.apply(inp, weight, rows)


class _RowPermutation(torch.autograd.Function):
    """out = inp[src] for a permutation ``src`` of the rows; backward is the inverse gather."""

    @staticmethod
    def forward(ctx, inp, src, inverse):
        ctx.save_for_backward(inverse)
        return inp.index_select(0, src)

    @staticmethod
    def backward(ctx, grad_out):
        (inverse,) = ctx.saved_tensors
        return grad_out.index_select(0, inverse), None, None


def _chunk_permutation(name: str, num_rows: int, split_sizes, sorted_index, device):
    sizes = torch.as_tensor(split_sizes, device=device).to(torch.int64).reshape(-1)
    order = torch.as_tensor(sorted_index, device=device).to(torch.int64).reshape(-1)
    if int(sizes.sum().item()) != num_rows or bool((sizes < 0).any()):
        raise ValueError(f"`split_sizes` of {name} must be non-negative and sum to the rows of `inp` "
                         f"({num_rows}), got {sizes.tolist()}")
    if order.numel() != sizes.numel() or not torch.equal(
            torch.sort(order).values, torch.arange(sizes.numel(), device=device)):
        raise ValueError(f"`sorted_index` of {name} must be a permutation of range({sizes.numel()}), "
                         f"got {order.tolist()}")
    starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes[order]
    out_starts = torch.cumsum(out_sizes, 0) - out_sizes
    shift = torch.repeat_interleave(starts[order] - out_starts, out_sizes, output_size=num_rows)
    src = shift + torch.arange(num_rows, device=device)
    inverse = torch.empty_like(src)
    inverse[src] = torch.arange(num_rows, device=device)
    return src, inverse


def moe_sort_chunks_by_index(
    inp: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> torch.Tensor:
    """Split ``inp`` along dim 0 into chunks of ``split_sizes`` and concatenate them in ``sorted_index`` order."""
    _refuse_quantized("moe_sort_chunks_by_index", "inp", inp)
    src, inverse = _chunk_permutation("moe_sort_chunks_by_index", inp.shape[0], split_sizes,
                                      sorted_index, inp.device)
    return _RowPermutation.apply(inp, src, inverse)


def moe_sort_chunks_by_index_with_probs(
    inp: torch.Tensor,
    probs: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_index: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_sort_chunks_by_index` applied to ``inp`` and to the per-row ``probs``; returns both."""
    _refuse_quantized("moe_sort_chunks_by_index_with_probs", "inp", inp)
    if probs.shape[0] != inp.shape[0]:
        raise ValueError(f"`probs` must have one entry per row of `inp` ({inp.shape[0]}), got {tuple(probs.shape)}")
    src, inverse = _chunk_permutation("moe_sort_chunks_by_index_with_probs", inp.shape[0], split_sizes,
                                      sorted_index, inp.device)
    return _RowPermutation.apply(inp, src, inverse), _RowPermutation.apply(probs, src, inverse)
