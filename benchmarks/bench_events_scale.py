"""The event path at many ranks: the scheduler's CPU per event batch, and the flush interval that keeps
dask-ddp's share of the scheduler under 10 % of one core up to 1,000 ranks.

Usage::

    python benchmarks/bench_events_scale.py [--senders 50,100,200,400] [--seconds 12] \
        [--out benchmarks/RESULTS_events_scale.md]

A real ``dask scheduler`` process (its CPU read with psutil), a real client in
this process subscribed to the job's topic through dask-ddp's own
:class:`dask_ddp.client.events.TopicFeed` (as a notebook is), and N senders: real
Dask workers (``Worker(..., nthreads=1)``, several in each of a few sender
processes, no torch) that each publish one event batch per interval with
``worker.log_event`` on the job's topic, shaped as a rank's Relay publishes
them (``{"run", "rank", "attempt", "seq", "items"}``; items: 5 metric reports,
one telemetry item and 2 log lines, about 1.5 KiB). For each N:

1. idle: the senders connected, nothing sent, ``--seconds`` long: the
   scheduler's CPU for N workers' heartbeats (not dask-ddp's share);
2. sending: one batch per sender per second for ``--seconds``: the extra
   scheduler CPU over idle, divided by the batches the client received, is
   the scheduler's CPU per batch (``c``); the client's CPU per batch too.

The rule (dask_ddp.client.launch.flush_interval_for): a job sends at most
``max-batches-per-second`` (``B``, 60) batches a second in all. Up to ``B``
ranks every rank flushes every ``flush-interval`` (1 s); past that rank 0
keeps that interval (the notebook's live view) and the others flush every
``(W - 1) / (B - 1)`` seconds. With ``c`` measured here the job costs the
scheduler about ``B * c`` of a core whatever the world size. The last run
checks it: the largest N at the interval the rule gives the ranks other than
0 at 1,000 ranks, the scheduler share projected to 1,000 ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dask
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # _cluster.synthetic_plan

PER_PROCESS = 50  # sender workers per sender process


def _batch(rank: int, seq: int) -> dict:
    now = time.time()
    items = [{"kind": "metric", "rank": rank, "attempt": 0, "step": seq * 5 + i, "time": now, "loss": random.random(),
              "lr": 0.01, "samples": 64} for i in range(5)]
    items.append({"kind": "telemetry", "rank": rank, "attempt": 0, "time": now, "step": seq * 5 + 4, "steps": 5,
                  "step_time": 0.2, "input_wait": 0.1, "collective_wait": 0.3, "samples_per_s": 320.0,
                  "cpu_percent": 98.0, "rss_bytes": 1 << 30, "gpu_util": None, "gpu_mem_bytes": None,
                  "gpu_mem_peak_bytes": None, "last_report_age": 0.01})
    items += [{"kind": "log", "rank": rank, "attempt": 0, "time": now, "stream": "stdout",
               "line": f"epoch 3 step {seq * 5 + i}: loss {random.random():.4f} " + "x" * 60} for i in range(2)]
    return {"run": "bench", "rank": rank, "attempt": 0, "seq": seq, "items": items}


def _event(sender: int, seq: int, per_event: int) -> dict:
    """One sender's event: a rank's batch, or (``per_event`` > 1) a host hub's, with that many ranks' batches."""
    if per_event == 1:
        return _batch(sender, seq)
    return {"run": "bench", "batches": [_batch(sender * per_event + k, seq) for k in range(per_event)]}


def _sender_process(address: str, topic: str, first_rank: int, n: int, control: str, per_event: int = 1) -> None:
    """Run ``n`` workers; publish while the file ``control`` holds an interval > 0; exit when it is gone."""
    from distributed import Worker

    async def main():
        workers = [await Worker(address, nthreads=1, dashboard=False, silence_logs=50) for _ in range(n)]
        seqs = [0] * n
        while os.path.exists(control):
            try:
                interval = float(Path(control).read_text() or 0)
            except (OSError, ValueError):
                interval = 0
            if interval <= 0:
                await asyncio.sleep(0.2)
                continue
            start = time.monotonic()
            for i, w in enumerate(workers):  # spread over the interval, as independent ranks would be
                w.log_event(topic, _event(first_rank + i, seqs[i], per_event))
                seqs[i] += 1
                await asyncio.sleep(interval / n)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))
        for w in workers:
            await w.close()
    asyncio.run(main())


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure(client, scheduler: psutil.Process, address: str, n: int, seconds: float, interval: float,
            per_event: int = 1) -> dict:
    """Scheduler and client CPU for ``n`` senders each publishing an event of ``per_event`` rank batches every
    ``interval`` s (the client's feed unpacks hub events: it counts rank batches)."""
    from dask_ddp.client.cluster import scheduler_workers
    from dask_ddp.client.events import TopicFeed

    topic = f"ddp-bench-{n}-{int(interval * 1000)}-{per_event}"
    control = tempfile.mktemp(prefix="ddp-bench-ctl-")
    Path(control).write_text("0")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sender_process, args=(address, topic, i, min(PER_PROCESS, n - i), control,
                                                       per_event))
             for i in range(0, n, PER_PROCESS)]
    before = len(scheduler_workers(client))
    for p in procs:
        p.start()
    client.wait_for_workers(before + n, timeout=300)
    feed = TopicFeed(client, topic)
    try:
        time.sleep(3)  # registration settles
        s0, c0 = _cpu(scheduler), time.process_time()
        time.sleep(seconds)
        idle = (_cpu(scheduler) - s0) / seconds
        Path(control).write_text(str(interval))
        time.sleep(interval + 1)
        feed.get(0)
        s0, c0, t0 = _cpu(scheduler), time.process_time(), time.monotonic()
        got, delays = 0, []
        while time.monotonic() - t0 < seconds:
            for batch in feed.get(0.2):
                got += 1
                delays.append(time.time() - batch["items"][0]["time"])
        elapsed = time.monotonic() - t0
        sending = (_cpu(scheduler) - s0) / elapsed
        client_cpu = (time.process_time() - c0) / elapsed
    finally:
        os.unlink(control)
        for p in procs:
            p.join(60)
        feed.close()
    rate = got / elapsed / per_event  # events a second
    delays.sort()
    return {"n": n, "interval": interval, "per_event": per_event, "idle": idle, "sending": sending, "rate": rate,
            "per_batch_ms": (sending - idle) / rate * 1e3 if rate else float("nan"),
            "client_per_batch_ms": client_cpu / rate * 1e3 if rate else float("nan"),
            "p95_delay": delays[int(len(delays) * 0.95)] if delays else float("nan")}


def _hub_interval(hosts: int, per_host: int, flush: float, budget: float) -> float:
    """What dask-ddp's rule (launch.hub_plan) gives the hubs other than rank 0's: a synthetic plan of that shape."""
    from _cluster import synthetic_plan

    from dask_ddp.client.launch import hub_plan

    plan = synthetic_plan(hosts, per_host)
    return hub_plan(plan, flush, budget, per_host=True)[plan.world_size - 1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", default="50,100,200,400")
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--hub-senders", type=int, default=100, help="hub senders in the 1 s hub row")
    parser.add_argument("--ranks-per-host", type=int, default=8, help="rank batches in a hub's event")
    parser.add_argument("--out", default="benchmarks/RESULTS_events_scale.md")
    args = parser.parse_args()
    from distributed import Client

    from dask_ddp.client.launch import HUB_COST_PER_RANK, flush_interval_for

    port = 40000 + os.getpid() % 20000
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                              "--port", str(port), "--no-dashboard"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    address = f"tcp://127.0.0.1:{port}"
    rows = []
    flush = dask.config.get("ddp.events.flush-interval")
    budget = dask.config.get("ddp.events.max-batches-per-second")
    hosts = 1000 // args.ranks_per_host
    try:
        with Client(address, timeout=60) as client:
            scheduler = psutil.Process(sched.pid)
            sizes = [int(x) for x in args.senders.split(",")]
            for n in sizes:
                rows.append(measure(client, scheduler, address, n, args.seconds, 1.0))
                print(rows[-1], flush=True)
            sized = flush_interval_for(1000, flush, budget, rank=1)
            rows.append(measure(client, scheduler, address, sizes[-1], args.seconds, sized))
            print(rows[-1], flush=True)
            # hubs (ddp.events.per-host): one event a host, with its ranks' batches
            rows.append(measure(client, scheduler, address, args.hub_senders, args.seconds, 1.0, args.ranks_per_host))
            print(rows[-1], flush=True)
            hub_interval = _hub_interval(hosts, args.ranks_per_host, flush, budget)
            rows.append(measure(client, scheduler, address, hosts, args.seconds, hub_interval, args.ranks_per_host))
            print(rows[-1], flush=True)
    finally:
        sched.terminate()
        sched.wait(30)
    for r in rows:  # on a loaded machine the sender processes may not keep up: such a row measures little
        r["starved"] = r["rate"] < 0.8 * r["n"] / r["interval"]
    plain = rows[:len(sizes)]
    valid = [r["per_batch_ms"] for r in plain if not r["starved"]] or [r["per_batch_ms"] for r in plain]
    per_batch = sorted(valid)[len(valid) // 2]
    lines = [
        "# The event path at many ranks", "",
        f"`python benchmarks/bench_events_scale.py --senders {args.senders} --seconds {args.seconds:g} "
        f"--hub-senders {args.hub_senders} --ranks-per-host {args.ranks_per_host}` on "
        f"{platform.node()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end), "
        f"{time.strftime('%Y-%m-%d')}. A `dask scheduler` "
        "process, N real Dask workers (50 a process) each publishing one event per interval with "
        "`worker.log_event`: a rank-shaped batch (5 reports, a telemetry item, 2 log lines, about 1.5 KiB), or, "
        f"in the hub rows, a host hub's event holding {args.ranks_per_host} such batches (`ddp.events.per-host`); "
        "this process's client subscribed through `TopicFeed`. Scheduler CPU in % of one core (psutil), idle = the "
        "same workers connected, sending nothing.",
        "",
        "| senders | ranks per event | interval s | events/s received | scheduler idle % | scheduler sending % "
        "| scheduler ms/event | client ms/event | p95 delay s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['n']} | {r['per_event']} | {r['interval']:.2f} | {r['rate']:.0f} | {r['idle'] * 100:.1f} "
              f"| {r['sending'] * 100:.1f} | {r['per_batch_ms']:.2f} | {r['client_per_batch_ms']:.2f} "
              f"| {r['p95_delay']:.2f} |" + (" senders starved: left out" if r["starved"] else "") for r in rows]
    last, hub, thousand = rows[len(sizes)], rows[-2], rows[-1]
    lines += ["", "Scheduler CPU per event of one rank (median of the 1 s rows whose senders kept up, 80 % of the "
              f"events asked for): **{per_batch:.2f} ms**; per hub event of {args.ranks_per_host} ranks: "
              f"**{hub['per_batch_ms']:.2f} ms**. The rule "
              f"(`ddp.events.max-batches-per-second: {budget}`): a job sends at most {budget} events a second. "
              f"Without hubs, up to {budget} ranks each rank flushes every 1 s, past that rank 0 keeps 1 s and the "
              f"others flush every (W - 1) / {budget - 1} s, at 1,000 ranks every {sized:.1f} s: about "
              f"{budget * per_batch / 10:.1f} % of one core of the scheduler. Checked: {last['n']} senders at that "
              f"interval cost {(last['sending'] - last['idle']) * 100:.1f} % of a core, "
              f"{(last['sending'] - last['idle']) * 100 * 1000 / last['n']:.1f} % projected to 1,000 ranks.",
              "",
              f"With hubs (`ddp.events.per-host: auto`, the default past the bound when a host runs several ranks) "
              f"the same rule counts hosts, each hub event weighted by its extra cost "
              f"(`launch.HUB_COST_PER_RANK` = {HUB_COST_PER_RANK} a rank past the first; measured here: "
              f"{(hub['per_batch_ms'] / per_batch - 1) / (args.ranks_per_host - 1):.3f}): 1,000 ranks on {hosts} "
              f"hosts of {args.ranks_per_host} publish every "
              f"{hub_interval:.1f} s (the host of rank 0 every 1 s). Measured directly in the last row, {hosts} "
              f"hub senders of {args.ranks_per_host} ranks each (1,000 ranks' batches): "
              f"**{(thousand['sending'] - thousand['idle']) * 100:.1f} % of one scheduler core**, "
              f"p95 delay {thousand['p95_delay']:.2f} s from a report's time to the client (a report waits up to "
              f"1 s in its rank and up to {hub_interval:.1f} s in its hub before that: at most "
              f"{1 + hub_interval:.1f} s old in the notebook)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
