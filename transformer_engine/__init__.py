"""Transformer Engine (deterministic fused attention edition).

Framework frontends live in ``transformer_engine.pytorch`` and ``transformer_engine.jax``;
everything framework-free (settings, attention config, backend selection, launch plans, Triton
kernels) lives in ``transformer_engine.common``.
"""

from transformer_engine.common.version import __version__

__all__ = ["__version__"]
