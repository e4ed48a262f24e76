"""A rank that floods ``report()``: what the scheduler, the client and the workers hold while it does.

Usage::

    python benchmarks/bench_report_flood.py [--seconds 10] [--profiles small many long]
                                            [--out benchmarks/RESULTS_report_flood.md]

Two ranks on a ``LocalCluster(n_workers=2, threads_per_worker=1)`` (its scheduler lives in this process,
beside the client, as in a notebook) call ``report()`` in a tight loop for ``--seconds``, one job per
profile: ``small`` (3 keys), ``many`` (2,000 keys a report), ``long`` (20 keys of 20,000 characters).
A thread samples this process's resident memory (scheduler + client) and the largest of its children's
(the workers and their rank processes) every 0.2 s. Reported: the peak, what this process still holds
2 s after the job, the job's wall time (the flood's seconds plus the time to drain what it queued),
the reports kept in ``job.metrics`` and those dropped past the ranks' limits (``ddp.events.max-*``).
Run it on a commit before the limits (``git worktree add /tmp/before <commit>`` and ``PYTHONPATH``) for
the "before" column.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402

import dask_ddp  # noqa: E402
from dask_ddp import dispatch  # noqa: E402

PROFILES = {
    "small": lambda i: {"loss": 0.1 * i, "acc": 0.5, "lr": 1e-3},
    "many": lambda i: {f"metric_{k:05d}": float(k) for k in range(2000)},
    "long": lambda i: {("k" * 20000) + str(k): 1.0 for k in range(20)},
}


def flood(profile: str, seconds: float) -> int:
    """Report the profile's payload as fast as this rank can for ``seconds``; the number of calls."""
    make, n, end = PROFILES[profile], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        dask_ddp.report(make(n))
        n += 1
    return n


def measure(client, profile: str, seconds: float) -> dict:
    me = psutil.Process()
    base, peak = me.memory_info().rss, {"self": 0, "child": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak["self"] = max(peak["self"], me.memory_info().rss)
            for child in me.children(recursive=True):
                try:
                    peak["child"] = max(peak["child"], child.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    job = dispatch.run(client, flood, profile, seconds, progress=False)
    calls = job.result()
    wall = time.perf_counter() - t0
    time.sleep(2)
    stop.set()
    watcher.join()
    dropped = getattr(job, "dropped", None)  # None: a dask-ddp without the limits
    return {"profile": profile, "calls": sum(calls), "wall": wall, "base": base, "peak": peak["self"],
            "after": me.memory_info().rss, "child": peak["child"], "kept": len(job.metrics),
            "dropped": None if dropped is None else sum(dropped.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from dask.distributed import Client, LocalCluster

    mib = 2**20
    lines = ["| profile | report() calls | wall s | scheduler+client peak MiB (start) | held after MiB | "
             "largest worker-side process peak MiB | kept | dropped |", "|---|---|---|---|---|---|---|---|"]
    for profile in args.profiles:  # a fresh cluster each: one profile's leftovers must not count for the next
        with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            r = measure(client, profile, args.seconds)
        lines.append(f"| {profile} | {r['calls']:,} | {r['wall']:.1f} | {r['peak'] / mib:.0f} ({r['base'] / mib:.0f})"
                     f" | {r['after'] / mib:.0f} | {r['child'] / mib:.0f} | {r['kept']:,} | "
                     f"{'n/a' if r['dropped'] is None else format(r['dropped'], ',')} |")
        print(lines[-1], flush=True)
    text = (f"# report() flood ({datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs, "
            f"dask-ddp from {Path(dask_ddp.__file__).parent})\n\n`python benchmarks/bench_report_flood.py "
            f"--seconds {args.seconds:g}`\n\n" + "\n".join(lines) + "\n")
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
