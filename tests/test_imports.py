"""dask_ddp's modules import one another without a cycle: read from the source with ``ast``, nothing imported.

A cycle works only while one of its imports stays hidden inside a function or
under ``if TYPE_CHECKING:``, and it hides who uses whom. So every import
counts: imports inside functions close the cycle at run time, and a type-only
import still says that the lower module knows the upper one (where one side
only needs a shape, a ``typing.Protocol`` in the lower module says what it
needs). The kinds are reported apart: module-level cycles first, then cycles
counting imports in functions and type-only ones, each import labelled. A
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
    """``source`` imports ``target`` at ``where`` (file:line), inside ``function`` (None: at module level);
    ``type_only``: under ``if TYPE_CHECKING:`` (it never runs, and it still counts)."""

    source: str
    target: str
    where: str
    function: str | None
    type_only: bool = False

    def __str__(self) -> str:
        scope = f"in {self.function}()" if self.function else "module level"
        return f"{self.source} -> {self.target}  ({self.where}, {scope}{', type only' if self.type_only else ''})"

    @property
    def runs_on_import(self) -> bool:
        """True for an import that runs when ``source`` is imported: at module level and not type-only."""
        return not self.function and not self.type_only


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
    """Every import of one module of the package ``root`` by another: in functions or not, type-only or not."""
    files = module_files(root)
    edges = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        relative = path.relative_to(root.parent)
        for node, function, type_only in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, files):
                if target != name:
                    edges.append(Edge(name, target, f"{relative}:{node.lineno}", function, type_only))
    return edges


def _imports(tree: ast.AST, function: str | None = None, scope: str = "", type_only: bool = False):
    """``(import node, enclosing function or None, under TYPE_CHECKING)`` for every import of ``tree``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, function, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), function, scope, True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), function, scope, type_only)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}{node.name}"
            in_function = inner if not isinstance(node, ast.ClassDef) or function else function
            yield from _imports(node, in_function, f"{inner}.", type_only)
        else:
            yield from _imports(node, function, scope, type_only)


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
    assert [str(e) for e in edges if e.type_only] == ["pkg.sub.b -> pkg.c  (pkg/sub/b.py:3, module level, type only)"]
    c_d = ["pkg.c -> pkg.d  (pkg/c.py:1, module level)", "pkg.d -> pkg.c  (pkg/d.py:1, module level)"]
    assert [[str(hop[0]) for hop in hops] for hops in cycles([e for e in edges if e.runs_on_import])] == [c_d]
    runtime = [e for e in edges if not e.type_only]
    assert [[str(hop[0]) for hop in hops] for hops in cycles(runtime)] == [
        ["pkg.a -> pkg.sub.b  (pkg/a.py:2, module level)", "pkg.sub.b -> pkg.a  (pkg/sub/b.py:6, in K.f())"], c_d]
    assert "pkg.c -> pkg" in [f"{e.source} -> {e.target}" for e in edges]  # VERSION: the package's __init__


def test_the_detector_counts_a_cycle_closed_only_by_a_type_checking_import(tmp_path):
    """Two modules that know each other only through ``if TYPE_CHECKING:`` (the job <-> sinks shape issue 41 found):
    a cycle, labelled type only; an ``else:`` branch of it runs, and a ``typing.TYPE_CHECKING`` test is one too."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("from pkg.sinks import CSVSink\n")
    (pkg / "sinks.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg.job import Job\n"
                                  "else:\n    from pkg import other\n")
    (pkg / "other.py").write_text("")
    edges = import_graph(pkg)
    assert [(str(e), e.runs_on_import) for e in edges if e.source == "pkg.sinks"] == [
        ("pkg.sinks -> pkg.job  (pkg/sinks.py:3, module level, type only)", False),
        ("pkg.sinks -> pkg.other  (pkg/sinks.py:5, module level)", True)]
    assert cycles([e for e in edges if not e.type_only]) == []
    assert [[str(hop[0]) for hop in hops] for hops in cycles(edges)] == [
        ["pkg.job -> pkg.sinks  (pkg/job.py:1, module level)",
         "pkg.sinks -> pkg.job  (pkg/sinks.py:3, module level, type only)"]]
    assert "pkg.sinks -> pkg.job" in describe(cycles(edges)) and "type only" in describe(cycles(edges))


# ---- dask_ddp ------------------------------------------------------------------------------------------------

def test_no_import_cycle_at_module_level():
    found = cycles([e for e in import_graph(PACKAGE) if e.runs_on_import])
    assert not found, describe(found)


def test_no_import_cycle_counting_imports_in_functions():
    found = cycles([e for e in import_graph(PACKAGE) if not e.type_only])
    assert not found, describe(found)


def test_no_import_cycle_counting_type_only_imports():
    """Issue 25 asked for 0 cycles, type-only included: a ``typing.Protocol`` in the lower module, where one side
    only needs a shape (``observe.sinks.JobShape``, ``client.notices.Notifier``, ``sweeps.pickup.Continuing``)."""
    found = cycles(import_graph(PACKAGE))
    assert not found, describe(found)


def test_the_command_line_package_imports_neither_torch_nor_distributed():
    """``dask_ddp.cli``'s docstring promises a light import: the ranks of ``dask-ddp run`` import it to unpickle
    the script runner, and ``dask-ddp --help`` or a usage error should not pay for distributed (1.5 CPU-s each,
    13 such subprocesses in the CLI tests) or torch. Run in a fresh interpreter, which imports nothing before."""
    import subprocess
    import sys

    code = ("import sys, dask_ddp.cli, dask_ddp.cli.script\n"
            "print(sorted(m for m in ('torch', 'distributed', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["[]"], f"importing dask_ddp.cli also imported {out.stdout.strip()}"


def test_neither_the_package_nor_a_rank_imports_the_trainers():
    """Issue 43: importing dask-ddp, or what a rank's start imports (its environment for the trainers included),
    never imports Lightning, Transformers or Accelerate (seconds each); only dask_ddp.integrations.* do, and
    run(accelerate_config=...) inside the one function that reads the file. Read from the source, imports inside
    functions and type-only ones counted."""
    trainers = {"lightning", "pytorch_lightning", "transformers", "accelerate"}
    found, outside = [], []
    for name, path in module_files(PACKAGE).items():
        for node, function, _ in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if node.level == 0 else [])
            for target in names:
                if target.split(".")[0] in trainers:
                    found.append(name)
                    allowed = name.startswith("dask_ddp.integrations.") or (
                        name == "dask_ddp.client.accelerate_config" and function == "accelerate_environment")
                    if not allowed:
                        outside.append(f"{name} imports {target} ({path.name}:{node.lineno})")
    assert found, "the integrations import their libraries: this test reads imports"
    assert not outside, outside


def test_a_streaming_dataset_with_a_transform_of_its_own_does_not_import_torchvision(tmp_path):
    """``StreamingDataset`` looks for torchvision's ``ToTensor`` in ``transform`` (the batched decode); a transform
    of the user's cannot be one while ``torchvision.transforms`` is not imported, and importing it costs ~1.2 s
    (it pulls in sympy): each forked reader of tests/test_streaming_cleanup.py paid it (72 s of 50 cycles, 11 s
    without). Run in a fresh interpreter, with the shards written there first."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from dask_ddp.data import StreamingDataset, write_shards\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_streaming import make_folder\n"
        "make_folder(sys.argv[1] + '/src', n=12)\n"
        "write_shards(sys.argv[1] + '/src', sys.argv[1] + '/shards', progress=False, client=False)\n"
        "before = 'torchvision' in sys.modules\n"
        "ds = StreamingDataset(sys.argv[1] + '/shards', transform=lambda img: img)\n"
        "next(iter(ds.loader(4, collate_fn=list)))\n"
        "print(before, 'torchvision' in sys.modules, ds.batched)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "False"], out.stdout
