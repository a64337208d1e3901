"""Package version: one source for setup.py, docs and runtime."""

__version__ = "0.1.0"
