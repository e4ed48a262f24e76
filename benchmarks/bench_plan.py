"""Rank planning at cluster scale: 10,000 workers on 1,250 hosts, from a synthetic scheduler view.

Usage::

    python benchmarks/bench_plan.py [--repeats 9] [--out benchmarks/RESULTS_plan.md]

What dispatch does before anything ships: read the workers out of
the scheduler's identity (:func:`dask_ddp.wire.plan.workers_from_scheduler_info`)
and give each a rank (:func:`dask_ddp.wire.plan.make_plan`). The view is built in
memory with the shape the scheduler gives (address -> ``{"host", "name"}``), 8
workers a host named like dask-cuda's (``gpu0``..``gpu7``), in a shuffled order,
for 10, 100, 1,000 and 10,000 workers. Times are the best of ``--repeats``
runs, both as wall time and as this process's CPU time (less sensitive to other
load on a shared machine). The per-host parse cache is cleared before each run.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from pathlib import Path

from dask_ddp.wire import plan

SIZES = (10, 100, 1_000, 10_000)


def scheduler_view(n_workers: int, per_host: int = 8, seed: int = 0) -> dict:
    """``{"workers": {address: {"host", "name"}}}`` for ``n_workers`` workers, ``per_host`` a host, shuffled."""
    view = {}
    for i in range(n_workers):
        h, g = divmod(i, per_host)
        host = f"10.{h // 65536 % 256}.{h // 256 % 256}.{h % 256}"
        view[f"tcp://{host}:{40000 + g}"] = {"host": host, "name": f"gpu{g}"}
    items = list(view.items())
    random.Random(seed).shuffle(items)
    return {"workers": dict(items)}


def best(fn, repeats: int, timer) -> float:
    out = float("inf")
    for _ in range(repeats):
        plan._host_key.cache_clear()
        t = timer()
        fn()
        out = min(out, timer() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/RESULTS_plan.md")
    args = parser.parse_args()
    rows = []
    for n in SIZES:
        view = scheduler_view(n)

        def once(view=view):
            return plan.make_plan(plan.workers_from_scheduler_info(view))
        p = once()
        assert p.world_size == n and p.ranks[-1].num_nodes == -(-n // 8)
        wall = best(once, args.repeats, time.perf_counter)
        cpu = best(once, args.repeats, time.process_time)
        rows.append((n, -(-n // 8), wall * 1e3, cpu * 1e3))
        print(f"{n:>6} workers: {wall * 1e3:7.1f} ms wall, {cpu * 1e3:7.1f} ms CPU")
    lines = ["# Rank planning at scale", "",
             f"`python benchmarks/bench_plan.py --repeats {args.repeats}` on {platform.node()} "
             f"({platform.processor() or platform.machine()}, Python {platform.python_version()}), "
             f"{time.strftime('%Y-%m-%d')}. Read the workers out of a synthetic scheduler view and plan every "
             "rank (best of the repeats). Goal (issue 17): under 100 ms at 10,000 workers on 1,250 hosts.", "",
             "| workers | hosts | wall ms | CPU ms |", "|---:|---:|---:|---:|"]
    lines += [f"| {n:,} | {h:,} | {w:.1f} | {c:.1f} |" for n, h, w, c in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
