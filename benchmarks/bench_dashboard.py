"""What the DDP page's scheduler plugin adds to the scheduler: CPU per event batch, and per /metrics scrape.

Usage::

    python benchmarks/bench_dashboard.py [--reports 125] [--ranks 8] [--batches 20000]
                                         [--out benchmarks/RESULTS_dashboard.md]

The scheduler calls the plugin's ``log_event`` for every event it relays, on its event loop. This feeds
a :class:`~dask_ddp.dashboard.state.DashboardState` the batches a rank sends (one a second: ``--reports``
metric items and one telemetry item, the shape of the real batches) for ``--ranks`` ranks, and events of
other topics (a prefix check only), timing each kind with ``time.perf_counter`` over ``--batches``; then a
Prometheus scrape of the same state (``generate_latest``) and one redraw of the page's Bokeh models.
Single-threaded, no cluster: the figures are the plugin's own cost, to set beside the ~2 ms of CPU a batch
costs across worker, scheduler and client (``RESULTS_report_cpu.md``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dask_ddp.dashboard.jobs import JOBS_TOPIC  # noqa: E402
from dask_ddp.dashboard.state import DashboardState  # noqa: E402


def batch(rank: int, seq: int, reports: int) -> dict:
    now = time.time()
    items = tuple({"kind": "metric", "rank": rank, "attempt": 0, "step": seq * reports + i, "time": now,
                   "loss": 0.5} for i in range(reports))
    telemetry = {"kind": "telemetry", "rank": rank, "attempt": 0, "time": now, "step": seq * reports, "steps": reports,
                 "step_time": 0.008, "input_wait": 0.2, "collective_wait": 0.1, "samples_per_s": 4000.0,
                 "cpu_percent": 99.0, "rss_bytes": 2**30, "gpu_util": None, "gpu_mem_bytes": None,
                 "gpu_mem_peak_bytes": None, "last_report_age": 0.001}
    return {"run": "bench-0a1b2c3d-0", "rank": rank, "attempt": 0, "seq": seq, "items": items + (telemetry,)}


def per_call(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reports", type=int, default=125)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--out", default="benchmarks/RESULTS_dashboard.md")
    args = ap.parse_args()

    state = DashboardState()
    state.feed(JOBS_TOPIC, {"kind": "job", "run": "bench-0a1b2c3d", "name": "bench", "state": "RUNNING", "attempt": 0,
                            "time": time.time(), "ranks": [{"rank": r, "worker": f"tcp://10.0.0.{r}:1", "host":
                                                            f"10.0.0.{r}", "device": "cpu"} for r in range(args.ranks)]})
    msgs = [batch(i % args.ranks, i, args.reports) for i in range(min(args.batches, 2000))]
    ddp = per_call(lambda i: state.feed("dask-ddp-bench-0a1b2c3d", msgs[i % len(msgs)]), args.batches)
    other = per_call(lambda i: state.feed("tcp://10.0.0.1:1", {"action": "x"}), args.batches)

    import prometheus_client

    from dask_ddp.dashboard import prometheus
    from dask_ddp.dashboard.page import DDPPage

    prometheus.register(state)
    scrape = per_call(lambda i: prometheus_client.generate_latest(), 200)
    page = DDPPage(state)
    redraw = per_call(lambda i: page.update(), 200)

    def us(xs):
        return f"median {1e6 * statistics.median(xs):.1f} us, p99 {1e6 * sorted(xs)[int(0.99 * len(xs))]:.1f} us"

    lines = [
        f"# The DDP page's scheduler plugin: what it costs ({datetime.date.today()})", "",
        f"Command: `python benchmarks/bench_dashboard.py --reports {args.reports} --ranks {args.ranks} "
        f"--batches {args.batches}`", "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end; "
        f"Python {platform.python_version()}.", "",
        "| what | time per call |", "|---|---|",
        f"| `log_event` of a rank's batch ({args.reports} reports + 1 telemetry item) | {us(ddp)} |",
        f"| `log_event` of another topic (Dask's own events) | {us(other)} |",
        f"| a `/metrics` scrape (`generate_latest`: ours and prometheus_client's process collectors), {args.ranks} ranks | {us(scrape)} |",
        f"| one redraw of an open DDP page (every second per open tab), {args.ranks} ranks | {us(redraw)} |",
        "",
        "A rank sends at most one batch a second (`ddp.events.flush-interval`); each already costs about 2 ms "
        "of CPU across worker, scheduler and client (`RESULTS_report_cpu.md`).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
