"""The checkpointed regions open now (the activation-recompute frames of ``transformer_engine.pytorch.checkpoint``)
and what FP8's bookkeeping asks of them.

A leaf module: ``distributed`` (the checkpoint, which pushes and pops frames) and ``fp8`` / ``quantization_linear``
(which ask whether a recompute or a checkpointed first forward is running) both import it, and neither imports
the other for it.
"""

from __future__ import annotations

from typing import Any, List

# Innermost last. A frame has ``training`` (its first forward belongs to a training step) and ``replaying``
# (its recompute is running).
FRAMES: List[Any] = []


def in_checkpointed_training_forward() -> bool:
    """Whether a training step's checkpointed first forward is running (the reentrant one runs without
    gradients; the FP8 bookkeeping of a training forward still applies to it)."""
    return any(frame.training and not frame.replaying for frame in FRAMES)


def in_fp8_activation_recompute_phase() -> bool:
    """Whether a checkpoint's recompute is running (FP8 plans are replayed, scales are not updated)."""
    return any(frame.replaying for frame in FRAMES)
