"""No import circles among transformer_engine's modules.

The graph is read from the source (``ast``), so imports inside functions count too: a lazy import
that closes a circle works only as long as nobody moves it to the top of its file, and it hides
which module depends on which. An edge goes to the module an import names (``from a.b import c``:
to ``a.b.c`` when that is a module, else to ``a.b``); a package's ``__init__`` is not added as an
implicit edge of its submodules, as Python has started initialising it by then anyway.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "transformer_engine"


def _modules() -> Dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


@functools.lru_cache(maxsize=None)
def _bound_names(path: Path) -> Set[str]:
    """Names a module binds at any level (imports, defs, classes, assignments)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def import_graph() -> Dict[str, Set[str]]:
    """module -> the transformer_engine modules it imports (anywhere in its source)."""
    modules = _modules()

    def owner(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        parent = parent.rpartition(".")[0]
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:
                        targets.append(full)
                    elif base in modules and modules[base].name == "__init__.py" \
                            and alias.name not in _bound_names(modules[base]):
                        continue  # a submodule that is not Python source (a native extension)
                    else:
                        targets.append(owner(base))
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def import_circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def _edges_within(graph: Dict[str, Set[str]], circle: List[str]) -> str:
    members = set(circle)
    return "\n".join(f"    {a} -> {b}" for a in circle for b in sorted(graph[a] & members))


def test_no_import_circles():
    graph = import_graph()
    circles = import_circles(graph)
    assert not circles, "import circles among transformer_engine modules:\n" + "\n".join(
        f"  {' <-> '.join(c)}\n{_edges_within(graph, c)}" for c in circles)


def test_the_check_finds_a_circle():
    """The checker itself: a two-module circle through a lazy import is found, a chain is not."""
    assert import_circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph()
    assert "transformer_engine.pytorch.attention.kernel_runner" in graph["transformer_engine.pytorch.attention.ops"]
    # a lazy (function-level) import is an edge too
    assert "transformer_engine.jax.attention" in graph["transformer_engine.jax.cpp_extensions"]
