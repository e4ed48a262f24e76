"""Type hints a type checker accepts: mypy on the package, the public API fully annotated, a user's program checked.

The configuration is ``[tool.mypy]`` in ``pyproject.toml`` (its comments say how strict and why). Three checks:

- mypy, with that configuration, finds nothing in ``dask_ddp``;
- every public callable (``dask_ddp.__all__``, the public modules' names of ``test_wings.PUBLIC``, and the public
  methods of public classes) annotates every parameter and its return, read with ``inspect`` from the code;
- a user's program written against the public API passes ``mypy --strict``, and the same program with a wrong type
  at each line marked ``# E`` fails there and only there: the hints are seen (not ``Any``) and they are right.

The wheel ships ``py.typed`` (PEP 561), so the same hints reach an installed package (``tests/test_build.py``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_wings import PUBLIC

import dask_ddp

ROOT = Path(__file__).resolve().parents[1]

# What a user imports is read as Any past dask_ddp (as in [tool.mypy]): a cold check stays at a few seconds.
USER_CONFIG = """\
[mypy]
strict = True
python_version = 3.11
[mypy-dask_ddp.*]
follow_imports = silent
[mypy-torch.*,torchvision.*,distributed.*,dask.*,pandas.*,numpy.*,bokeh.*,fsspec.*,PIL.*,mlflow.*,matplotlib.*,ipywidgets.*,IPython.*,tqdm.*,prometheus_client.*,psutil.*,cloudpickle.*,msgpack.*,tblib.*,yaml.*,pynvml.*,s3fs.*]
follow_imports = skip
follow_imports_for_stubs = True
ignore_missing_imports = True
"""

USER_PROGRAM = '''\
from __future__ import annotations

import pandas as pd
from distributed import Client

import dask_ddp
from dask_ddp.checkpoint import Checkpoint, list_checkpoints


def train(epochs: int, lr: float = 0.1) -> float:
    ctx = dask_ddp.get_context()
    rank: int = ctx.rank  # E rank: str = ctx.rank
    dask_ddp.seed_everything(0)  # E dask_ddp.seed_everything("0")
    with dask_ddp.rank_zero_first():
        pass
    state = dask_ddp.load_checkpoint()
    start: int = 0 if state is None else int(state["epoch"]) + 1
    loss = 0.0
    for epoch in range(start, epochs):
        loss = dask_ddp.all_reduce_mean(1.0 / (epoch + 1))  # E loss = dask_ddp.all_reduce_mean("x")
        dask_ddp.report(loss=loss, epoch=epoch)
        dask_ddp.save_checkpoint({"epoch": epoch}, step=epoch, keep=2)  # E dask_ddp.save_checkpoint({}, step="1")
    print(rank)
    return loss


def drive(client: Client) -> None:
    sinks = [dask_ddp.CSVSink("metrics.csv")]
    job = dask_ddp.dispatch.run(client, train, 3, callbacks=sinks)  # E job = dask_ddp.dispatch.run(client, total="9")
    values: list[float] = job.result(timeout=60)
    state: str = job.state  # E state: int = job.state
    frame: pd.DataFrame = job.metrics
    found: list[Checkpoint] = list_checkpoints(job.checkpoint_dir)  # E found: list[int] = list_checkpoints()
    again: dask_ddp.Job = dask_ddp.attach(client, job.run_id)  # E again: dask_ddp.Job = dask_ddp.attach(client, 3)
    print(values, state, frame, found, again)
    try:
        job.cancel()
    except dask_ddp.RankFailedError as exc:
        print(exc.rank, exc.worker)
'''


def _mypy(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_mypy_finds_nothing_in_the_package(tmp_path):
    out = _mypy(["--cache-dir", str(tmp_path / "cache"), "--no-error-summary"], ROOT)  # files: [tool.mypy]
    assert "No module named mypy" not in out.stderr, "mypy is in the test extra: pip install -e '.[test]'"
    errors = [ln for ln in out.stdout.splitlines() if ": error:" in ln]
    assert out.returncode == 0 and not errors, "\n".join(errors[:60]) + out.stderr[-2000:]


def _public_callables() -> dict[str, object]:
    """Dotted name -> object, for every public function, class and public method or property of a public class."""
    names = [("dask_ddp", n) for n in dask_ddp.__all__]
    for module, listed in PUBLIC.items():
        mod = importlib.import_module(module)
        names += [(module, n) for n in dict.fromkeys(listed + list(getattr(mod, "__all__", [])))]
    found: dict[str, object] = {}
    seen: set[int] = set()
    for module, name in names:
        obj = getattr(importlib.import_module(module), name)
        if inspect.ismodule(obj) or id(obj) in seen or not callable(obj):
            continue
        seen.add(id(obj))
        found[f"{module}.{name}"] = obj
        if inspect.isclass(obj) and obj.__module__.startswith("dask_ddp"):
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(value, property):
                    value = value.fget
                elif isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                if inspect.isfunction(value):
                    found[f"{module}.{name}.{attr}"] = value
    return found


def _unannotated(obj: object) -> list[str]:
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin or a C type: nothing to read
        return []
    missing = [p.name for p in sig.parameters.values()
               if p.annotation is inspect.Parameter.empty and p.name not in ("self", "cls")]
    if sig.return_annotation is inspect.Signature.empty and not inspect.isclass(obj):
        missing.append("return")
    return missing


def test_every_public_callable_annotates_its_parameters_and_return():
    found = _public_callables()
    assert len(found) > 80, f"the public surface shrank to {len(found)} callables: is PUBLIC still read?"
    missing = {name: m for name, obj in found.items() if (m := _unannotated(obj))}
    assert not missing, f"public callables without annotations (name: parameters, 'return'): {missing}"


def test_the_annotation_check_finds_a_missing_one():
    def typed(a: int, *, b: str = "") -> None: ...

    def untyped(a, b: int = 0): ...

    assert _unannotated(typed) == [] and _unannotated(untyped) == ["a", "return"]


def _marked(program: str) -> tuple[str, str, list[int]]:
    """The program as written; the program with each ``# E`` line replaced by the wrong code after the marker
    (indentation kept); those lines' numbers."""
    good, bad, lines = [], [], []
    for number, line in enumerate(program.splitlines(), 1):
        code, sep, wrong = line.partition("  # E ")
        good.append(code)
        bad.append(code[:len(code) - len(code.lstrip())] + wrong.strip() if sep else line)
        if sep:
            lines.append(number)
    return "\n".join(good) + "\n", "\n".join(bad) + "\n", lines


def _user_check(tmp_path: Path, source: str) -> tuple[int, list[int], str]:
    (tmp_path / "mypy.ini").write_text(USER_CONFIG)
    (tmp_path / "user_train.py").write_text(source)
    env_path = f"--python-executable={sys.executable}"
    out = subprocess.run([sys.executable, "-m", "mypy", env_path, "--config-file", "mypy.ini", "--cache-dir",
                          str(tmp_path / "cache"), "user_train.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**_env(), "MYPYPATH": str(ROOT)})
    lines = sorted({int(m) for m in re.findall(r"^user_train\.py:(\d+): error", out.stdout, flags=re.M)})
    return out.returncode, lines, out.stdout + out.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.slow
def test_a_users_program_passes_strict_mypy_and_each_wrong_type_is_flagged(tmp_path):
    good, bad, marked = _marked(textwrap.dedent(USER_PROGRAM))
    assert len(marked) == 8
    (tmp_path / "good").mkdir(), (tmp_path / "bad").mkdir()
    rc, lines, out = _user_check(tmp_path / "good", good)
    assert rc == 0 and not lines, f"mypy --strict rejects a correct use of the public API:\n{out[-4000:]}"
    rc, lines, out = _user_check(tmp_path / "bad", bad)
    assert lines == marked, (f"mypy flagged lines {lines}, the wrong types are on {marked} (a hint is Any, or "
                             f"wrong):\n{out[-4000:]}\n{bad}")


@pytest.mark.parametrize("text, expected", [("x = 1  # E x = ''\n", ["x = ''"])])
def test_the_marker_swaps_the_line(text, expected):
    good, bad, marked = _marked(text)
    assert good == "x = 1\n" and bad.splitlines() == expected and marked == [1]
