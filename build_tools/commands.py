"""setuptools commands adjusted for this project's builds."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py

__all__ = ["FreshBuildPy"]


class FreshBuildPy(build_py):
    """``build_py`` that first empties ``build/lib/transformer_engine``.

    pip builds in the source tree, so ``build/lib`` outlives a build: a pure wheel built after one
    with the JAX FFI extension would otherwise still carry the compiled module (and a stale copy of
    any file removed since).
    """

    def run(self):
        package_dir = Path(self.build_lib) / "transformer_engine"
        if not self.editable_mode and package_dir.is_dir():
            shutil.rmtree(package_dir)
        super().run()
