"""dask_ddp's modules import one another without a cycle: read from the source with ``ast``, nothing imported.

A cycle works only while one of its imports stays hidden inside a function,
and it hides who uses whom. So imports inside functions count: they still close
the cycle at run time. The two kinds are reported apart, module-level cycles
first. Imports under ``if TYPE_CHECKING:`` do not count (they never run). A
package's ``__init__`` running before its submodules is not an edge (Python
does that for every package); naming the package is (``import dask_ddp``,
``from .. import __version__``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dask_ddp"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``where`` (file:line), inside ``function`` (None: at module level)."""

    source: str
    target: str
    where: str
    function: str | None

    def __str__(self) -> str:
        scope = f"in {self.function}()" if self.function else "module level"
        return f"{self.source} -> {self.target}  ({self.where}, {scope})"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package folder ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph(root: Path) -> list[Edge]:
    """Every import of one module of the package ``root`` by another, in functions or not."""
    files = module_files(root)
    edges = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        relative = path.relative_to(root.parent)
        for node, function in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, files):
                if target != name:
                    edges.append(Edge(name, target, f"{relative}:{node.lineno}", function))
    return edges


def _imports(tree: ast.AST, function: str | None = None, scope: str = ""):
    """``(import node, enclosing function or None)`` for every import that can run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, function
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), function, scope)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}{node.name}"
            in_function = inner if not isinstance(node, ast.ClassDef) or function else function
            yield from _imports(node, in_function, f"{inner}.")
        else:
            yield from _imports(node, function, scope)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, package: str, files: dict) -> list[str]:
    """The package's own modules that ``node`` imports (the longest known prefix of each name)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            base = ".".join(parent + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    found = []
    for dotted in names:
        parts = dotted.split(".")
        known = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None)
        if known and known not in found:
            found.append(known)
    return found


def cycles(edges: list[Edge]) -> list[list[list[Edge]]]:
    """One shortest cycle per strongly connected group of modules: a list of hops, each the imports making it."""
    graph: dict[str, dict[str, list[Edge]]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, []).append(e)
    found = []
    for group in _strongly_connected(graph):
        if len(group) > 1:
            found.append(_shortest_cycle(graph, min(group), group))
    return found


def _strongly_connected(graph: dict) -> list[set[str]]:
    """Tarjan's algorithm (the package is small: recursion is fine)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            groups.append(group)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups, key=min)


def _shortest_cycle(graph: dict, start: str, group: set[str]) -> list[list[Edge]]:
    came_from, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w in group and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        if start in came_from:
            break
        frontier = nxt
    hops, w = [], start
    while True:
        v = came_from[w]
        hops.append(graph[v][w])
        w = v
        if w == start:
            return hops[::-1]


def describe(found: list[list[list[Edge]]]) -> str:
    lines = [f"{len(found)} import cycle(s) in dask_ddp:"]
    for hops in found:
        lines.append("  " + " -> ".join([hops[0][0].source] + [hop[0].target for hop in hops]))
        lines += [f"      {e}" for hop in hops for e in hop]
    return "\n".join(lines)


# ---- the detector itself, on a package made for it -----------------------------------------------------------

def test_the_detector_finds_and_labels_both_kinds(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("import os\nfrom .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                                      "class K:\n    def f(self):\n        from .. import a\n")
    (pkg / "c.py").write_text("from pkg import d, VERSION\n")
    (pkg / "d.py").write_text("import pkg.c.x\n")
    edges = import_graph(pkg)
    assert not [e for e in edges if e.target == "pkg.c" and e.source == "pkg.sub.b"]  # TYPE_CHECKING only
    c_d = ["pkg.c -> pkg.d  (pkg/c.py:1, module level)", "pkg.d -> pkg.c  (pkg/d.py:1, module level)"]
    assert [[str(hop[0]) for hop in hops] for hops in cycles([e for e in edges if not e.function])] == [c_d]
    assert [[str(hop[0]) for hop in hops] for hops in cycles(edges)] == [
        ["pkg.a -> pkg.sub.b  (pkg/a.py:2, module level)", "pkg.sub.b -> pkg.a  (pkg/sub/b.py:6, in K.f())"], c_d]
    assert "pkg.c -> pkg" in [f"{e.source} -> {e.target}" for e in edges]  # VERSION: the package's __init__


# ---- dask_ddp ------------------------------------------------------------------------------------------------

def test_no_import_cycle_at_module_level():
    found = cycles([e for e in import_graph(PACKAGE) if not e.function])
    assert not found, describe(found)


def test_no_import_cycle_counting_imports_in_functions():
    found = cycles(import_graph(PACKAGE))
    assert not found, describe(found)
