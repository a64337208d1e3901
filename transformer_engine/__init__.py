"""Transformer Engine (deterministic fused attention edition).

Framework frontends live in ``transformer_engine.pytorch`` and ``transformer_engine.jax``;
everything framework-free (settings, attention config, backend selection, launch plans, Triton
kernels) lives in ``transformer_engine.common``.

``__version__`` is the TransformerEngine API level implemented, with this distribution's own
version (``package_version``) as its local label; see transformer_engine/common/version.py.
"""

from transformer_engine.common.version import __version__, package_version, te_api_level

__all__ = ["__version__", "package_version", "te_api_level"]
