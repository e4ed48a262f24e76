"""Where the test suite's CPU goes: every process sampled once a second, each one's CPU charged to the test that its
pytest (xdist) worker ancestor was running, and to the kind of process it is (a Dask worker, a zygote, a forked
rank, the pytest process itself with its in-process scheduler, a subprocess).

    python benchmarks/suite_cpu.py -- -n 2 --dist loadfile      # the README's test run, profiled
    python benchmarks/suite_cpu.py -- tests/test_dispatch.py     # one file

Prints the CPU seconds by kind of process and by test file (with their top kinds), the 30 costliest tests, and
pytest's own summary line; writes the whole table as JSON (``--out``). The suite is CPU-bound on 2 cores (see
docs/figures.md), so its wall time follows these CPU seconds. Sampling misses up to a second of each process's
life and costs ~1-2 % of a core; processes that left the process tree (daemons, SLURM's) count as ``<none>``.

This file is also the pytest plugin (``-p suite_cpu``) that logs which test each pytest process runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = (("dask_ddp.rank.main", "rank (fresh interpreter)"), ("spawn_main", "Dask worker (LocalCluster)"),
         ("ipykernel", "Jupyter kernel"), ("dask-ddp", "dask-ddp CLI"), ("dask_ddp.cli", "dask-ddp CLI"),
         ("dask worker", "dask worker CLI"), ("dask-worker", "dask worker CLI"),
         ("dask scheduler", "dask scheduler CLI"),
         ("torchrun", "torchrun"), ("chrom", "chromium"), ("slurm", "SLURM"), ("mypy", "mypy"), ("pip", "pip"),
         ("pytest", "pytest (and its in-process clusters)"), ("xdist", "pytest (and its in-process clusters)"))


# ---- the plugin: which test each pytest process runs, appended to $SUITE_CPU_LOG ----

def pytest_runtest_logstart(nodeid, location):
    _log(nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _log("<between tests>")


def _log(what: str) -> None:
    with open(os.environ["SUITE_CPU_LOG"], "a") as f:
        f.write(f"{os.getpid()}\t{what}\n")


# ---- the sampler ----

def kind_of(cmd: list[str], parent: list[str], grandparent: list[str] = ()) -> str:
    """The kind of process a command line is (see KINDS); a zygote's child is a forked rank. A zygote host, the
    zygotes it forks and their ranks share one command line: told apart by how many ancestors have it too."""
    line = " ".join(cmd)
    if "dask_ddp.rank.zygote_host" in line:
        depth = sum("dask_ddp.rank.zygote_host" in " ".join(p) for p in (parent, grandparent))
        return ("zygote host", "zygote", "rank (forked)")[depth]
    if "dask_ddp.rank.zygote" in line:
        return "rank (forked)" if "dask_ddp.rank.zygote" in " ".join(parent) else "zygote"
    for key, kind in KINDS:
        if key in line:
            return kind
    if cmd and os.path.basename(cmd[0]).startswith("python"):
        return "pytest (and its in-process clusters)" if "exec(eval(sys.stdin" in line else "python (other)"
    return "other: " + (os.path.basename(cmd[0]) if cmd else "?")


class Sampler:
    """Samples every process's CPU once a second until stopped; charges each increase to (test, kind)."""

    def __init__(self, log: str) -> None:
        self.log, self.pos, self.running = log, 0, {}
        self.seen: dict = {}
        self.last: dict = {}
        self.cpu: collections.Counter = collections.Counter()
        self.stop = threading.Event()

    def _read_log(self) -> None:
        with open(self.log) as f:
            f.seek(self.pos)
            for line in f.read().splitlines():
                pid, what = line.split("\t", 1)
                self.running[int(pid)] = what
            self.pos = f.tell()

    def run(self) -> None:
        import psutil

        for p in psutil.process_iter():  # what ran before the suite is not the suite's
            try:
                times = p.cpu_times()
                self.last[(p.pid, p.create_time())] = times.user + times.system
            except psutil.Error:
                continue
        while not self.stop.wait(1.0):
            self._read_log()
            for p in psutil.process_iter():
                try:
                    key = (p.pid, p.create_time())
                    if key not in self.seen:
                        try:
                            parent = p.parent().cmdline()
                            grandparent = p.parent().parent().cmdline()
                        except (psutil.Error, AttributeError):
                            parent, grandparent = [], []
                        kind = kind_of(p.cmdline(), parent, grandparent)
                        self.seen[key] = (kind if kind != "other: ?" else f"other: {p.name()}",
                                          [a.pid for a in p.parents()])
                    times = p.cpu_times()
                    used = times.user + times.system
                except psutil.Error:
                    continue
                grew, self.last[key] = used - self.last.get(key, 0.0), used
                if grew > 0:
                    kind, ancestors = self.seen[key]
                    test = next((self.running[a] for a in [p.pid, *ancestors] if a in self.running), "<none>")
                    self.cpu[(test, kind)] += grew


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="suite_cpu.json", help="the whole table, as JSON")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    log = Path(args.out).with_suffix(".log").resolve()
    log.write_text("")
    sampler = Sampler(str(log))
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    env = {**os.environ, "SUITE_CPU_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_cpu",
                          *args.pytest_args], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    sampler.stop.set()
    thread.join()
    by_kind, by_file, by_test = collections.Counter(), collections.Counter(), collections.Counter()
    file_kinds: dict = collections.defaultdict(collections.Counter)
    for (test, kind), cpu in sampler.cpu.items():
        by_kind[kind] += cpu
        by_test[test] += cpu
        by_file[test.split("::")[0]] += cpu
        file_kinds[test.split("::")[0]][kind] += cpu
    total = sum(by_kind.values())
    print(f"wall {wall:.0f} s, sampled CPU {total:.0f} s ({total / wall:.2f} cores busy on average)")
    print("\nCPU s by kind of process (processes seen):")
    counts = collections.Counter(kind for kind, _ in sampler.seen.values())
    for kind, cpu in by_kind.most_common():
        print(f"{cpu:8.0f}  {counts[kind]:5d}  {kind}")
    print("\nCPU s by test file [its top kinds]:")
    for name, cpu in by_file.most_common():
        top = ", ".join(f"{k}: {v:.0f}" for k, v in file_kinds[name].most_common(3))
        print(f"{cpu:8.0f}  {name}  [{top}]")
    print("\nthe 30 costliest tests (CPU s):")
    for test, cpu in by_test.most_common(30):
        print(f"{cpu:8.0f}  {test}")
    print("\n" + (out.stdout.strip().splitlines() or ["(no output)"])[-1])
    Path(args.out).write_text(json.dumps({"wall_s": wall, "by_kind": by_kind, "by_file": by_file,
                                          "by_test": by_test, "processes": counts}, indent=1))
    sys.exit(out.returncode)


if __name__ == "__main__":
    main()
