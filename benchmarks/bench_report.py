"""What ``dask_ddp.report()`` costs the training loop, and how fast its events reach the notebook.

Usage::

    python benchmarks/bench_report.py [--calls 100000] [--blocks 60] [--steps 250] [--burst 50000]
                                      [--rate 200] [--seconds 10] [--complete 5000,50000]
                                      [--parts cost,overhead,burst,paced,complete]
                                      [--out benchmarks/RESULTS_report.md]

Two ranks on a ``LocalCluster(n_workers=2, threads_per_worker=1)``, gloo,
CPU, ``torch.set_num_threads(1)`` in every rank. Before each measured job the
benchmark waits until every worker's spare rank process has imported torch,
so no spare starting in the background competes with the measurement.

1. Cost of one call on the training thread: ``--calls`` calls of
   ``report(loss=..., acc=...)`` in a tight loop on each rank, each timed
   with ``time.perf_counter_ns`` (the timer's own cost, measured the same way
   around nothing, is shown beside it).
2. Per-step overhead: a small CNN (two 3x3 convolutions on random 1x28x28
   batches of 32, DDP) trains in ``--blocks`` pairs of blocks of
   ``--steps`` steps, one block reporting ``report(loss=loss)`` every step and
   one not reporting, alternating which goes first. The overhead is the
   median over pairs of (time with reports / time without - 1), and their
   mean with its 95 % confidence interval (normal approximation), which also
   counts what report() costs off the training thread (the flusher thread,
   the supervisor, the scheduler and the client share the CPUs); the time
   spent inside the report() calls is shown as a share of the loop as well.
   On a busy machine the paired ratio is noisy: read its spread. A rank
   sends a batch at most every ``ddp.events.flush-interval`` (1 s), so the
   last batch of a reporting block may be handled while the next block runs:
   at most one batch (about 2 ms of CPU, ``bench_report_cpu.py``) per block,
   under 0.1 % of a 250-step block.
3. End-to-end throughput: each rank reports ``--burst`` times as fast as it
   can; events/s is all events over the time from the first report to the
   client's callback receiving the last one.
4. End-to-end delay: each rank reports ``--rate`` times a second for
   ``--seconds``; the delay is the client callback's ``time.time()`` minus
   the event's ``time`` (same machine, same clock).
5. Complete at the default limits: each rank reports ``--complete`` times (a
   comma-separated list of runs) as fast as it can, 3 keys a report, with the
   default ``ddp.events.max-bytes-per-interval``: the rows ``job.metrics``
   kept, whether each rank's are in order, the loop's wall time on the rank,
   and how long ``report()`` waited for room (``job.history``).

Parts 1-4 raise ``max-bytes-per-interval`` to 1 GiB, so they measure the
pipeline and the fast path of ``report()``, not the budget; ``--parts`` runs
a subset (part 1 is ``cost``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_report_cpu import Sampler, publish

import dask_ddp

# ---- run on the ranks ------------------------------------------------------------------------------------------


def report_cost(calls):
    """Time every call of report() on this rank; return percentiles in microseconds."""
    import time

    import torch

    torch.set_num_threads(1)
    clock = time.perf_counter_ns
    spent, empty = [0] * calls, [0] * calls
    for i in range(calls):
        t0 = clock()
        t1 = clock()
        empty[i] = t1 - t0
    for i in range(calls):
        t0 = clock()
        dask_ddp.report(loss=0.25, acc=0.5)
        spent[i] = clock() - t0
    return {"report": _percentiles(spent), "timer": _percentiles(empty)}


def tight_loop(n):
    """Report n times as fast as possible, 3 keys a report; return the loop's wall time on the rank."""
    import time

    t0 = time.perf_counter()
    for i in range(n):
        dask_ddp.report(loss=1.0 / (i + 1), acc=i / n, lr=0.1)
    return time.perf_counter() - t0


def _percentiles(ns):
    ns = sorted(ns)
    pick = lambda q: ns[min(len(ns) - 1, int(q * len(ns)))] / 1000  # noqa: E731
    return {"median": pick(0.5), "p99": pick(0.99), "mean": sum(ns) / len(ns) / 1000, "max": ns[-1] / 1000}


def step_overhead(blocks, steps):
    """Median seconds per training step with and without report() every step, in alternating blocks."""
    import statistics
    import time

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)

    inside = []  # seconds spent inside report() calls, per reporting block
    marks = []  # (reporting, wall start, wall end) of every block, for the client's CPU accounting
    cpu = {True: [], False: []}  # the training thread's own CPU seconds per step, per block

    def block(n, reporting):
        spent = 0.0
        start, c0, t0 = time.time(), time.thread_time(), time.perf_counter()
        for _ in range(n):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if reporting:
                t1 = time.perf_counter()
                dask_ddp.report(loss=loss)
                spent += time.perf_counter() - t1
        took = time.perf_counter() - t0
        cpu[reporting].append((time.thread_time() - c0) / n)
        marks.append((reporting, start, time.time()))
        if reporting:
            inside.append(spent / took)
        return took / n

    block(30, False)  # warm-up
    marks.clear()
    cpu[False].clear()
    on, off = [], []
    for b in range(blocks):
        for reporting in ((True, False) if b % 2 else (False, True)):
            (on if reporting else off).append(block(steps, reporting))
    pairs = [a / b - 1 for a, b in zip(on, off)]
    # the training thread's extra CPU per step, as a share of the step's wall time without reports
    cpu_pairs = [(a - b) / w for a, b, w in zip(cpu[True], cpu[False], off)]
    return {"on": statistics.median(on), "off": statistics.median(off), "pairs": pairs, "cpu_pairs": cpu_pairs,
            "inside": statistics.median(inside), "marks": marks, "pid": os.getpid()}


def burst(n):
    """Report n times as fast as possible; return when the first report was made."""
    import time

    first = time.time()
    for i in range(n):
        dask_ddp.report(x=i)
    return first


def paced(rate, seconds):
    """Report ``rate`` times a second for ``seconds`` (a training loop of rate steps/s)."""
    import time

    period, start = 1.0 / rate, time.perf_counter()
    for i in range(int(rate * seconds)):
        while time.perf_counter() < start + i * period:
            time.sleep(min(period / 4, 0.001))
        dask_ddp.report(x=i)


# ---- the client side -------------------------------------------------------------------------------------------


def _spare_ready(dask_worker=None) -> str:
    from dask_ddp.worker.plugin import RankHost

    return "ready" if RankHost.of(dask_worker).launcher.wait_ready(0.05) else "starting"


def wait_warm(client, limit=120.0):
    deadline = time.monotonic() + limit
    while set(client.run(_spare_ready).values()) != {"ready"}:
        if time.monotonic() > deadline:
            raise RuntimeError("the workers' spare rank processes did not start")
        time.sleep(0.2)


class Arrivals:
    """A plain callback: the client's time of arrival of every metric event, with the event's own time."""

    def __init__(self):
        self.rows = []

    def __call__(self, event):
        if event.get("kind") == "metric":
            self.rows.append((time.time(), event["time"]))


def run_job(client, fn, *args, callbacks=(), warm=True):
    from dask_ddp import dispatch

    if warm:
        wait_warm(client)
    job = dispatch.run(client, fn, *args, progress=False, callbacks=list(callbacks))
    return job, job.result(timeout=3600)  # --blocks 80 of 250 steps run for about 10 minutes


def _mean_ci(xs):
    """Mean and the half-width of its 95 % confidence interval (normal approximation)."""
    return statistics.mean(xs), 1.96 * statistics.stdev(xs) / len(xs) ** 0.5


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--burst", type=int, default=50_000)
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--complete", default="5000,50000", help="reports per rank of each run of part 5")
    ap.add_argument("--parts", default="cost,overhead,burst,paced,complete")
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_report.md")))
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    import dask

    budget = dask.config.get("ddp.events.max-bytes-per-interval")  # part 5 runs with it
    # the pipeline's own cost and speed, not the per-rank budget (ddp.events.max-bytes-per-interval,
    # benchmarks/bench_report_flood.py): a tight loop of reports would pass it
    dask.config.set({"ddp.events.max-bytes-per-interval": 1 << 30})

    import dask
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        client.run(lambda: None)
        run_job(client, lambda: None, warm=False)  # no spares yet: start the first rank processes
        flush = dask.config.get("ddp.events.flush-interval")

        rows = []
        if "cost" in parts:
            _, costs = run_job(client, report_cost, args.calls)
            rows += cost_rows(costs, args.calls)
        if "overhead" in parts:
            sampler = Sampler()
            sampler.start()
            _, over = run_job(client, step_overhead, args.blocks, args.steps)
            sampler.finish()
            rows += overhead_rows(over, sampler)
        if "burst" in parts:
            arrivals = Arrivals()
            job, firsts = run_job(client, burst, args.burst, callbacks=[arrivals])
            n_burst, elapsed = len(job.metrics), arrivals.rows[-1][0] - min(firsts)
            rows.append((f"events/s, 2 ranks x {args.burst:,} reports to the client's callback",
                         f"{n_burst / elapsed:,.0f}", "", f"{n_burst:,} events in {elapsed:.2f} s"))
        if "paced" in parts:
            lag = Arrivals()
            run_job(client, paced, args.rate, args.seconds, callbacks=[lag])
            delays = [(got - sent) * 1000 for got, sent in lag.rows]
            rows.append((f"delay report() -> client callback, 2 ranks x {args.rate}/s for {args.seconds:g} s (ms)",
                         f"{statistics.median(delays):.0f}", f"{pct(delays, 0.99):.0f}",
                         f"{len(delays):,} events; max {max(delays):.0f}; ddp.events.flush-interval {flush} s"))
        if "complete" in parts:
            with dask.config.set({"ddp.events.max-bytes-per-interval": budget}):
                for n in map(int, args.complete.split(",")):
                    job, walls = run_job(client, tight_loop, n)
                    rows.append(complete_row(job, walls, n, budget))

    head = ("| measure | median | p99 | notes |", "|---|---|---|---|")
    table = "\n".join(head + tuple(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows))
    publish("report() benchmark", table, args.out, f"torch {__import__('torch').__version__}")
    return 0


def complete_row(job, walls, n, budget):
    """Part 5's row: rows kept and in order, the loop's wall time on the ranks, the waits job.history names."""
    import re

    m = job.metrics
    in_order = all(m.loc[m["rank"] == r, "step"].tolist() == list(range(n)) for r in (0, 1))
    waited = [c for *_, c in job.history if "waited for room" in c]
    seconds = re.search(r"([0-9.]+) s in all", waited[-1]).group(1) if waited else "0"
    return (f"tight loop at the default limits ({budget:,} bytes a flush interval), 2 ranks x {n:,} reports of 3 "
            "keys: rows in job.metrics", f"{len(m):,} of {2 * n:,}", "",
            f"{'every rank in order' if in_order else 'NOT complete and in order'}; the loop took "
            f"{' / '.join(f'{w:.2f}' for w in walls)} s on the ranks; report() waited {seconds} s in all; "
            f"dropped {sum(job.dropped.values()):,}")


def cost_rows(costs, calls):
    rows = []
    for rank, c in enumerate(costs):
        rows.append((f"report() on the training thread, rank {rank}, {calls:,} calls (us)",
                     f"{c['report']['median']:.1f}", f"{c['report']['p99']:.1f}",
                     f"mean {c['report']['mean']:.1f}, max {c['report']['max']:.0f}; timer alone: median "
                     f"{c['timer']['median']:.2f}, p99 {c['timer']['p99']:.2f}"))
    return rows


def overhead_rows(over, sampler):
    rows = []
    training = {(o["pid"], o["pid"]) for o in over}  # the ranks' main threads: measured by the ranks
    for rank, o in enumerate(over):
        pairs = sorted(o["pairs"])
        mean, half = _mean_ci(pairs)
        rows.append((f"CNN step, rank {rank}: without report -> with report every step (ms)",
                     f"{o['off'] * 1000:.2f} -> {o['on'] * 1000:.2f}", "",
                     f"overhead (goal < 1 %): median of {len(pairs)} paired blocks "
                     f"{statistics.median(pairs) * 100:+.2f} % (middle half {pct(pairs, 0.25) * 100:+.1f} to "
                     f"{pct(pairs, 0.75) * 100:+.1f} %), mean "
                     f"{mean * 100:+.2f} % (95 % CI {(mean - half) * 100:+.2f} to {(mean + half) * 100:+.2f} %); time "
                     f"inside report() {o['inside'] * 100:.3f} % of the loop"))
    # Off the training thread: every other thread of the cluster, reporting blocks against their partners
    marks = over[0]["marks"]  # both ranks run the same blocks at the same time (DDP keeps them in step)
    background = [sum(sampler.cpu(t0, t1, exclude=training).values()) for _, t0, t1 in marks]
    side = [reporting for reporting, _, _ in marks]
    bg_pairs = [(background[i] - background[i + 1]) * (1 if side[i] else -1) for i in range(0, len(marks) - 1, 2)]
    bg_mean, bg_half = _mean_ci(bg_pairs)
    worst = max(_mean_ci(o["cpu_pairs"])[0] for o in over)
    worst_half = max(_mean_ci(o["cpu_pairs"])[1] for o in over)
    for rank, o in enumerate(over):
        m, h = _mean_ci(o["cpu_pairs"])
        rows.append((f"CNN step, rank {rank}: the training thread's own extra CPU with report(), share of the step",
                     f"{statistics.median(o['cpu_pairs']) * 100:+.2f} %", "",
                     f"mean {m * 100:+.2f} % (95 % CI {(m - h) * 100:+.2f} to {(m + h) * 100:+.2f} %); "
                     "time.thread_time(): what the rank itself spends, not the waits others cause it"))
    rows.append(("extra CPU on every other thread (flusher, supervisor, worker, scheduler, client) while "
                 "reporting, share of one core", f"{statistics.median(bg_pairs) * 100:+.2f} %", "",
                 f"mean {bg_mean * 100:+.2f} % (95 % CI {(bg_mean - bg_half) * 100:+.2f} to "
                 f"{(bg_mean + bg_half) * 100:+.2f} %), paired blocks, /proc schedstat of every thread"))
    rows.append(("overhead bound: training thread + all of that CPU taken from the ranks (goal < 1 %)",
                 f"**{(worst + bg_mean) * 100:+.2f} %**", "",
                 f"95 % CI up to {(worst + worst_half + bg_mean + bg_half) * 100:+.2f} %; a rank waits for the "
                 "slower one every step, so CPU taken from either delays both: at most one core-second of delay "
                 "per core-second taken"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
