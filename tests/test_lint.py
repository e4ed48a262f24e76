"""The package is lint-clean under the configuration in ``pyproject.toml`` (``[tool.ruff]``): ruff, in the suite.

A finding fails the test with ruff's own report (file, line, rule), so a regression names itself.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_lives_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert config["line-length"] == 120 and {"E", "F", "W", "I"} <= set(config["lint"]["select"])


def test_the_package_and_examples_are_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "dask_ddp", "examples"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert "No module named ruff" not in out.stderr, "ruff is in the test extra: pip install -e '.[test]'"
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
