"""The README's two commands on a fresh checkout, each measured on its own: a clone of this repository into a
temporary folder, a new venv, pip's resolution alone (``pip install --dry-run --ignore-installed``, what pip
spends deciding before it installs anything), the install itself, then the command.

    python benchmarks/bench_install.py --extra demo          # the first command: install, then dask-ddp demo
    python benchmarks/bench_install.py --extra test --no-run # the second command's install (its pytest run is
                                                             # the whole suite: see the README's figures)

pip's cache is whatever this machine has (warm after one run); torch comes from local disk where pip is set up so.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], cwd: Path, timeout: float = 3600) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extra", choices=["demo", "test"], default="demo")
    parser.add_argument("--no-run", action="store_true", help="install only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
        venv = timed([sys.executable, "-m", "venv", ".venv"], repo)
        pip = [str(repo / ".venv" / "bin" / "pip"), "install", "-q", "-e", f".[{args.extra}]"]
        resolve = timed([*pip, "--dry-run", "--ignore-installed"], repo)
        install = timed(pip, repo)
        print(f"extra {args.extra}: venv {venv:.1f} s, pip resolution {resolve:.1f} s (dry run), "
              f"pip install {install:.1f} s (resolution included)")
        if not args.no_run and args.extra == "demo":
            demo = timed([str(repo / ".venv" / "bin" / "dask-ddp"), "demo"], repo)
            print(f"dask-ddp demo: {demo:.1f} s")
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
