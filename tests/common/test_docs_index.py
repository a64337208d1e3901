"""docs/index.rst's tables of contents list every page once (issue 69: a glob relisted 18 pages under "More",
and Megatron, MaxText and validation were reachable only there), and docs/integrations.rst links the pages of
the integrations it does not cover itself. Reads the .rst files; the Sphinx build (qa/L0_common_unittest,
``sphinx -W``) fails on a page that no table of contents lists."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _toctrees(text: str):
    """Each ``.. toctree::`` block's options and entries, in order."""
    trees = []
    for block in re.split(r"^\.\. toctree::\s*$", text, flags=re.M)[1:]:
        options, entries = [], []
        for line in block.splitlines()[1:]:
            if line.strip() and not line.startswith("   "):
                break  # the block ends at the first line not indented under it
            item = line.strip()
            if item.startswith(":"):
                options.append(item)
            elif item:
                entries.append(item)
        trees.append((options, entries))
    return trees


def test_index_lists_every_top_level_page_once_without_a_glob():
    trees = _toctrees((DOCS / "index.rst").read_text(encoding="utf-8"))
    assert trees and not any(":glob:" in options for options, _ in trees)
    listed = [entry for _, entries in trees for entry in entries]
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)
    pages = {p.stem for p in DOCS.glob("*.rst")} - {"index"}
    assert set(listed) == pages, (sorted(pages - set(listed)), sorted(set(listed) - pages))


def test_megatron_maxtext_and_validation_are_in_the_main_toctree_and_linked_from_integrations():
    trees = _toctrees((DOCS / "index.rst").read_text(encoding="utf-8"))
    listed = {entry for _, entries in trees for entry in entries}
    assert {"megatron", "maxtext", "validation", "integrations"} <= listed
    links = set(re.findall(r":doc:`([^`<>]+)`", (DOCS / "integrations.rst").read_text(encoding="utf-8")))
    assert {"megatron", "maxtext", "validation"} <= links, links
