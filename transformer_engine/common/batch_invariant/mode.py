"""The batch-invariant mode's switch, one for both frameworks: ``NVTE_BATCH_INVARIANT``, overridden per thread
by the innermost ``batch_invariant()`` context (PyTorch reads it at each call, JAX when a function is traced)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from transformer_engine.common import settings

__all__ = ["batch_invariant", "is_batch_invariant"]

_local = threading.local()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Turn the batch-invariant mode on (or off, with ``enabled=False``) for the calls (PyTorch) and traces
    (JAX) inside, whatever ``NVTE_BATCH_INVARIANT`` says. Nestable; per thread."""
    if not isinstance(enabled, bool):
        raise ValueError(f"`enabled` must be a bool, got {enabled!r}")
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def is_batch_invariant() -> bool:
    """Whether a GEMM or norm called (or traced) now runs in batch-invariant mode: the innermost
    ``batch_invariant`` context, else ``NVTE_BATCH_INVARIANT``."""
    stack = _local.__dict__.get("stack")
    if stack:
        return stack[-1]
    return settings.get("NVTE_BATCH_INVARIANT")
