"""setuptools commands adjusted for builds whose package list changes between runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools.command.build_py import build_py

__all__ = ["FreshBuildPy"]


class FreshBuildPy(build_py):
    """``build_py`` that first empties ``build/lib/transformer_engine``.

    pip builds in the source tree, so ``build/lib`` outlives a build: without this, a wheel built
    with NVTE_FRAMEWORK=jax after one built for pytorch would still carry the pytorch frontend.
    """

    def run(self):
        if not self.editable_mode:
            stale = Path(self.build_lib) / "transformer_engine"
            if stale.is_dir():
                shutil.rmtree(stale)
        super().run()
