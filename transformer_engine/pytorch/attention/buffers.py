"""New buffers without the fill of torch's deterministic mode, and host values moved without a sync.

``torch.use_deterministic_algorithms(True)`` fills every new tensor's memory
(``torch.utils.deterministic.fill_uninitialized_memory``): a memset per buffer. The fused path's kernels
write their outputs in full, and the host reads of ``cu_seqlens`` overwrite their copy at once, so these
allocate without it. :func:`to_device` sends integer arrays built on the host to a device in one copy that
does not wait for the device (a KV-cache step's metadata).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import List, Sequence, Tuple

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


_FORMATS = {torch.int32: "i", torch.int64: "q"}
_ALIGN = 16  # bytes: Triton specializes a pointer on 16-byte alignment, so every view starts at such a boundary


@functools.lru_cache(maxsize=256)
def _packing(sizes: Tuple[Tuple[int, torch.dtype], ...]) -> Tuple[struct.Struct, Tuple[int, ...]]:
    """(the struct that packs arrays of these (length, dtype), each at a 16-byte boundary; their byte offsets)."""
    fmt, offsets, size = ["<"], [], 0
    for n, dtype in sizes:
        pad = -size % _ALIGN
        fmt.append(f"{pad}x{n}{_FORMATS[dtype]}")
        offsets.append(size + pad)
        size += pad + n * dtype.itemsize
    fmt.append(f"{-size % _ALIGN}x")
    return struct.Struct("".join(fmt)), tuple(offsets)


@torch.compiler.disable  # host work on host values: run as it is (a traced step calls it eagerly)
def to_device(arrays: Sequence[Tuple[Sequence[int], torch.dtype]], device) -> List[torch.Tensor]:
    """Integer arrays (``(values, torch.int32 or torch.int64)``) built on the host, as tensors on ``device``
    without a sync: packed into one buffer (each at a 16-byte boundary, so a view's alignment is the same
    every time), pinned on CUDA and copied once, non-blocking (torch's pinned-memory allocator keeps the host
    buffer until the copy has run). Returns one view of the device buffer per array, in order."""
    packing, offsets = _packing(tuple((len(values), dtype) for values, dtype in arrays))
    flat = []
    for values, _ in arrays:
        flat += values
    host = torch.frombuffer(bytearray(packing.pack(*flat)), dtype=torch.uint8)
    device = torch.device(device)
    if device.type == "cuda":
        pinned = torch.empty(packing.size, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(host)
        host = pinned.to(device, non_blocking=True)
    elif device.type != "cpu":
        host = host.to(device)
    typed = {dtype: host.view(dtype) for _, dtype in arrays}
    return [typed[dtype][offset // dtype.itemsize:offset // dtype.itemsize + len(values)]
            for offset, (values, dtype) in zip(offsets, arrays)]
