"""How long the documentation site takes to build: with the example notebook executed (what tests/test_docs.py
and a release build do) and without it (DASK_DDP_DOCS_EXECUTE=0), each from nothing (fresh output and doctree
folders), warnings as errors.

    python benchmarks/bench_docs.py --repeats 2 --out benchmarks/RESULTS_docs.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(execute: bool) -> float:
    """Seconds for one clean build (raises CalledProcessError when it fails)."""
    env = {**os.environ, "DASK_DDP_DOCS_EXECUTE": "1" if execute else "0"}
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q", "-d",
                        f"{out}/doctrees", str(ROOT / "docs"), f"{out}/html"], env=env, check=True,
                       capture_output=True, timeout=900)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for execute in (True, False):
        times = [build(execute) for _ in range(args.repeats)]
        rows.append((execute, statistics.median(times), min(times), max(times)))
    load = os.getloadavg()
    text = (f"# Documentation build time\n\n`python benchmarks/bench_docs.py --repeats {args.repeats}` on "
            f"{platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
            f"{time.strftime('%Y-%m-%d')}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}. A clean "
            "`sphinx -W` build of docs/ each time.\n\n| notebook | median s | min s | max s |\n|---|---:|---:|---:|\n"
            + "".join(f"| {'executed' if e else 'not run'} | {m:.1f} | {lo:.1f} | {hi:.1f} |\n"
                      for e, m, lo, hi in rows))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
