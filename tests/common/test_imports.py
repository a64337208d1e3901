"""Import boundaries: common/ needs neither torch nor jax, and a frontend whose framework is
missing fails with an ImportError that names the framework and how to install it.

A missing framework is simulated in a child interpreter whose first meta-path finder refuses
the framework's modules, exactly as Python reports a package that is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    BLOCKED = set(sys.argv[1].split(",")) - {""}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    target = sys.argv[2]
    try:
        module = importlib.import_module(target)
        if sys.argv[3] == "walk":  # import every submodule too
            for info in pkgutil.walk_packages(module.__path__, prefix=target + "."):
                importlib.import_module(info.name)
    except ImportError as err:
        print("IMPORT-ERROR:", type(err).__name__, err)
        sys.exit(3)
    loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "jax", "jaxlib", "flax"})
    print("LOADED:", ",".join(loaded))
    """
)


def _import_in_child(target: str, blocked, walk: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-c", _CHILD, ",".join(blocked), target, "walk" if walk else "no-walk"],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("target, walk", [("transformer_engine", False), ("transformer_engine.common", True)])
def test_common_imports_without_frameworks(target, walk):
    result = _import_in_child(target, ["torch", "jax", "jaxlib", "flax"], walk=walk)
    assert result.returncode == 0, f"importing {target} (and its submodules) needs a framework:\n{result.stdout}{result.stderr}"
    loaded = [line for line in result.stdout.splitlines() if line.startswith("LOADED:")]
    assert loaded == ["LOADED: "], f"importing {target} loaded a framework: {result.stdout}"


@pytest.mark.parametrize(
    "frontend, blocked, framework_words, build_hint",
    [
        ("transformer_engine.pytorch", ["torch"], ("PyTorch", "torch"), "deterministic-attention[pytorch]"),
        ("transformer_engine.jax", ["jax", "jaxlib", "flax"], ("JAX", "jax"), "deterministic-attention[jax]"),
    ],
)
def test_frontend_without_its_framework_says_what_is_missing(frontend, blocked, framework_words, build_hint):
    result = _import_in_child(frontend, blocked)
    assert result.returncode == 3, (
        f"importing {frontend} with {', '.join(blocked)} missing should raise ImportError:\n"
        f"{result.stdout}{result.stderr}"
    )
    message = result.stdout
    assert f"No module named '{frontend}'" not in message, f"{frontend} does not exist: {message}"
    assert any(word in message for word in framework_words), f"message does not name the framework: {message}"
    assert build_hint in message, f"message does not say how to build for it ({build_hint}): {message}"


def test_common_does_not_import_frameworks_in_source():
    """common/ imports neither torch nor jax (a source check catches lazy imports too)."""
    offenders = []
    for path in sorted((ROOT / "transformer_engine" / "common").rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            stripped = line.strip()
            for framework in ("torch", "jax", "flax"):
                if stripped.startswith((f"import {framework}", f"from {framework} ", f"from {framework}.")):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {stripped}")
    assert not offenders, "transformer_engine/common must stay framework-free:\n" + "\n".join(offenders)
