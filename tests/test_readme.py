"""The README's code blocks match the code: its commands are CI's, its notebook example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_first_two_commands_are_the_demo_and_what_ci_runs():
    commands = [ln for ln in blocks("bash")[0].splitlines() if ln and not ln.startswith("#")]
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("dask-ddp demo") and "pip install -e '.[demo]'" in demo
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert ci.replace("pip install -q ", "pip install ") == tests, "README's second command must be .ci/run's"


def test_readme_mentions_only_public_names():
    import importlib

    import dask_ddp

    for name in set(re.findall(r"dask_ddp\.([A-Za-z_]\w*)", README)):
        if not hasattr(dask_ddp, name):
            importlib.import_module(f"dask_ddp.{name}")  # a subpackage (dask_ddp.compat), or ImportError
    for name in set(re.findall(r"dask_ddp\.dispatch\.([A-Za-z_]\w*)", README)):
        assert hasattr(dask_ddp.dispatch, name), f"README uses dask_ddp.dispatch.{name}, which does not exist"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_notebook_example_runs_as_written(tmp_path):
    (code,) = [b for b in blocks("python") if "dispatch.run(client, train" in b and "LocalCluster(" in b]
    script = tmp_path / "readme_example.py"
    # As written, plus a check of what it printed and a clean shutdown (a notebook would keep the client open).
    script.write_text("if __name__ == '__main__':\n"
                      + "".join(f"    {ln}\n" for ln in code.splitlines())
                      + "    df = job.metrics\n"
                      + "    assert sorted(df['rank'].unique()) == [0, 1] and len(df) == 40, df\n"
                      + "    assert {'loss', 'epoch'} <= set(df.columns)\n"
                      + "    print('OK', job.state)\n"
                      + "    client.close()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    values = re.search(r"^\[([-\d.e]+), ([-\d.e]+)\]$", out.stdout, flags=re.M)
    assert values, out.stdout
    assert "OK FINISHED" in out.stdout
