"""Sphinx configuration. Build: ``sphinx-build -W docs <out>`` (warnings are errors in CI)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document the source tree, installed or not

from build_tools.version import te_version  # noqa: E402

project = "deterministic-attention"
author = "The project's contributors"
copyright = "the project's contributors"
release = te_version(ROOT)
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
]

# Nothing is mocked: the API pages import transformer_engine.common, .pytorch and .jax (the docs
# build runs where the test requirements are installed), and a page that fails to import fails.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
html_theme = "furo"  # pinned in requirements/test.txt; code blocks scroll instead of being clipped
html_title = f"deterministic-attention {release}"
html_static_path = []

# Docstrings name mask families with a leading wildcard ("*_bottom_right"), which docutils reads
# as the start of emphasis. Render such words as literals instead.
_WILDCARD_NAME = re.compile(r"(?<![`\w\\*])\*(_[A-Za-z][A-Za-z0-9_]*)")


def _literal_wildcards(app, what, name, obj, options, lines):
    lines[:] = [_WILDCARD_NAME.sub(r"``*\1``", line) for line in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _literal_wildcards)

