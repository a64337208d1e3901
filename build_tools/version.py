"""The package version, read from its one source: transformer_engine/common/version.py."""

from __future__ import annotations

import re
from pathlib import Path

_VERSION_RE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.MULTILINE)


def te_version(root: Path) -> str:
    """``__version__`` from ``transformer_engine/common/version.py`` under ``root`` (not imported)."""
    path = Path(root) / "transformer_engine" / "common" / "version.py"
    match = _VERSION_RE.search(path.read_text(encoding="utf-8"))
    if match is None:
        raise RuntimeError(f"no `__version__ = \"...\"` line in {path}")
    return match.group(1)
