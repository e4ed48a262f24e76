"""The house plan as a tested rule: which wing may import which, what is public.

Read from the source with ``ast`` (the import graph of ``test_imports``), nothing of dask_ddp imported for the
rules; imports inside functions count (they run), and so do imports under ``if TYPE_CHECKING:`` (a lower wing that
needs only the shape of an upper one's object declares a ``typing.Protocol`` of it, as ``observe.sinks.JobShape``).
The README's "Code layout" section shows the same table (``test_the_readme_shows_the_table``). The rules on private
names and on module size are in ``test_house_rules``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys

import pytest
from test_imports import PACKAGE, Edge, import_graph

ROOT = PACKAGE.parent
WINGS = ("client", "sweeps", "worker", "rank", "wire", "storage", "checkpoint", "data", "observe", "dashboard",
         "integrations")
FACADE = ("dask_ddp", "dask_ddp.dispatch")  # the public paths: they may import any wing
#: wing -> the wings it may import (its own always; ``config`` is every process's settings)
MAY_IMPORT = {
    "wire": {"config"},
    "storage": {"wire", "config"},
    "worker": {"wire", "config"},
    "checkpoint": {"storage", "wire", "config"},
    "data": {"checkpoint", "storage", "wire", "config"},
    "rank": {"data", "checkpoint", "storage", "wire", "config"},
    "integrations": {"rank", "data", "checkpoint", "storage", "wire", "config"},  # trainers' callbacks, in the rank
    "observe": {"storage", "wire", "config"},
    "dashboard": {"wire", "config"},
    "client": {"worker", "observe", "dashboard", "data", "checkpoint", "storage", "wire", "config"},
    "sweeps": {"client", "worker", "observe", "dashboard", "checkpoint", "storage", "wire", "config"},
    "cli": None,  # None: anything (the shell's and the old package's front doors)
    "compat": None,
    "config": set(),
}


def wing_of(module: str) -> str:
    """``dask_ddp.client.job`` -> ``client``; a top-level public module is its own name; the package is ``dask_ddp``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dask_ddp"


def violations(edges: list[Edge]) -> list[str]:
    """Every import against the table, as text naming the importing module, the imported one and where."""
    found = []
    for e in edges:
        if e.source in FACADE:
            continue
        source, target = wing_of(e.source), wing_of(e.target)
        allowed = MAY_IMPORT.get(source, set())
        if source == target or allowed is None:
            continue
        if target not in allowed:
            why = "the package (it imports the rank and observe wings)" if target == "dask_ddp" else f"{target}/"
            found.append(f"{source}/ may not import {why}: {e}")
    return found


def test_every_module_is_in_a_wing_of_the_table():
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        assert module in FACADE or wing_of(module) in MAY_IMPORT, f"{path}: not in a wing of the plan"


def test_wings_import_only_what_the_table_allows():
    found = violations(import_graph(PACKAGE))
    assert not found, f"{len(found)} import(s) against the plan:\n" + "\n".join(found)


def test_the_rule_finds_a_violation_and_lets_the_allowed_pass():
    def edge(source, target, function=None, type_only=False):
        return Edge(source, target, "x.py:1", function, type_only)

    assert violations([edge("dask_ddp.client.job", "dask_ddp.worker.plugin"),
                       edge("dask_ddp.rank.main", "dask_ddp.checkpoint.whole"),
                       edge("dask_ddp.worker.hub", "dask_ddp.config"),
                       edge("dask_ddp.cli.demo", "dask_ddp.rank.context"),
                       edge("dask_ddp.dispatch", "dask_ddp.client.dispatch")]) == []
    bad = violations([edge("dask_ddp.wire.task", "dask_ddp.client.launch", "f"),
                      edge("dask_ddp.worker.leaving", "dask_ddp.rank.preemption"),
                      edge("dask_ddp.checkpoint.whole", "dask_ddp"),
                      edge("dask_ddp.observe.sinks", "dask_ddp.client.job", type_only=True)])
    assert [b.split(":")[0] for b in bad] == ["wire/ may not import client/", "worker/ may not import rank/",
                                             "checkpoint/ may not import the package (it imports the rank and observe "
                                             "wings)", "observe/ may not import client/"]
    assert "type only" in bad[-1]


def said_may_import(doc: str) -> set[str] | None:
    """The wings a wing's docstring names in its "May import:" sentence (``config`` left out); None without one."""
    if "May import:" not in doc:
        return None
    sentence = re.split(r"\.(?:\s|$)", doc.split("May import:", 1)[1], maxsplit=1)[0]
    return set(re.findall(r"dask_ddp\.(\w+)", sentence)) - {"config"}


def test_the_docstring_rule_reads_the_may_import_sentence():
    assert said_may_import("Runs in: x.\n\nMay import: :mod:`dask_ddp.wire` (and\n:mod:`dask_ddp.config`). Never "
                           ":mod:`dask_ddp.rank`.") == {"wire"}
    assert said_may_import("May import: :mod:`dask_ddp.client`.") != MAY_IMPORT["observe"] - {"config"}
    assert said_may_import("Runs in: the client.") is None


@pytest.mark.parametrize("wing", [w for w in WINGS])
def test_each_wing_says_where_it_runs_and_what_it_may_import(wing):
    doc = ast.get_docstring(ast.parse((PACKAGE / wing / "__init__.py").read_text())) or ""
    assert "Runs in:" in doc, f"dask_ddp/{wing}/__init__.py: say where the wing's code runs"
    said = said_may_import(doc)
    assert said is not None, f"dask_ddp/{wing}/__init__.py: say what the wing may import"
    assert said == MAY_IMPORT[wing] - {"config"}, (f"dask_ddp/{wing}/__init__.py says it may import {said}, "
                                                   f"the table {MAY_IMPORT[wing] - {'config'}}")


def test_every_module_says_where_it_runs():
    missing = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if p.name not in ("__main__.py",) and "Runs in:" not in (ast.get_docstring(ast.parse(p.read_text()))
                                                                       or "")]
    assert not missing, f"modules whose docstring does not say 'Runs in:': {missing}"


# ---- the public names -----------------------------------------------------------------------------------------
PUBLIC = {
    "dask_ddp.dispatch": ["run", "warm_up", "attach", "LaunchSpec"],
    "dask_ddp.data": ["S3ImageFolder", "FolderIndex", "ImageDecodeError", "index_folder", "pil_loader"],
    "dask_ddp.checkpoint": ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
                            "Checkpoint", "CheckpointError", "job_folder", "rng_state", "set_rng_state"],
    "dask_ddp.compat": ["dispatch", "results"],
    "dask_ddp.compat.dispatch": ["run", "dispatch_with_ddp"],
    "dask_ddp.compat.data": ["S3ImageFolder"],
    "dask_ddp.compat.results": ["DaskResultsHandler"],
    "dask_ddp.cli": ["main", "build_parser"],
    "dask_ddp.dashboard": ["DDPDashboard", "install"],
    "dask_ddp.integrations.lightning": ["DaskDDPCallback"],
    "dask_ddp.integrations.fabric": ["DaskDDPCheckpoints"],
    "dask_ddp.integrations.transformers": ["DaskDDPCallback"],
}


def test_every_documented_public_name_imports():
    import dask_ddp

    missing = [name for name in dask_ddp.__all__ if getattr(dask_ddp, name, None) is None]
    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{name}" for name in names + list(getattr(mod, "__all__", []))
                    if getattr(mod, name, None) is None]
    assert not missing, f"documented names that do not import: {missing}"
    readme = (ROOT / "README.md").read_text()
    for dotted in sorted(set(re.findall(r"\bdask_ddp(?:\.[A-Za-z_]\w*)+", readme))):
        module, _, name = dotted.rpartition(".")
        try:
            assert hasattr(importlib.import_module(module), name) or importlib.util.find_spec(dotted), dotted
        except ModuleNotFoundError:
            pytest.fail(f"README names {dotted}, which does not import")


def test_the_public_modules_are_attributes_of_the_package_once_it_is_imported():
    """``import dask_ddp`` then ``dask_ddp.checkpoint.list_checkpoints(...)``, as the README and users write it."""
    code = ("import dask_ddp\n"
            "for name in ('dispatch', 'checkpoint', 'data', 'compat'):\n"
            "    assert hasattr(getattr(dask_ddp, name), '__file__'), name\n"
            "dask_ddp.checkpoint.list_checkpoints, dask_ddp.dispatch.run, dask_ddp.data.S3ImageFolder\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_modules_processes_run_exist():
    """The CLI runs as ``python -m dask_ddp.cli``; a worker starts ``python -m dask_ddp.rank.zygote`` (or
    ``dask_ddp.rank.main``, or the zygote host ``dask_ddp.rank.zygote_host``) by name, so a rename must keep
    those."""
    out = subprocess.run([sys.executable, "-m", "dask_ddp.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-2000:]
    source = "".join((PACKAGE / "worker" / name).read_text() for name in ("process.py", "zygote.py", "zygote_host.py"))
    started = re.findall(r'"-m", "(dask_ddp[\w.]+)"', source)
    assert sorted(started) == ["dask_ddp.rank.main", "dask_ddp.rank.zygote", "dask_ddp.rank.zygote_host"], started
    for module in started:
        assert importlib.util.find_spec(module) is not None, module


def test_the_readme_shows_the_table():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Code layout", 1)[1].split("\n## ", 1)[0]
    for wing, allowed in MAY_IMPORT.items():
        if wing == "config":
            continue
        row = next((ln for ln in section.splitlines() if ln.startswith(f"| `{wing}/`")), None)
        assert row is not None, f"README's code layout has no row for {wing}/"
        cell = row.split("|")[3]
        shown = {w for w in re.findall(r"`(\w+)`", cell)}
        if allowed is None:
            assert "anything" in cell, row
        else:
            assert shown == allowed - {"config"}, f"README says {wing}/ may import {shown}, the rule {allowed}"
