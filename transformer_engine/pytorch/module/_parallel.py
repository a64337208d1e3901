"""Tensor-parallel collectives as autograd functions (torch.distributed; gloo, NCCL, ...).

Forward and backward are each one collective, so results are as deterministic as the backend's
collective (gloo and NCCL's ring reductions give the same bits run to run on a fixed setup).
Sequence-parallel tensors are split along dim 0, the sequence dim of Megatron's [s, b, h].
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[0] % size:
        raise ValueError(f"sequence-parallel dim 0 ({x.shape[0]}) must be divisible by the tensor-parallel size {size}")
    rank = dist.get_rank(group)
    if not (x.is_cuda and "nccl" in str(dist.get_backend(group))):
        # gloo (CPU tensors) has no reduce-scatter: all-reduce, keep this rank's slice.
        return _all_reduce(x, group).chunk(size, dim=0)[rank].contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward; identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 forward; reduce-scatter backward (sequence-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim0(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward; all-gather backward (sequence-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def column_input(x: torch.Tensor, group: Optional[Any], sequence_parallel: bool) -> torch.Tensor:
    """What a column-parallel layer multiplies: the full sequence on every rank."""
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group) if sequence_parallel else _CopyToGroup.apply(x, group)


def row_output(y: torch.Tensor, group: Optional[Any], sequence_parallel: bool) -> torch.Tensor:
    """Sum of the row-parallel partial products: all of it, or this rank's sequence slice."""
    if group_size(group) == 1:
        return y
    return _ScatterSequence.apply(y, group) if sequence_parallel else _ReduceFromGroup.apply(y, group)
