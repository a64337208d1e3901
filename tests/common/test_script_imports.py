"""The repository's scripts use only project names that exist: a rename breaks this test, not a GPU call.

The scripts are the Python files outside the package and its tests (benchmarks, examples, tuning and GPU
machine scripts), which no other test imports. Each is read from its source (``ast``; imports inside
functions count too, as the scripts import lazily): every ``import transformer_engine...`` and
``from transformer_engine... import name`` must import and bind the name, and every attribute a script
reads or sets on a project module or class it imported that way (``kernel_runner.forward``,
``launch_description.backward_launches = ...``) must exist there. A name the script also binds otherwise (an assignment, a loop variable, an argument) is left
out: which object it holds is not known from the source alone.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "transformer_engine"


def _project_imports(tree: ast.AST) -> List[Tuple[str, str, str]]:
    """(module, name or "", bound alias) of every project import; name "" for ``import module``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    # ``import a.b.c`` binds ``a``; ``import a.b.c as x`` binds the module itself.
                    out.append((alias.name, "", alias.asname or ""))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            for alias in node.names:
                out.append((node.module, alias.name, alias.asname or alias.name))
    return out


# Covered elsewhere: the package (test_import_graph and every other test) and the tests themselves.
_NOT_SCRIPTS = {PACKAGE, "tests", ".git"}


def _scripts() -> List[Path]:
    """The repository's Python files outside the package and its tests that import from the project."""
    # Hidden folders are not the repository's scripts: .git, and the environments and caches the QA levels make
    # in the tree (.venv-newest, which qa/L0_newest may be building while this runs).
    paths = sorted(p for top in ROOT.iterdir() if top.is_dir() and top.name not in _NOT_SCRIPTS
                   and not top.name.startswith(".") for p in top.rglob("*.py") if "__pycache__" not in p.parts)
    return [p for p in paths if _project_imports(ast.parse(p.read_text(encoding="utf-8")))]


def _other_bindings(tree: ast.AST) -> Set[str]:
    """Names a file binds other than by import (assignments, loop targets, arguments, defs, classes)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _attributes(tree: ast.AST, names: Set[str]) -> List[Tuple[str, str, int]]:
    """(name, attribute, line) of every ``name.attribute`` (read or set) in the file."""
    return [(node.value.id, node.attr, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names]


def _resolve(module: str, name: str):
    mod = importlib.import_module(module)
    if not name:
        return mod
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")  # a submodule not imported by its package


SCRIPTS = _scripts()


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert "benchmarks/attention/bench_core.py" in names and len(names) > 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_project_names_used_by_the_script_exist(path):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = _project_imports(tree)
    bound: Dict[str, object] = {}
    missing = []
    for module, name, alias in imports:
        try:
            obj = _resolve(module, name)
        except ImportError as err:
            missing.append(f"{module}{'.' + name if name else ''}: {err}")
            continue
        if alias:
            bound[alias] = obj
    assert not missing, f"{path.name} imports what does not exist: {missing}"
    checked = {alias: obj for alias, obj in bound.items()
               if (inspect.ismodule(obj) or inspect.isclass(obj)) and alias not in _other_bindings(tree)}
    absent = [f"line {line}: {name}.{attr}" for name, attr, line in _attributes(tree, set(checked))
              if not hasattr(checked[name], attr)
              and not (inspect.ismodule(checked[name]) and _is_submodule(checked[name], attr))]
    assert not absent, f"{path.name} uses project attributes that do not exist: {absent}"


def _is_submodule(module, attr: str) -> bool:
    try:
        importlib.import_module(f"{module.__name__}.{attr}")
    except ImportError:
        return False
    return True


# Scripts marked throwaway (a line ``# throwaway: <why>`` at the top level) measure or probe the product's
# internals on purpose; they may use private names and are not kept working.
_THROWAWAY = "# throwaway:"


def _is_throwaway(text: str) -> bool:
    return any(line.startswith(_THROWAWAY) for line in text.splitlines())


def _private_uses(tree: ast.AST) -> List[str]:
    """Private project names the file imports (``from transformer_engine... import _x``, ``import ..._x``) or
    reads or sets on a project module or class it imported (``kernel_runner._run``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            found += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_")]
            if any(p.startswith("_") for p in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == PACKAGE and any(p.startswith("_") for p in a.name.split("."))]
    project = {alias or module.split(".")[0] for module, name, alias in _project_imports(tree)}
    found += [f"line {line}: {name}.{attr}" for name, attr, line in _attributes(tree, project)
              if attr.startswith("_") and not attr.startswith("__")]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_script_uses_no_private_project_names(path):
    """Outside tests/ only public names, except in scripts marked throwaway."""
    text = path.read_text(encoding="utf-8")
    if _is_throwaway(text):
        pytest.skip("marked throwaway")
    found = _private_uses(ast.parse(text))
    assert not found, f"{path.relative_to(ROOT)} uses private project names: {found}"
