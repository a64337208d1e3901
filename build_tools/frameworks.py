"""Which frameworks a build is for: NVTE_FRAMEWORK, or detection of what is installed.

Both frontends are pure Python and always shipped (build_tools/metadata.py); the answer decides
only whether the native JAX FFI extension is built (build_tools/native.py).

``NVTE_FRAMEWORK`` is declared (with every other NVTE_* variable) in
``transformer_engine/common/settings.py``; it is read through that module, loaded here from its
file so that the build never imports the package itself.

Accepted values: ``pytorch``, ``jax``, ``all`` (both), ``none`` (common only), a comma list
(``pytorch,jax``), or unset/empty (whatever is installed). A malformed value is an error. A
framework named but not installed is allowed (``pip install ".[pytorch]"`` builds before it
installs torch) and said in the build's note; building the JAX extension needs jax's headers and
stops with a clear error without them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Iterable, Optional, Tuple

__all__ = [
    "FRAMEWORKS",
    "FrameworkError",
    "load_settings",
    "parse_framework_request",
    "installed_frameworks",
    "resolve_frameworks",
    "frameworks_to_build",
]

# Framework name (as NVTE_FRAMEWORK spells it) -> the module that must be importable.
FRAMEWORKS: Dict[str, str] = {"pytorch": "torch", "jax": "jax"}
_ALIASES = {"torch": "pytorch"}
_ROOT = Path(__file__).resolve().parent.parent


class FrameworkError(RuntimeError):
    """NVTE_FRAMEWORK is malformed or names a framework that is not installed."""


def load_settings(root: Path = _ROOT) -> ModuleType:
    """``transformer_engine/common/settings.py`` as a standalone module (the package is not imported)."""
    name = "_transformer_engine_build_settings"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(root) / "transformer_engine" / "common" / "settings.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def parse_framework_request(value: Optional[str]) -> Optional[Tuple[str, ...]]:
    """The frameworks named by an NVTE_FRAMEWORK value, or None when it asks for detection."""
    if value is None or value.strip() == "":
        return None
    tokens = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not tokens:
        return None
    valid = ", ".join([*FRAMEWORKS, "all", "none"])
    chosen = []
    for token in tokens:
        token = _ALIASES.get(token, token)
        if token == "all":
            chosen.extend(FRAMEWORKS)
        elif token == "none":
            if len(tokens) > 1:
                raise FrameworkError(f"NVTE_FRAMEWORK must not combine 'none' with other names, got {value!r}")
        elif token in FRAMEWORKS:
            chosen.append(token)
        else:
            raise FrameworkError(
                f"NVTE_FRAMEWORK must be one of {valid}, or a comma list of them, got {value!r} "
                f"(unknown: {token!r})"
            )
    return tuple(name for name in FRAMEWORKS if name in chosen)  # canonical order, no duplicates


def _importable_here(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _importable_outside_build_env(module: str) -> bool:
    """Whether ``module`` is importable by this interpreter without pip's build isolation.

    pip's isolated build environment hides site-packages behind PYTHONPATH/PYTHONNOUSERSITE; a
    child interpreter without those sees what the user has installed.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONNOUSERBASE")}
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    try:
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def installed_frameworks(importable: Optional[Callable[[str], bool]] = None) -> Tuple[str, ...]:
    """Frameworks whose module can be imported (here, or outside pip's build isolation)."""
    if importable is None:
        def importable(module: str) -> bool:
            return _importable_here(module) or _importable_outside_build_env(module)
    return tuple(name for name, module in FRAMEWORKS.items() if importable(module))


def resolve_frameworks(value: Optional[str], installed: Iterable[str]) -> Tuple[Tuple[str, ...], str]:
    """``(frameworks the build is for, one-line explanation)`` for an NVTE_FRAMEWORK value.

    Raises :class:`FrameworkError` when the value is malformed.
    """
    installed = tuple(installed)
    requested = parse_framework_request(value)
    if requested is None:
        chosen = installed
        how = f"NVTE_FRAMEWORK is unset: detected {', '.join(installed) or 'no framework'}"
    else:
        chosen = requested
        how = f"NVTE_FRAMEWORK={value!r}: {', '.join(requested) or 'no framework'}"
    native = "the JAX FFI extension (if a CUDA toolkit is found)" if "jax" in chosen else "no native extension"
    note = f"{how}; both frontends ship (pure Python); building {native}"
    missing = [name for name in chosen if name not in installed]
    if missing:
        note += (f"; not installed in this Python yet: {', '.join(missing)} "
                 f"(`import {FRAMEWORKS[missing[0]]}` must work before its frontend is used)")
    return chosen, note


def frameworks_to_build(root: Path = _ROOT) -> Tuple[str, ...]:
    """Resolve NVTE_FRAMEWORK (read through the settings module) against what is installed."""
    settings = load_settings(root)
    value = settings.get("NVTE_FRAMEWORK")
    frameworks, note = resolve_frameworks(value, installed_frameworks())
    print(f"[transformer_engine build] {note}", flush=True)
    return frameworks
