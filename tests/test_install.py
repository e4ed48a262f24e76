"""The README's installs resolve without pip walking back through release after release.

boto3 X needs botocore>=X of X's minor series; s3fs's aiobotocore accepts a few botocore
releases only. With boto3 unbounded (moto needs it, the tests import it) pip took the newest
boto3 before it read aiobotocore's pin, then backtracked through 60 aiobotocore, 22 s3fs and 20
boto3 releases: 16 minutes of a newcomer's first ``pip install -e '.[test]'``. Neither s3fs nor
aiobotocore has a ``[boto3]`` extra any more to bound it, so the demo and test extras bound it
themselves (pyproject.toml says how to move the window).

The first test reads pyproject.toml: every extra that brings boto3 bounds it on both sides, the
same window everywhere. The second asks pip (``--dry-run``, the index pip install used) to
resolve that part of the extras and fails as soon as pip tries more than a few releases of one
project.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The projects of the conflict: an extra that names one of these brings boto3 (moto requires it unbounded).
AWS = {"moto", "boto3", "botocore", "aiobotocore", "s3fs", "fsspec", "s3transfer"}
BRINGS_BOTO3 = {"moto", "boto3", "botocore", "aiobotocore"}
# Releases of one project pip may try: botocore takes up to 3 (the newest, the newest of boto3's minor series,
# the one aiobotocore accepts). The walk this guards against tried 20 to 60.
MAX_TRIED = 4


def _reqs(lines: list[str]) -> list[Requirement]:
    return [Requirement(line) for line in lines]


def _aws_extras() -> dict[str, list[Requirement]]:
    """Extra -> its requirements, for every extra that brings boto3."""
    extras = PROJECT.get("optional-dependencies", {})
    return {extra: _reqs(lines) for extra, lines in extras.items()
            if any(canonicalize_name(r.name) in BRINGS_BOTO3 for r in _reqs(lines))}


def test_every_extra_that_brings_boto3_bounds_it_on_both_sides():
    extras = _aws_extras()
    assert {"demo", "test"} <= set(extras), extras  # moto[server] in both
    windows = {}
    for extra, reqs in extras.items():
        boto3 = [r for r in reqs if canonicalize_name(r.name) == "boto3"]
        why = (f"extra {extra!r} brings boto3 (moto needs it) but does not bound it: pip would take the newest "
               "boto3 before it reads the botocore pin of s3fs's aiobotocore, then backtrack through dozens of "
               "boto3/aiobotocore/s3fs releases (16 minutes). Name boto3 with the window of pyproject.toml's comment")
        assert boto3, why
        (req,) = boto3
        ops = {s.operator for s in req.specifier}
        assert ops & {"<", "<=", "==", "~=", "==="}, why + f" (an upper bound; it has {req})"
        assert ops & {">=", ">", "==", "~=", "==="}, (why + f" (and a lower bound, so that a stale window costs pip "
                                                        f"a few tries, not every older release; it has {req})")
        windows[extra] = str(req.specifier)
    assert len(set(windows.values())) == 1, f"one boto3 window for every extra, to move in one go: {windows}"


def _tried(line: str) -> tuple[str, str] | None:
    """(project, version) of a release pip fetched or read to learn its requirements, from one output line."""
    m = re.search(r"(?:Downloading|Using cached|Processing) \S*?([^\s/]+\.(?:whl|tar\.gz|zip))(?:\.metadata)?\b",
                  line)
    if not m:
        return None
    name = m.group(1)
    try:
        project, version = parse_wheel_filename(name)[:2] if name.endswith(".whl") else parse_sdist_filename(name)
    except ValueError:
        return None
    return canonicalize_name(project), str(version)


def test_tried_counts_fetched_releases():
    assert _tried("  Downloading boto3-1.44.8-py3-none-any.whl (140 kB)") == ("boto3", "1.44.8")
    assert _tried("  Using cached aiobotocore-3.10.0-py3-none-any.whl.metadata (24 kB)") == ("aiobotocore", "3.10.0")
    assert _tried("Processing /opt/files/s3fs-2026.9.0.tar.gz (from dask-ddp==0.1.0)") == ("s3fs", "2026.9.0")
    assert _tried("Collecting boto3 (from moto[server]>=5.0)") is None


def _resolution_slices() -> dict[str, list[str]]:
    """What pip resolves per extra: the AWS part of the core requirements and of the extra, as written."""
    core = [line for line in PROJECT["dependencies"] if canonicalize_name(Requirement(line).name) in AWS]
    slices = {}
    for extra, lines in PROJECT["optional-dependencies"].items():
        if extra in _aws_extras():
            part = [line for line in lines if canonicalize_name(Requirement(line).name) in AWS]
            slices.setdefault(tuple(sorted(core + part)), []).append(extra)
    return {" ".join(extras): list(reqs) for reqs, extras in slices.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extras", list(_resolution_slices()))
def test_pip_resolves_the_aws_part_of_the_extras_without_walking_back(extras, tmp_path):
    """pip resolves the extras' AWS requirements trying at most MAX_TRIED releases of any one project.

    A fresh resolution (``--ignore-installed``), so what a newcomer's install would do, on the index this
    environment's pip was set up with; stopped at the first project past the limit, so a walk fails in
    seconds, not after it.
    """
    reqs = _resolution_slices()[extras]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--disable-pip-version-check",
           "--report", str(tmp_path / "report.json"), *reqs]
    tried: dict[str, set[str]] = defaultdict(set)
    log = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path) as pip:
        for line in pip.stdout:
            log.append(line)
            if (release := _tried(line)) is None:
                continue
            tried[release[0]].add(release[1])
            if len(tried[release[0]]) > MAX_TRIED:
                pip.kill()
                break
        rc = pip.wait()
    over = {p: sorted(v, key=Version) for p, v in tried.items() if len(v) > MAX_TRIED}
    walking = sorted(set(re.findall(r"pip is (?:still )?looking at multiple versions of (\S+)", "".join(log))))
    assert not over, (
        f"extras {extras}: resolving {reqs}, pip walked back through the releases of {over} (and was stopped); "
        f"it said it was looking at multiple versions of {walking}. Each release tried costs a newcomer's install a "
        "download. With boto3 unbounded, see the test above; with a boto3 window, the newest aiobotocore needs a "
        "botocore past it: move the window in pyproject.toml to that aiobotocore's botocore pin. Last output:\n"
        + "".join(log[-30:]))
    assert rc == 0, f"pip could not resolve {reqs}:\n" + "".join(log[-40:])
    assert tried, "pip fetched nothing: its output no longer says what it downloads?\n" + "".join(log[-40:])
