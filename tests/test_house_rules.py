"""The house rules beside the wing table (``test_wings``): what is private stays in its module, and how big a module
may grow. Read from the source with ``ast`` and ``tokenize``, nothing of dask_ddp imported; each rule is shown
failing on a small made-up case first, then applied to the package.

- **Private names.** No module uses another module's underscore names: ``from x import _y``, ``x._y`` where ``x`` is
  a dask_ddp module or a name imported from one (``Job._start``, ``dispatch._plan``), nor a satellite's reach into
  another module's objects: ``obj._f`` on a name other than ``self``/``cls`` where ``_f`` is an attribute that only
  *other* dask_ddp modules define (``driver._asked += 1`` in a module beside the driver). Where a module needs
  something, its owner gives it a public name or a small accessor with a docstring. :data:`ALLOWED` lists the few
  uses kept, each with its reason; an entry that no longer occurs fails the test, so the list only shrinks.
- **Size.** A module holds at most :data:`MAX_CODE_LINES` lines of code: lines with a token of code, so docstrings,
  comment-only lines and blank lines do not count and documentation is never what gets cut. The bound: the largest
  modules today are client/controller.py (311 code lines), sweeps/driver.py (303) and worker/supervisor.py (277);
  the median module has 76 and the 90th percentile 196. 350 leaves the largest 39 lines of room, and two concepts
  of the 90th percentile's size (392) do not fit in one module. It replaces the rule of 400 lines in all, which
  counted a docstring like a line of code (the two densest modules were the two at that bound) and was met by
  cutting blank lines or carving out satellites.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

from test_imports import PACKAGE, module_files

ROOT = PACKAGE.parent
MAX_CODE_LINES = 350

#: (module using it, what it uses) -> why it stays. ``what`` is ``owner.name`` for a private name of another
#: dask_ddp module (or of a name imported from one), ``*._name`` for a satellite's reach into an object.
ALLOWED: dict[tuple[str, str], str] = {
    ("dask_ddp.client.dispatch", "*._start"):
        "dispatch is the one maker of a Job: it builds the handle, binds its control, then starts it (a public "
        "start() would be a second way for users to launch a job)",
    ("dask_ddp.compat.dispatch", "*._start"):
        "the 0.2 compatibility run() makes and starts its Job as client.dispatch does",
    ("dask_ddp.dashboard.page", "*._loop"):
        "bokeh's ApplicationContext._loop, bokeh's own private (the name is also a method of worker.relay's "
        "Relay): bokeh has no public way to give a context the server's loop",
    ("dask_ddp.observe.display", "*._record"):
        "the HTML view of a Job reads its record (state, telemetry, stragglers); a public Job.record would put "
        "an internal class in Job's public API",
    ("dask_ddp.observe.progress", "*._record"):
        "the progress bar of a Job reads its record (steps and latest metrics), as observe.display does",
}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@dataclass(frozen=True)
class Use:
    """Module ``user`` uses ``what`` (``owner.name``, or ``*._name`` for an attribute of an object) at ``where``."""

    user: str
    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.user} uses {self.what}"


def _owner(dotted: str, files: dict) -> str | None:
    """The package's module that ``dotted`` names or lies in (the longest known prefix)."""
    parts = dotted.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes and names it assigns, ``self._x``/``cls._x`` it
    assigns."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and private(node.id):
            found.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.add(node.attr)
    return found


def private_uses(root: Path) -> list[Use]:
    """Every use in the package ``root`` of another module's private names (see the module's docstring)."""
    files = module_files(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
    defined = {name: _defined(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        path = files[name]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        where = str(path.relative_to(root.parent))
        bound: dict[str, str] = {}  # local name -> the dotted package name it was imported as
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([node.module] if node.module else []))
                if _owner(base, files) is None:
                    continue
                for alias in node.names:
                    dotted = f"{base}.{alias.name}"
                    if private(alias.name) and _owner(dotted, files) != name:
                        found.append(Use(name, dotted, f"{where}:{node.lineno}"))
                    bound[alias.asname or alias.name] = dotted
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _owner(alias.name, files) is not None:
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else local
        mine = defined[name]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            chain = _dotted(node.value)
            head = None if chain is None else chain.split(".")[0]
            if chain is not None and head in bound:  # an imported module or name: x._y
                dotted = bound[head] + chain[len(head):] + "." + node.attr
                if _owner(dotted, files) != name:
                    found.append(Use(name, dotted, f"{where}:{node.lineno}"))
            elif chain not in ("self", "cls") and node.attr not in mine and any(
                    node.attr in d for other, d in defined.items() if other != name):
                found.append(Use(name, f"*.{node.attr}", f"{where}:{node.lineno}"))  # a satellite's reach
    return found


def unexplained(uses: list[Use], allowed: dict) -> tuple[list[Use], list[tuple[str, str]]]:
    """The uses not in ``allowed``, and the entries of ``allowed`` no use needs any more (stale)."""
    seen = {(u.user, u.what) for u in uses}
    return [u for u in uses if (u.user, u.what) not in allowed], sorted(set(allowed) - seen)


# ---- the private-name rule on a package made for it --------------------------------------------------------------

def test_the_private_name_rule_finds_each_kind_and_lets_public_and_own_names_pass(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "driver.py").write_text("_QUEUE = []\n\nclass Driver:\n    def __init__(self):\n        self._asked = 0\n"
                                   "\n    def _ask(self):\n        self._asked += 1\n        return self._ask\n"
                                   "\n\ndef plan():\n    return _QUEUE\n")
    (pkg / "sub" / "resume.py").write_text(
        "import pkg.driver\nfrom pkg import driver as d\nfrom .. import driver\nfrom ..driver import _QUEUE, plan\n"
        "from pkg.driver import Driver\n\n"
        "def resume(drv, fs):\n    drv._asked += 1\n    fs._strip_protocol('x')\n    plan()\n"
        "    return pkg.driver._QUEUE, d._QUEUE, driver.Driver._ask, Driver()._asked, Driver._ask\n")
    uses = private_uses(pkg)
    assert [str(u) for u in uses] == [
        "pkg/sub/resume.py:4: pkg.sub.resume uses pkg.driver._QUEUE",
        "pkg/sub/resume.py:8: pkg.sub.resume uses *._asked",  # a satellite: the driver's field, edited
        "pkg/sub/resume.py:11: pkg.sub.resume uses pkg.driver._QUEUE",
        "pkg/sub/resume.py:11: pkg.sub.resume uses pkg.driver._QUEUE",
        "pkg/sub/resume.py:11: pkg.sub.resume uses pkg.driver.Driver._ask",
        "pkg/sub/resume.py:11: pkg.sub.resume uses *._asked",
        "pkg/sub/resume.py:11: pkg.sub.resume uses pkg.driver.Driver._ask",
    ]  # fs._strip_protocol (no module of pkg defines it) and the driver's own uses pass
    kept = {("pkg.sub.resume", "pkg.driver._QUEUE"): "why", ("pkg.sub.resume", "pkg.driver._gone"): "why"}
    left, stale = unexplained(uses, kept)
    assert {u.what for u in left} == {"*._asked", "pkg.driver.Driver._ask"}
    assert stale == [("pkg.sub.resume", "pkg.driver._gone")]


# ---- dask_ddp --------------------------------------------------------------------------------------------------

def test_no_module_uses_another_modules_private_names():
    left, stale = unexplained(private_uses(PACKAGE), ALLOWED)
    assert not left, (f"{len(left)} use(s) of another module's private names: give them a public name or a small "
                      "accessor with a docstring in their module (or, with a reason, an entry of ALLOWED):\n"
                      + "\n".join(map(str, left)))
    assert not stale, f"ALLOWED entries no module needs any more (drop them): {stale}"


def test_every_allowed_use_says_why():
    assert all(isinstance(why, str) and len(why) > 20 for why in ALLOWED.values())


# ---- size ------------------------------------------------------------------------------------------------------

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
             tokenize.ENDMARKER}


def code_lines(source: str) -> int:
    """The lines of ``source`` holding code: a token other than a comment or a line break, and not a docstring
    (of the module, a class or a function). A string that is not a docstring counts (it is data)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.difference_update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return len(lines)


def test_code_lines_count_code_and_neither_docstrings_comments_nor_blank_lines():
    source = ('"""A module.\n\nIts docstring."""\n\nimport os  # a comment after code counts\n\n# a comment\n\n'
              'class K:\n    """A class."""\n\n    X = """data, not a\n    docstring"""\n\n'
              '    def f(self,\n          x):\n        """A\n        method."""\n        return (x +\n'
              '                1)\n')
    assert code_lines(source) == 8  # import, class, X (2 lines), def (2 lines), return (2 lines)
    documented = source.replace('"""A class."""', '"""A class.\n\n    Much more said about it.\n    """')
    assert code_lines(documented) == code_lines(source)  # documentation never counts against the bound
    grown = source + "".join(f"\ndef f{i}():\n    return {i}\n" for i in range(MAX_CODE_LINES // 2))
    assert code_lines(grown) > MAX_CODE_LINES  # so a module that grows code trips it


def test_no_module_over_the_size_bound():
    sizes = {str(p.relative_to(ROOT)): code_lines(p.read_text()) for p in PACKAGE.rglob("*.py")}
    over = {p: n for p, n in sizes.items() if n > MAX_CODE_LINES}
    assert not over, (f"modules over {MAX_CODE_LINES} lines of code (docstrings, comments and blank lines do not "
                      f"count): split them by concept, a small unit with its own state: {over}")
