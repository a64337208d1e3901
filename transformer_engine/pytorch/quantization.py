"""FP8 quantization and GEMMs for the PyTorch modules: quantized operands, scaled GEMMs, delayed-scaling state.

A quantized operand (:class:`Quantized`) is a value: FP8 data, the inverse scale(s) that dequantize it
and the tile its scales cover (the whole tensor, 1x128 or 128x128). Scales come from
``transformer_engine.common.quantization`` (the formulas shared with JAX); this module applies them with
torch ops. Quantizing multiplies by the scale in float32 and casts with saturation to the format's
largest finite value (as TransformerEngine's casts do); NaN stays NaN.

Determinism: amaxes are max-reductions (order-free), the casts are elementwise, the amax all-reduce is
a MAX, and the GEMMs are torch's (fixed per shape and device), so every quantity is bitwise
reproducible run to run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch

from transformer_engine.common import quantization as q
from transformer_engine.common import recipe as _recipe

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# --- delayed scaling state ----------------------------------------------------------------------

class DelayedScalingMeta:
    """One direction's delayed-scaling state of a module: ``scale`` [n] and ``amax_history`` [len, n].

    Row 0 of the history accumulates (max) the amaxes recorded since the last update; the update
    (``reduce_and_update_delayed_metas``) computes the new scale from the history and rolls it, as
    TransformerEngine's ``FP8TensorMeta`` is updated. ``fmt`` is the FP8 format of the direction.
    """

    def __init__(self, num_tensors: int, recipe: _recipe.DelayedScaling, forward: bool, device: torch.device) -> None:
        self.forward = forward
        self.recipe = recipe
        self.group: Optional[Any] = None
        fwd_fmt, bwd_fmt = q.format_dtypes(recipe.fp8_format)
        self.fmt = fwd_fmt if forward else bwd_fmt
        self.scale = torch.ones(num_tensors, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, num_tensors, dtype=torch.float32, device=device)

    def set_recipe(self, recipe: _recipe.DelayedScaling) -> None:
        """Follow a new autocast's recipe; a changed history length keeps the newest entries (as TransformerEngine)."""
        fwd_fmt, bwd_fmt = q.format_dtypes(recipe.fp8_format)
        fmt = fwd_fmt if self.forward else bwd_fmt
        if fmt != self.fmt:
            raise ValueError(f"`fp8_format` must stay the same across steps for a module's delayed-scaling state, "
                             f"got {recipe.fp8_format} after a {self.fmt} state")
        length = recipe.amax_history_len
        if length != self.amax_history.shape[0]:
            old = self.amax_history
            new = torch.zeros(length, old.shape[1], dtype=old.dtype, device=old.device)
            keep = min(length, old.shape[0])
            new[:keep] = old[:keep]
            self.amax_history = new
        self.recipe = recipe

    def record_amax(self, index: int, amax: torch.Tensor) -> None:
        """Fold a quantized tensor's amax into this step's row (max over the calls since the last update)."""
        row = self.amax_history[0]
        row[index] = torch.maximum(row[index], amax.to(torch.float32))


def reduce_and_update_delayed_metas(metas: Sequence[DelayedScalingMeta]) -> None:
    """All-reduce (MAX) this step's amaxes over each meta's group, then update every scale and history.

    Metas sharing a group are reduced in one all-reduce of their concatenated rows, in registration
    order. A MAX is exact and order-free, so the reduction is deterministic.
    """
    by_group: dict = {}
    for meta in metas:
        by_group.setdefault(id(meta.group), []).append(meta)
    for group_metas in by_group.values():
        group = group_metas[0].group
        reduce = (group_metas[0].recipe.reduce_amax and torch.distributed.is_available()
                  and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1)
        if reduce:
            rows = torch.cat([m.amax_history[0] for m in group_metas])
            torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX, group=group)
            offset = 0
            for m in group_metas:
                n = m.amax_history.shape[1]
                m.amax_history[0].copy_(rows[offset:offset + n])
                offset += n
        for m in group_metas:
            update_delayed_meta(m)


def update_delayed_meta(meta: DelayedScalingMeta) -> None:
    """One delayed-scaling update of ``meta`` in place (TransformerEngine's formula, in float32)."""
    recipe = meta.recipe
    history, scale = q.delayed_update(torch, meta.amax_history, meta.scale, q.fp8_max(meta.fmt), recipe.margin,
                                      recipe.amax_compute_algo, recipe.scaling_factor_compute_algo, recipe)
    meta.amax_history.copy_(history)
    meta.scale.copy_(scale)


__all__ = ["FP8_DTYPES", "DelayedScalingMeta", "reduce_and_update_delayed_metas", "update_delayed_meta"]
