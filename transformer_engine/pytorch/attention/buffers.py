"""New buffers without the fill of torch's deterministic mode.

``torch.use_deterministic_algorithms(True)`` fills every new tensor's memory
(``torch.utils.deterministic.fill_uninitialized_memory``): a memset per buffer. The fused path's kernels
write their outputs in full, and the host reads of ``cu_seqlens`` overwrite their copy at once, so these
allocate without it.
"""

from __future__ import annotations

import math
from typing import List

import torch


def unfilled(shape, dtype: torch.dtype, device, strides=None) -> torch.Tensor:
    """A new tensor like ``torch.empty`` (``torch.empty_strided`` with ``strides``), without the fill that
    ``torch.use_deterministic_algorithms(True)`` gives new memory (``torch.utils.deterministic.
    fill_uninitialized_memory``): for buffers the kernels write in full, where the fill would only add a memset
    per buffer and call."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        if strides is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, strides, dtype=dtype, device=device)
    shape = tuple(int(n) for n in shape)
    if strides is None:  # contiguous: set_ without strides gives torch.empty's
        extent, strides = math.prod(shape), ()
    else:
        strides = tuple(int(st) for st in strides)
        # Elements up to the last one the view reaches (none when a dim is empty).
        extent = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, strides))
    # A storage of its own is not filled; the 0-element tensor's fill writes nothing.
    storage = torch.UntypedStorage(extent * dtype.itemsize, device=device)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, strides)


def host_values(t: torch.Tensor) -> List:
    """A 1-d tensor's values as a Python list (``t.tolist()``), read through a host copy that torch's
    deterministic mode does not fill first (``tolist`` of a device tensor allocates one that it does)."""
    if t.device.type == "cpu":
        return t.tolist()
    host = unfilled(t.shape, t.dtype, "cpu")
    host.copy_(t)
    return host.tolist()
