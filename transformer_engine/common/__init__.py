"""Framework-free core: settings, logging, attention config, backend selection, kernels.

Nothing under this package imports torch or jax.
"""
