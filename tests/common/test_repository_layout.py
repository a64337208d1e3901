"""The repository is the product: its code, tests and user documentation explain themselves and cite
nothing outside the repository, and nothing in them depends on the development folder (dev/:
tuning scripts, GPU-machine recipes, the attempts log and raw measurements)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Iterator, List

import pytest

ROOT = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()

TEXT_SUFFIXES = {".py", ".rst", ".md", ".txt", ".sh", ".toml", ".cfg", ".ini", ".cpp", ".cc", ".h", ".hpp", ".cu",
                 ".cuh", ".yaml", ".yml", ".json"}

# What a comment or document may not cite: the development folder and its notes, lab sessions,
# notes entries and design files that live outside the repository, and the old homes of dev tooling.
CITATIONS = {
    "the development folder (dev/)": re.compile(r"(?<![\w./-])dev/"),
    "the attempts log (NOTES.md)": re.compile(r"\bNOTES(\.md)?\b"),
    "a notes entry": re.compile(r"\bentr(y|ies) \d+"),
    "a session number": re.compile(r"\bsessions? ?\d+|\bsession-\d", re.IGNORECASE),
    "a design file outside the repository": re.compile(r"\b(DESIGN|ANCHORS)\.md\b"),
    "a moved dev path": re.compile(r"\btools/device\b|\bqa/results\b"),
}
# Product code states no dates of experiments either.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def files(*parts: str) -> Iterator[Path]:
    for part in parts:
        path = ROOT / part
        if path.is_file():
            yield path
            continue
        for p in sorted(path.rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts \
                    and "_build" not in p.parts and p.resolve() != THIS:
                yield p


def offending_lines(paths: Iterator[Path], patterns: dict) -> List[str]:
    found = []
    for path in paths:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for what, pattern in patterns.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{lineno}: cites {what}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("part", ["transformer_engine", "docs", "README.md", "examples", "tests", "qa",
                                  "benchmarks/README.md", "benchmarks/attention", "benchmarks/results/README.md"])
def test_product_and_user_docs_cite_nothing_outside_the_repository(part):
    """State the reason itself ("separate dQ pass: measured faster than atomic dQ on the H200"), not
    where a developer once wrote it down."""
    found = offending_lines(files(part), CITATIONS)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("part", ["transformer_engine", "examples", "README.md"])
def test_product_code_states_no_dates(part):
    found = offending_lines(files(part), {"a date": DATE})
    assert not found, "\n".join(found)


def dev_module_names() -> set:
    return {p.stem for p in (ROOT / "dev").rglob("*.py")} | {"dev"}


def dev_dependencies(text: str, label: str, dev_modules: set) -> List[str]:
    """Imports of dev/ modules, and string constants that name the dev/ folder (a sys.path entry)."""
    found = []
    for node in ast.walk(ast.parse(text, filename=label)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value == "dev" or CITATIONS["the development folder (dev/)"].search(node.value):
                found.append(f"{label}:{node.lineno}: names dev/ ({node.value[:60]!r})")
            continue
        else:
            continue
        found += [f"{label}:{node.lineno}: imports {name} from dev/" for name in names
                  if name.split(".")[0] in dev_modules]
    return found


@pytest.mark.parametrize("part", ["transformer_engine", "tests", "benchmarks", "examples"])
def test_nothing_imports_from_dev(part):
    dev_modules = dev_module_names()
    found = []
    for path in files(part):
        if path.suffix == ".py":
            found += dev_dependencies(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)), dev_modules)
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_should():
    """The patterns above, on lines that must and must not match."""
    bad = ["# measured faster (NOTES.md entry 12)", "see benchmarks/attention/NOTES.md", "session 8, run 2",
           "(DESIGN.md, rule 3)", "python dev/tuning/tune_tiles.py", "qa/results/gpu_runs.md"]
    good = ["> /dev/null 2>&1", "std_dev/2", "scope='session'", "the determinism contract", "stddev"]
    for line in bad:
        assert any(p.search(line) for p in CITATIONS.values()), line
    for line in good:
        assert not any(p.search(line) for p in CITATIONS.values()), line
    src = ("import sys\nfrom pathlib import Path\n"
           "sys.path.insert(0, str(Path(__file__).parents[2] / 'dev' / 'tuning'))\n"
           "from tune_tiles import CANDIDATES\nimport dev.tuning.ws_kernels\nimport tuner\n")
    found = dev_dependencies(src, "m.py", {"tune_tiles", "dev"})
    assert sorted(f.split(":")[1] for f in found) == ["3", "4", "5"], found


def test_dev_folder_says_what_it_is_and_is_not_shipped():
    readme = ROOT / "dev" / "README.md"
    assert readme.is_file(), "dev/README.md must say what the development folder holds"
    sys.path.insert(0, str(ROOT))  # build_tools/ is not installed
    try:
        from build_tools.metadata import packages
    finally:
        sys.path.remove(str(ROOT))
    shipped = packages(ROOT)
    assert shipped and all(p == "transformer_engine" or p.startswith("transformer_engine.") for p in shipped), shipped


def test_every_result_file_is_described_with_its_command():
    """benchmarks/results/ holds only the latest results a user reads, each listed in its README
    (what it is, the command and the date); intermediate measurements belong in dev/results/."""
    results = ROOT / "benchmarks" / "results"
    readme = (results / "README.md").read_text(encoding="utf-8")
    listed = set()
    for name in re.findall(r"`([\w.{},-]+)`", readme):
        brace = re.fullmatch(r"([\w.-]*)\{([\w,]+)\}([\w.-]*)", name)
        listed |= {brace.group(1) + ext + brace.group(3) for ext in brace.group(2).split(",")} if brace else {name}
    present = {p.name for p in results.iterdir() if p.is_file() and p.name != "README.md"}
    assert present <= listed, f"not described in benchmarks/results/README.md: {sorted(present - listed)}"
