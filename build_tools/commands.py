"""setuptools commands adjusted for builds whose package list changes between runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Tuple

from setuptools.command.build_py import build_py

__all__ = ["FreshBuildPy", "LEFT_OUT_MARKER", "left_out_stub"]

LEFT_OUT_MARKER = "is not part of this installation"


def left_out_stub(framework: str, built: Tuple[str, ...]) -> str:
    """Source of ``transformer_engine/<framework>/__init__.py`` in a wheel built without it."""
    built_for = ",".join(built) if built else "none"
    return (
        f'"""Placeholder: this wheel was built with NVTE_FRAMEWORK={built_for}, without {framework}."""\n\n'
        "raise ImportError(\n"
        f'    "transformer_engine.{framework} {LEFT_OUT_MARKER}: it was built with "\n'
        f'    "NVTE_FRAMEWORK={built_for}. Install {framework}, then rebuild for it: "\n'
        f'    "NVTE_FRAMEWORK={framework} pip install . (or NVTE_FRAMEWORK=all)"\n'
        ")\n"
    )


class FreshBuildPy(build_py):
    """``build_py`` for a package list that depends on NVTE_FRAMEWORK.

    - It first empties ``build/lib/transformer_engine``: pip builds in the source tree, so
      ``build/lib`` outlives a build, and a wheel built for jax after one built for pytorch
      would otherwise still carry the pytorch frontend.
    - For each frontend left out (``all_frameworks`` minus ``frameworks``), it writes a
      one-line ``__init__.py`` that raises ImportError saying how to build for it, instead of
      Python's bare "No module named ...".
    """

    frameworks: Tuple[str, ...] = ()
    all_frameworks: Tuple[str, ...] = ("pytorch", "jax")

    def run(self):
        package_dir = Path(self.build_lib) / "transformer_engine"
        if not self.editable_mode and package_dir.is_dir():
            shutil.rmtree(package_dir)
        super().run()
        if self.editable_mode:
            return
        for framework in self.all_frameworks:
            if framework not in self.frameworks:
                stub = package_dir / framework / "__init__.py"
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text(left_out_stub(framework, tuple(self.frameworks)), encoding="utf-8")
