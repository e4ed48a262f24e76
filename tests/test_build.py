"""The package as a library: a wheel and an sdist that build and pass ``twine check``, and the wheel, installed
into a fresh virtual environment, imports, shows its version and runs a 2-rank job.

One build for the module (``python -m build --no-isolation`` from a copy of the source tree, so nothing lands
in the checkout; isolation would only download setuptools again). The fresh environment gets the wheel with
``--no-deps`` and sees this environment's packages (torch, distributed, ...) through a path file, so the test
takes seconds, not the minutes of a torch install; the dask_ddp it imports must be the wheel's own (its
``__file__`` is checked, in the client and in a rank), never this checkout's editable install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from test_typing import USER_CONFIG

import dask_ddp

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "_build",
                                 ".mypy_cache", ".pytest_cache", "dask-worker-space", "*.pyc")


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH (which would put this checkout's dask_ddp first)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, built from a copy of the source tree."""
    base = tmp_path_factory.mktemp("build")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(base / "dist"),
                          str(src)], capture_output=True, text=True, timeout=300, cwd=base)
    assert "No module named build" not in out.stderr, "build is in the test extra: pip install -e '.[test]'"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    found = {p.suffix if p.suffix == ".whl" else ".tar.gz": p for p in (base / "dist").iterdir()}
    assert set(found) == {".whl", ".tar.gz"}, found
    return found


@pytest.mark.slow
def test_wheel_and_sdist_pass_twine_check(dists):
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists.values())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("PASSED") == 2, out.stdout + out.stderr


@pytest.mark.slow
def test_the_wheel_ships_the_settings_and_the_typing_marker_and_its_metadata_is_right(dists):
    with zipfile.ZipFile(dists[".whl"]) as whl:
        names = set(whl.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(whl.read(meta_name).decode())
    assert {"dask_ddp/py.typed", "dask_ddp/ddp.yaml", "dask_ddp/__init__.py", "dask_ddp/rank/zygote.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "examples/", "benchmarks/"))]
    assert meta["Version"] == dask_ddp.__version__, "the version has one source: dask_ddp.__version__"
    requires = meta.get_all("Requires-Dist")
    torch = [r for r in requires if r.split(">")[0].split("<")[0].split("=")[0].strip() in ("torch", "torchvision")]
    assert len(torch) == 2 and not [r for r in torch if "<" in r], f"no upper bound on torch/torchvision: {torch}"
    assert meta["License-Expression"] == "Apache-2.0"
    with tarfile.open(dists[".tar.gz"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "dask_ddp/py.typed", "dask_ddp/ddp.yaml"} <= members


JOB = textwrap.dedent('''\
    import os
    import sys

    import dask_ddp


    def train(steps):
        import torch
        import torch.distributed as dist

        import dask_ddp as rank_side

        ctx = dask_ddp.get_context()
        t = torch.tensor([float(ctx.rank + 1)])
        for _ in range(steps):
            dist.all_reduce(t)
        return rank_side.__file__, ctx.world_size, t.item()


    if __name__ == "__main__":
        from dask.distributed import Client, LocalCluster

        print("client", dask_ddp.__file__)
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \\
                Client(cluster) as client:
            values = dask_ddp.dispatch.run(client, train, 1, backend="gloo", progress=False).result(timeout=180)
        for value in values:
            print("rank", *value)
''')


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_wheel_installs_into_a_fresh_venv_and_runs_a_2_rank_job(dists, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # torch, distributed, ...: this environment's, after the venv's own (a plain path: the editable install's
    # finder, started by a .pth file of that folder, is not run from here)
    (Path(site) / "_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                          str(dists[".whl"])], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    version = subprocess.run([str(venv / "bin" / "dask-ddp"), "--version"], capture_output=True, text=True,
                             timeout=120, env=_clean_env(), cwd=tmp_path)
    assert version.stdout.strip() == f"dask-ddp {dask_ddp.__version__}", version.stdout + version.stderr

    (tmp_path / "job.py").write_text(JOB)
    run = subprocess.run([str(python), "job.py"], capture_output=True, text=True, timeout=360, env=_clean_env(),
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    lines = run.stdout.splitlines()
    installed = str(Path(site) / "dask_ddp" / "__init__.py")
    assert f"client {installed}" in lines, f"the client imported another dask_ddp than the wheel's:\n{run.stdout}"
    ranks = [ln.split() for ln in lines if ln.startswith("rank ")]
    assert [r[1:] for r in ranks] == [[installed, "2", "3.0"]] * 2, run.stdout + run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_type_checker_reads_the_installed_wheels_hints(dists, tmp_path):
    """mypy finds the installed package's hints through ``py.typed`` (without it: "missing library stubs or
    py.typed marker")."""
    target = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                          str(target), str(dists[".whl"])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp_path / "user.py").write_text("import dask_ddp\n\nn: int = dask_ddp.seed_everything(0)\n"
                                      "s: str = dask_ddp.seed_everything(0)\n")
    (tmp_path / "mypy.ini").write_text(USER_CONFIG)  # --strict; torch, distributed, ... read as Any (seconds)
    check = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", os.devnull,
                            "--config-file", "mypy.ini", "user.py"],
                           capture_output=True, text=True, timeout=240, cwd=tmp_path,
                           env={**_clean_env(), "PYTHONPATH": str(target)})
    assert "user.py:4: error: Incompatible types in assignment" in check.stdout, check.stdout + check.stderr
    assert "user.py:3" not in check.stdout, check.stdout
