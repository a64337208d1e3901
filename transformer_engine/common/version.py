"""Package version: one source for setup.py, docs and runtime.

Versions follow SemVer from 0.x up, for the ``deterministic-attention`` distribution; they are
unrelated to NVIDIA TransformerEngine's (2.x), which pip never compares with ours because the
distribution names differ.
"""

__version__ = "0.2.0"
