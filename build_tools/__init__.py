"""Build logic for setup.py: which frameworks to build for, the version, package lists and
requirements, and the optional native extension (pybind11's setup helpers).

Nothing here imports torch or jax at module import time; frameworks are probed with
``importlib.util.find_spec`` (and, under pip's build isolation, in the interpreter outside it).
"""
