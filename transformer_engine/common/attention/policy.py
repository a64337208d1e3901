"""Preference among backends that can all run a call: data on the backend classes, kept apart from
feasibility. Backends are tried by their ``PRIORITY``; one that declares where it was measured
faster than the fused kernels (``MEASURED_FASTER``, or ``MEASURED_FASTER_DETERMINISTIC`` for deterministic
calls where the backend declares it) keeps its place only there."""

from __future__ import annotations

from typing import List, Type

from transformer_engine.common.attention.config import AttnConfig


def _measured_slower_here(backend: Type, config: AttnConfig) -> bool:
    """``backend`` could run on this GPU generation but is not measured faster than the fused kernels
    for these head dims. On other GPUs (and on CPU) the order decides nothing, and trying it in its
    place puts why it cannot run into the NVTE_DEBUG log and the rejected reasons."""
    faster = backend.MEASURED_FASTER
    if config.deterministic and backend.MEASURED_FASTER_DETERMINISTIC is not None:
        faster = backend.MEASURED_FASTER_DETERMINISTIC
    if faster is None or config.compute_capability is None:
        return False
    major = config.compute_capability[0]
    if backend.SUPPORTED_ARCHS is not None and major not in backend.SUPPORTED_ARCHS:
        return False
    return (major, config.head_dim_qk, config.head_dim_v) not in faster


def order_backends(backends: List[Type], config: AttnConfig) -> List[Type]:
    """Candidates in the order they should be tried for ``config``: by ``PRIORITY``, except that a
    measured alternative not measured faster here goes right after the fused kernels."""
    fused_rank = min((b.PRIORITY for b in backends if b.IS_FUSED and b.MEASURED_FASTER is None), default=0)

    def rank(backend):
        if _measured_slower_here(backend, config):
            return (fused_rank, 1)
        return (backend.PRIORITY, 0)

    return sorted(backends, key=rank)
