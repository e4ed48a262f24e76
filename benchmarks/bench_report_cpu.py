"""Where reporting costs CPU: per batch on the wire and per report, on every process of a LocalCluster.

Usage::

    python benchmarks/bench_report_cpu.py [--rate 125] [--phase 5] [--phases 6] [--intervals 0.1 0.5]
                                          [--out benchmarks/RESULTS_report_cpu.md]

Two ranks on a ``LocalCluster(n_workers=2, threads_per_worker=1)`` (so the
scheduler runs in this process, beside the client) report ``--rate`` times a
second each, paced with sleeps and no training, in ``--phases`` alternating
phases of ``--phase`` seconds: reporting, not reporting, reporting, ... One
job per ``ddp.events.flush-interval`` in ``--intervals``. A thread of this
process reads every thread's CPU time of this process and its children
(``/proc/PID/task/TID/schedstat``, nanoseconds) ten times a second; its own
thread is left out. The extra CPU while reporting is split into a cost per
batch and a cost per report by least squares over the intervals (their
batch rates differ, the report rate does not).
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

import dask_ddp


def paced_phases(rate, phase, phases):
    """Report ``rate`` times a second in even phases, not at all in odd ones; return each phase's (start, end)."""
    import time

    import torch.distributed as dist

    marks = []
    for p in range(phases):
        dist.barrier()
        start, i = time.time(), 0
        t0 = time.perf_counter()
        while time.time() - start < phase:
            i += 1
            while time.perf_counter() < t0 + i / rate:
                time.sleep(min(0.25 / rate, 0.001))
            if p % 2 == 0:
                dask_ddp.report(loss=0.5)
        marks.append((p % 2 == 0, start, time.time()))
    return marks


class Sampler(threading.Thread):
    """CPU seconds of every thread of this process tree, ten times a second (its own thread left out)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict]] = []
        self._done = threading.Event()

    def run(self):
        import psutil

        me, mine = psutil.Process(), threading.get_native_id()
        while not self._done.is_set():
            row = {}
            for proc in [me] + me.children(recursive=True):
                try:
                    label = "client+scheduler" if proc.pid == me.pid else " ".join(proc.cmdline()[-3:])
                    label = "rank process" if "dask_ddp.rank.main" in label else label
                    label = "worker process" if "multiprocessing" in label else label
                    for tid in os.listdir(f"/proc/{proc.pid}/task"):
                        if int(tid) == mine:
                            continue
                        with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                            row[(proc.pid, int(tid))] = (label, int(f.read().split()[0]) / 1e9)
                except (psutil.Error, OSError):
                    pass
            self.samples.append((time.time(), row))
            time.sleep(0.1)

    def finish(self):
        self._done.set()
        self.join()

    def cpu(self, t0: float, t1: float, exclude=()) -> dict[str, float]:
        """CPU seconds per second between t0 and t1, summed by process kind; ``exclude``: (pid, tid) left out."""
        def at(t):
            return next((row for ts, row in reversed(self.samples) if ts <= t), {})
        a, b = at(t0), at(t1)
        out: dict[str, float] = {}
        for key, (label, sec) in b.items():
            if key in a and key not in exclude:
                out[label] = out.get(label, 0.0) + (sec - a[key][1]) / (t1 - t0)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=125, help="reports per second per rank (an 8 ms step)")
    ap.add_argument("--phase", type=float, default=5.0)
    ap.add_argument("--phases", type=int, default=6)
    ap.add_argument("--intervals", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_report_cpu.md")))
    args = ap.parse_args(argv)
    import dask

    # the pipeline's own cost and speed, not the per-rank cap on bursts (ddp.events.max-bytes-per-interval,
    # benchmarks/bench_report_flood.py): a tight loop of reports would pass it
    dask.config.set({"ddp.events.max-bytes-per-interval": 1 << 30})

    import dask
    import numpy as np
    from dask.distributed import Client, LocalCluster

    from dask_ddp import dispatch

    results = []
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        dispatch.run(client, lambda: None, progress=False).result(timeout=300)
        for interval in args.intervals:
            dispatch.warm_up(client)
            sampler = Sampler()
            sampler.start()
            with dask.config.set({"ddp.events.flush-interval": interval}):
                job = dispatch.run(client, paced_phases, args.rate, args.phase, args.phases, progress=False)
            marks = job.result(timeout=600)[0]
            sampler.finish()
            on, off = {}, {}
            for reporting, t0, t1 in marks:
                for label, v in sampler.cpu(t0 + 0.3, t1).items():  # skip the barrier's first moments
                    side = on if reporting else off
                    side.setdefault(label, []).append(v)
            extra = {k: np.mean(on[k]) - np.mean(off.get(k, [0.0])) for k in on}
            seconds = sum(t1 - t0 for r, t0, t1 in marks if r)
            batches = sum(o.last_seq + 1 for o in job.attempt.outcomes.values()) / seconds
            results.append((interval, batches, 2 * args.rate, extra))

    # extra CPU (core-seconds per second) = per_batch * batches/s + per_report * reports/s
    a = np.array([[b, r] for _, b, r, _ in results])
    y = np.array([sum(e.values()) for *_, e in results])
    per_batch, per_report = np.linalg.lstsq(a, y, rcond=None)[0] if len(results) > 1 else (float("nan"),) * 2

    lines = ["| flush-interval (s) | batches/s (2 ranks) | reports/s | extra CPU while reporting, % of one core "
             "(by process) |", "|---|---|---|---|"]
    for interval, batches, reports, extra in results:
        parts = ", ".join(f"{k} {v * 100:+.2f}" for k, v in sorted(extra.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {interval:g} | {batches:.1f} | {reports} | **{sum(extra.values()) * 100:+.2f}** ({parts}) |")
    publish("Where reporting costs CPU", "\n".join(lines) + f"\n\nLeast squares over the intervals: "
            f"**{per_batch * 1000:.2f} ms of CPU per batch**, **{per_report * 1e6:.1f} us per report** (the report() "
            "call on the rank included).", args.out, f"dask-ddp {dask_ddp.__version__}")
    return 0


def publish(title: str, body: str, out: str | None, versions: str) -> None:
    """Print a results page (title, machine and load, the command line, ``body``) and write it to ``out``."""
    load = os.getloadavg()
    meta = (f"{datetime.datetime.now().isoformat(timespec='seconds')}, {platform.node()}, {os.cpu_count()} CPUs, "
            f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}, Python {platform.python_version()}, {versions}")
    text = f"# {title}\n\n{meta}\n\n`python {' '.join([Path(sys.argv[0]).name] + sys.argv[1:])}`\n\n{body}\n"
    print(text)
    if out:
        Path(out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
