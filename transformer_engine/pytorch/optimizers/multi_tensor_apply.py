"""TransformerEngine's multi-tensor entry points (``multi_tensor_applier`` and the ops it calls),
written with torch's ``_foreach`` operations.

An op is called as ``op(chunk_size, noop_flag, tensor_lists, *args)``; the applier drops the slots
whose first tensor is empty and passes the chunk size along (it has no meaning here: torch chooses
its own launches). Every op is elementwise or a per-tensor reduction followed by a reduction over
the list in list order, so the results do not depend on scheduling.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # pylint: disable=protected-access


class MultiTensorApply:  # pylint: disable=too-few-public-methods
    """Calls ``op(chunk_size, noop_flag, tensor_lists, *args)`` on aligned lists of tensors."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        lists = [[_local(t) for t in ts] for ts in tensor_lists]
        if any(len(ts) != len(lists[0]) for ts in lists):
            raise ValueError(
                f"`tensor_lists` must hold lists of one length, got lengths {[len(ts) for ts in lists]}"
            )
        keep = [t.numel() > 0 for t in lists[0]]
        lists = [[t for t, k in zip(ts, keep) if k] for ts in lists]
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


def _flag_nonfinite(noop_flag: Optional[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Sets ``noop_flag`` to 1 when any tensor holds an inf or a NaN (apex's overflow check)."""
    if noop_flag is None or not tensors:
        return
    bad = torch.stack([torch.isfinite(t).all().logical_not().to(noop_flag.device) for t in tensors]).any()
    noop_flag.copy_(torch.where(bad, torch.ones_like(noop_flag), noop_flag))


def _check_two_lists(tensor_lists, op: str) -> None:
    if len(tensor_lists) != 2:
        raise ValueError(f"`tensor_lists` of {op} must be [sources, destinations], got {len(tensor_lists)} lists")


def multi_tensor_scale(chunk_size: int, noop_flag, tensor_lists, scale: float) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists = [srcs, dsts]`` (in place when they
    alias); sets ``noop_flag`` when a source is not finite."""
    del chunk_size
    _check_two_lists(tensor_lists, "multi_tensor_scale")
    srcs, dsts = tensor_lists
    _flag_nonfinite(noop_flag, srcs)
    for src, dst in zip(srcs, dsts):
        # fp32 arithmetic, then one rounding to the destination's dtype, as TE's kernel does.
        dst.copy_(src.float() * scale)


def multi_tensor_scale_tensor(chunk_size: int, noop_flag, tensor_lists, scale: torch.Tensor) -> None:
    """``multi_tensor_scale`` with the scale in a tensor (one element), read on the device."""
    del chunk_size
    _check_two_lists(tensor_lists, "multi_tensor_scale_tensor")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"`scale` must be a one-element tensor, got {scale!r}")
    srcs, dsts = tensor_lists
    _flag_nonfinite(noop_flag, srcs)
    for src, dst in zip(srcs, dsts):
        dst.copy_(src.float() * scale.to(device=src.device, dtype=torch.float32).reshape(()))


def multi_tensor_l2norm(
    chunk_size: int, noop_flag, tensor_lists, per_tensor: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all tensors of ``tensor_lists[0]`` together (fp32, shape [1]) and, with
    ``per_tensor``, each tensor's norm (else an empty tensor). Each tensor's norm is computed
    in fp32 and the total is the norm of those norms, taken in list order."""
    del chunk_size
    tensors = tensor_lists[0]
    _flag_nonfinite(noop_flag, tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    norms = [torch.linalg.vector_norm(t.float()).reshape(1) for t in tensors]
    per = torch.cat(norms) if norms else torch.zeros(0, device=device)
    total = torch.linalg.vector_norm(per).reshape(1)
    return total, (per if per_tensor else torch.zeros(0, device=device))


def multi_tensor_unscale_l2norm(
    chunk_size: int, noop_flag, tensor_lists, inv_scale: torch.Tensor, per_tensor: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``multi_tensor_l2norm`` of the tensors multiplied by ``inv_scale``."""
    scaled: List[torch.Tensor] = [t.float() * inv_scale.reshape(()).to(t.device) for t in tensor_lists[0]]
    return multi_tensor_l2norm(chunk_size, noop_flag, [scaled], per_tensor)
