"""Vocabulary-parallel cross entropy, as TransformerEngine's ``pytorch.cross_entropy`` names it.

Megatron's ``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl='te'`` calls
:func:`parallel_cross_entropy`. Each rank holds an equal shard of the vocabulary; the per-token
maximum, the sum of exponentials, the target logit and the logit sum (label smoothing) are
combined across ranks by all-gathering the per-rank values and reducing them in rank order, so
the loss and the gradient do not depend on how a collective happens to sum. Loss and gradient are
computed in float32; the gradient is returned in the input's dtype. In batch-invariant mode
(``NVTE_BATCH_INVARIANT=1`` / ``batch_invariant()``) the per-token sums over the vocabulary run on the
batch-invariant row-sum kernel, so a token's loss and gradient do not depend on how many tokens there are.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from transformer_engine.pytorch.batch_invariance import is_batch_invariant, row_exp_sums

__all__ = ["parallel_cross_entropy"]


def _gather_reduce(value: torch.Tensor, group, op: str) -> torch.Tensor:
    """Combine a per-rank tensor over ``group`` in rank order (max or sum)."""
    if group is None or dist.get_world_size(group) == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, value.contiguous(), group=group)
    stacked = torch.stack(parts, 0)
    return stacked.amax(0) if op == "max" else stacked.sum(0)


class _ParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, inp, target, label_smoothing, reduce_loss, group, ignore_idx):
        shape = inp.shape[:-1]
        v_local = inp.shape[-1]
        x = inp.reshape(-1, v_local).float()
        y = target.reshape(-1).to(torch.int64)
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        vocab = v_local * world
        offset = rank * v_local

        m = _gather_reduce(x.amax(-1), group, "max")  # a max is exact in any order
        if is_batch_invariant():
            d_local, x_sum_local = row_exp_sums(x.contiguous(), m, with_sum=label_smoothing > 0)
        else:
            d_local = torch.exp(x - m.unsqueeze(-1)).sum(-1)
            x_sum_local = x.sum(-1) if label_smoothing > 0 else None
        d = _gather_reduce(d_local, group, "sum")
        lse = m + torch.log(d)
        valid = y != ignore_idx
        local_y = y - offset
        owned = valid & (local_y >= 0) & (local_y < v_local)
        safe = torch.where(owned, local_y, torch.zeros_like(local_y))
        x_y = torch.where(owned, torch.gather(x, 1, safe.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
        x_y = _gather_reduce(x_y, group, "sum")                  # one rank holds it; others add 0
        loss = lse - x_y
        if label_smoothing > 0:
            x_sum = _gather_reduce(x_sum_local, group, "sum")
            # (1 - ls) * nll + ls * mean_v(-log p_v)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - x_sum / vocab)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        n_valid = valid.sum().clamp(min=1)

        ctx.save_for_backward(x, lse, safe, owned, valid, n_valid)
        ctx.meta = (inp.shape, inp.dtype, label_smoothing, reduce_loss, vocab)
        if reduce_loss:
            return loss.sum() / n_valid
        return loss.reshape(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        x, lse, safe, owned, valid, n_valid = ctx.saved_tensors
        shape, dtype, label_smoothing, reduce_loss, vocab = ctx.meta
        grad = torch.exp(x - lse.unsqueeze(-1))
        if label_smoothing > 0:
            grad = grad - label_smoothing / vocab
        hit = torch.zeros_like(grad).scatter(1, safe.unsqueeze(1), owned.float().unsqueeze(1))
        grad = grad - (1.0 - label_smoothing) * hit
        if reduce_loss:
            scale = grad_loss.float() / n_valid
            grad = grad * scale
        else:
            grad = grad * grad_loss.float().reshape(-1, 1)
        grad = torch.where(valid.unsqueeze(1), grad, torch.zeros_like(grad))
        return grad.to(dtype).reshape(shape), None, None, None, None, None


def parallel_cross_entropy(
    inp: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group: Optional[torch.distributed.ProcessGroup] = None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cross entropy of ``inp`` ``(B, SQ, V / world)`` against ``target`` ``(B, SQ)`` (or ``SQ, B``).

    Returns the float32 loss per token ``(B, SQ)``, or its mean over the non-ignored tokens when
    ``reduce_loss``. Tokens whose target is ``ignore_idx`` get loss and gradient 0.
    ``dist_process_group``: the vocabulary is split evenly over its ranks, rank ``r`` holding
    entries ``[r * V / world, (r + 1) * V / world)``. ``is_cg_capturable`` is accepted (it changes
    no result). ``_input`` is the deprecated name of ``inp``.
    """
    if _input is not None:
        warnings.warn("parallel_cross_entropy: `_input` is deprecated, use `inp`", FutureWarning)
        inp = _input
    if not isinstance(inp, torch.Tensor) or inp.dim() < 2:
        raise ValueError(f"`inp` must be a (B, SQ, V) tensor, got {getattr(inp, 'shape', type(inp).__name__)}")
    if not inp.dtype.is_floating_point:
        raise ValueError(f"`inp` must be a floating-point tensor, got {inp.dtype}")
    if tuple(target.shape) != tuple(inp.shape[:-1]):
        raise ValueError(f"`target` must have shape {tuple(inp.shape[:-1])}, got {tuple(target.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing}")
    return _ParallelCrossEntropy.apply(inp, target, float(label_smoothing), bool(reduce_loss),
                                       dist_process_group, int(ignore_idx))
