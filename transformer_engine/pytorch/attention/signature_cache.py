"""Signature caches: what an attention call decides from its signature alone, kept per signature.

A call's signature is everything its host-side decisions read except the tensors' contents and addresses:
the module's and the call's arguments, each tensor's shape, strides, dtype, device and 16-byte alignment
(Triton specializes on it), the determinism request, and the raw values of the environment variables the
decisions read (``settings.snapshot_reader``: read at every call, so a changed variable misses the cache, as a
changed argument does). Argument checks whose outcome is a function of the signature, backend selection,
the launch plan and description, the grids and the compiled kernels are then computed on a signature's
first call and looked up on the next ones; what depends on the tensors (sequence values, outputs,
pointers) is still done per call. Two layers keep one each: ``DotProductAttention`` (its checks and
selection) and the kernel runner (its launches with everything but the tensors bound).

A cache entry is made only after the first call succeeded, so every bad input still raises from the full
path, with its argument's name.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

import torch

from transformer_engine.common import settings

__all__ = ["SignatureCache", "tensor_signature", "environment_signature", "clear_all", "caches"]

# Every declared NVTE_* variable (a variable added to settings joins the key by itself) and Triton's interpreter
# switch: what attention's host-side decisions may read.
environment_signature = settings.snapshot_reader(settings.declared_names() + ("TRITON_INTERPRET",))
environment_signature.__doc__ = "The raw values of the variables attention decisions read, now (one tuple)."

_registry: List["SignatureCache"] = []


class SignatureCache:
    """A bounded map from signatures to what was decided for them (the oldest entry leaves first), with
    hit and miss counts for tests and tools."""

    def __init__(self, name: str, max_entries: int = 1024) -> None:
        self.name = name
        self.max_entries = max_entries
        self.enabled = True  # False: every lookup misses and nothing is kept (tools and tests that watch decisions)
        self._entries: Dict[Hashable, object] = {}
        self.hits = 0
        self.misses = 0
        _registry.append(self)

    def get(self, key: Hashable) -> Optional[object]:
        entry = self._entries.get(key) if self.enabled else None
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: Hashable, entry: object) -> None:
        if not self.enabled:
            return
        if len(self._entries) >= self.max_entries:
            try:  # the oldest; another thread (autograd's backward) may be evicting it at the same time
                del self._entries[next(iter(self._entries))]
            except (KeyError, RuntimeError, StopIteration):
                pass
        self._entries[key] = entry

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


def caches() -> Tuple[SignatureCache, ...]:
    """Every signature cache of the process."""
    return tuple(_registry)


def clear_all() -> None:
    """Empty every signature cache (``launch_cache.clear`` does it too: entries hold compiled kernels)."""
    for cache in _registry:
        cache.clear()


def tensor_signature(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a decision may read of a tensor besides its contents: shape, strides, dtype, device and whether
    its address is 16-byte aligned. None for None."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
