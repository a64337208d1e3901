"""A metadata-only ``transformer-engine`` distribution that stands for ``deterministic-attention``.

Tools that decide whether TransformerEngine is installed by asking ``importlib.metadata`` for the
distribution ``transformer-engine`` (Hugging Face Accelerate's ``is_transformer_engine_available``;
Megatron-core's version checks when ``transformer_engine.__version__`` is missing) do not see this
project, whose distribution is ``deterministic-attention``. This distribution declares that name
and nothing else: no modules (the import package ``transformer_engine`` stays the one
``deterministic-attention`` installs), the version ``transformer_engine.__version__`` reports (the
TransformerEngine API level with this project's version as its local label), and an exact
requirement on ``deterministic-attention``. README.md beside this file says what it does and does
not claim.

Built from its place in a checkout (it reads ``transformer_engine/common/version.py`` two folders
up, so its versions cannot drift from the package's)::

    pip install --no-build-isolation .                   # the package, first
    pip install --no-build-isolation ./shims/transformer-engine
"""

import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
VERSION_PY = HERE.parents[1] / "transformer_engine" / "common" / "version.py"


def read_versions():
    """(``__version__``, ``package_version``) of transformer_engine/common/version.py, which imports
    nothing and only assigns strings, so running it here is reading it."""
    if not VERSION_PY.is_file():
        sys.exit(f"error: {VERSION_PY} not found: build this distribution from shims/transformer-engine in a "
                 "checkout of deterministic-attention, beside the package it stands for")
    namespace = {}
    exec(compile(VERSION_PY.read_text(encoding="utf-8"), str(VERSION_PY), "exec"), namespace)
    return namespace["__version__"], namespace["package_version"]


TE_VERSION, PACKAGE_VERSION = read_versions()
REQUIREMENT = f"deterministic-attention=={PACKAGE_VERSION}"

setup(
    name="transformer-engine",
    version=TE_VERSION,
    description=("Metadata-only alias: the transformer_engine import package here is deterministic-attention's, "
                 "not NVIDIA's TransformerEngine"),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=[],
    py_modules=[],
    install_requires=[REQUIREMENT],
    # NVIDIA's distribution names its frameworks as extras; a requirement such as
    # "transformer-engine[pytorch]" resolves to this package's own extra.
    extras_require={"pytorch": [f"deterministic-attention[pytorch]=={PACKAGE_VERSION}"],
                    "jax": [f"deterministic-attention[jax]=={PACKAGE_VERSION}"]},
    zip_safe=True,
)
