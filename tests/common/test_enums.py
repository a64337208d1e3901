"""The attention enums are one family whose mask and layout predicates are methods: a mask predicate
read without its call is a bound method, always true, so the package must never read one so."""

from __future__ import annotations

import re
from pathlib import Path

from transformer_engine.common.attention.enums import AttnMaskType, QKVLayout

ROOT = Path(__file__).resolve().parents[2]
PREDICATES = ("is_causal", "is_padding", "is_bottom_right", "is_top_left_causal", "is_thd", "is_qkvpacked",
              "is_kvpacked", "is_separate")


def test_mask_and_layout_predicates_are_methods():
    for name in PREDICATES:
        cls = AttnMaskType if hasattr(AttnMaskType, name) else QKVLayout
        assert callable(getattr(cls, name)) and not isinstance(vars(cls)[name], property), name
    assert AttnMaskType.CAUSAL_MASK.is_causal() is True and AttnMaskType.NO_MASK.is_causal() is False
    assert QKVLayout.T3HD.is_thd() is True and QKVLayout.BS3HD.is_thd() is False


def test_no_predicate_is_read_without_its_call():
    """``mask.is_causal`` (no call) would be true for every mask; scan the package, tests, examples and benchmarks for the
    mask predicates (the layout's names are taken by properties of other objects, e.g. ``split.is_thd``)."""
    pattern = re.compile(r"\.(%s)\b(?!\s*\()" % "|".join(PREDICATES[:4]))
    found = []
    for folder in ("transformer_engine", "tests", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():  # this file spells the wrong form on purpose
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []
    assert pattern.search("x = mask.is_causal and y") and not pattern.search("x = mask.is_causal() and y")
