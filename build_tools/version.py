"""The package version, read from its one source: transformer_engine/common/version.py."""

from __future__ import annotations

import re
from pathlib import Path

# The distribution's own version; ``__version__`` there is the TransformerEngine API level with
# this as its local label, which is not a version pip may publish.
_VERSION_RE = re.compile(r"""^package_version\s*=\s*["']([^"']+)["']""", re.MULTILINE)


def te_version(root: Path) -> str:
    """``package_version`` from ``transformer_engine/common/version.py`` under ``root`` (not imported)."""
    path = Path(root) / "transformer_engine" / "common" / "version.py"
    match = _VERSION_RE.search(path.read_text(encoding="utf-8"))
    if match is None:
        raise RuntimeError(f"no `package_version = \"...\"` line in {path}")
    return match.group(1)
