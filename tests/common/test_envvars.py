"""Every NVTE_* name the code uses is declared in transformer_engine.common.settings, read through
it, and documented in docs/envvars.rst with the same type, default and description."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from transformer_engine.common import settings

ROOT = Path(__file__).resolve().parents[2]
ENVVARS_RST = ROOT / "docs" / "envvars.rst"
SETTINGS_PY = ROOT / "transformer_engine" / "common" / "settings.py"
# Whole upper-case names only: mixed-case identifiers such as the enum member NVTE_F16_arbitrary_seqlen
# (TransformerEngine-JAX's backend names) are not variables.
NAME_RE = re.compile(r"(?<![A-Za-z0-9_])NVTE_[A-Z0-9_]+(?![A-Za-z0-9_])")
# os.environ["NVTE_X"], os.environ.get("NVTE_X"), os.getenv("NVTE_X"), environ.setdefault(...)
DIRECT_READ_RE = re.compile(r"""(?:environ\s*(?:\.\s*(?:get|setdefault|pop))?\s*[\[(]|getenv\s*\()\s*f?["'](NVTE_[A-Z0-9_]+)""")
FIELDS = ("Type", "Default", "Description")
# Python constants that TransformerEngine names with the NVTE_ prefix; no environment variable is read.
CONSTANTS = {"NVTE_FP8_COLLECTION_NAME"}  # TransformerEngine-JAX's Flax collection of delayed-scaling state


def _sources() -> List[Path]:
    """Code that may read NVTE_* variables: the package, the build, and the qa/CI scripts."""
    files = sorted((ROOT / "transformer_engine").rglob("*.py"))
    files += sorted((ROOT / "build_tools").rglob("*.py"))
    files += [ROOT / "setup.py"]
    files += sorted((ROOT / "qa").rglob("*.sh"))
    files += [p for p in [ROOT / ".ci" / "run"] if p.exists()]
    return [f for f in files if f.is_file()]


def _occurrences(pattern: re.Pattern, paths: List[Path]) -> Dict[str, List[str]]:
    found: Dict[str, List[str]] = {}
    for path in paths:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                name = match.group(1) if pattern.groups else match.group(0)
                found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{lineno}")
    return found


def parse_envvars_rst(text: str) -> Dict[str, Dict[str, str]]:
    """``{name: {"Type": ..., "Default": ..., "Description": ...}}`` from ``.. envvar::`` blocks.

    Field bodies may wrap onto more-indented lines; inline-literal backquotes are dropped.
    """
    entries: Dict[str, Dict[str, str]] = {}
    current = None
    field = None
    for raw in text.splitlines():
        directive = re.match(r"^\.\. envvar::\s*(\S+)\s*$", raw)
        if directive:
            name = directive.group(1)
            if name in entries:
                raise AssertionError(f"docs/envvars.rst documents {name} twice")
            current, field = entries.setdefault(name, {}), None
            continue
        if current is None:
            continue
        if raw.strip() and not raw.startswith((" ", "\t")):
            current, field = None, None  # back at the top level: the directive block ended
            continue
        field_match = re.match(r"^\s+:([A-Za-z ]+):\s*(.*)$", raw)
        if field_match:
            field = field_match.group(1).strip()
            current[field] = field_match.group(2).strip()
        elif field is not None and raw.strip():
            current[field] = (current[field] + " " + raw.strip()).strip()
        elif not raw.strip():
            field = None
    return {name: {k: v.replace("``", "") for k, v in fields.items()} for name, fields in entries.items()}


def test_every_nvte_name_in_code_is_declared():
    used = _occurrences(NAME_RE, _sources())
    undeclared = {name: where for name, where in used.items()
                  if name not in settings.VARIABLES and name not in CONSTANTS}
    assert not undeclared, "NVTE_* names used but not declared in transformer_engine/common/settings.py:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in sorted(undeclared.items())
    )


def test_nvte_variables_are_read_through_settings():
    python_sources = [p for p in _sources() if p.suffix == ".py" and p != SETTINGS_PY]
    direct = _occurrences(DIRECT_READ_RE, python_sources)
    assert not direct, (
        "read NVTE_* variables with transformer_engine.common.settings.get(), not os.environ:\n"
        + "\n".join(f"  {name}: {', '.join(where)}" for name, where in sorted(direct.items()))
    )


def test_envvars_page_lists_exactly_the_declared_variables():
    documented = parse_envvars_rst(ENVVARS_RST.read_text(encoding="utf-8"))
    declared = set(settings.VARIABLES)
    assert not declared - set(documented), f"declared but missing from docs/envvars.rst: {sorted(declared - set(documented))}"
    assert not set(documented) - declared, f"documented but not declared in settings: {sorted(set(documented) - declared)}"


@pytest.mark.parametrize("name", sorted(settings.VARIABLES))
def test_envvars_page_matches_declaration(name: str):
    documented = parse_envvars_rst(ENVVARS_RST.read_text(encoding="utf-8"))
    if name not in documented:
        pytest.fail(f"{name} is declared in settings but has no `.. envvar:: {name}` in docs/envvars.rst")
    var = settings.VARIABLES[name]
    expected: Dict[str, str] = {"Type": var.type_doc, "Default": var.default_doc, "Description": var.description}
    mismatches: List[Tuple[str, str, str]] = [
        (field, documented[name].get(field, "<missing>"), expected[field])
        for field in FIELDS
        if documented[name].get(field, "<missing>") != expected[field]
    ]
    assert not mismatches, f"docs/envvars.rst disagrees with settings for {name}:\n" + "\n".join(
        f"  :{field}: page has {page!r}, settings has {want!r}" for field, page, want in mismatches
    )


def test_parser_reads_wrapped_fields_and_literals():
    text = (
        "Intro\n\n.. envvar:: NVTE_X\n\n   :Type: ``bool`` (0 or 1)\n   :Default: ``1``\n"
        "   :Description: first half\n      second half.\n\nAfter.\n"
    )
    assert parse_envvars_rst(text) == {
        "NVTE_X": {"Type": "bool (0 or 1)", "Default": "1", "Description": "first half second half."}
    }
