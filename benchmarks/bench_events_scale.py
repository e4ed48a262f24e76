"""The event path at many ranks: the scheduler's CPU per event batch, and the flush interval that keeps
dask-ddp's share of the scheduler under 10 % of one core up to 1,000 ranks.

Usage::

    python benchmarks/bench_events_scale.py [--senders 50,100,200,400] [--seconds 12] \
        [--out benchmarks/RESULTS_events_scale.md]

A real ``dask scheduler`` process (its CPU read with psutil), a real client in
this process subscribed to the job's topic through dask-ddp's own
:class:`dask_ddp.events.TopicFeed` (as a notebook is), and N senders: real
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

The rule (dask_ddp.task.flush_interval_for): a job sends at most
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


def _sender_process(address: str, topic: str, first_rank: int, n: int, control: str) -> None:
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
                w.log_event(topic, _batch(first_rank + i, seqs[i]))
                seqs[i] += 1
                await asyncio.sleep(interval / n)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))
        for w in workers:
            await w.close()
    asyncio.run(main())


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def measure(client, scheduler: psutil.Process, address: str, n: int, seconds: float, interval: float) -> dict:
    from dask_ddp.events import TopicFeed

    topic = f"ddp-bench-{n}-{int(interval * 1000)}"
    control = tempfile.mktemp(prefix="ddp-bench-ctl-")
    Path(control).write_text("0")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sender_process, args=(address, topic, i, min(PER_PROCESS, n - i), control))
             for i in range(0, n, PER_PROCESS)]
    before = len(client.scheduler_info(n_workers=-1)["workers"])
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
    rate = got / elapsed
    delays.sort()
    return {"n": n, "interval": interval, "idle": idle, "sending": sending, "rate": rate,
            "per_batch_ms": (sending - idle) / rate * 1e3 if rate else float("nan"),
            "client_per_batch_ms": client_cpu / rate * 1e3 if rate else float("nan"),
            "p95_delay": delays[int(len(delays) * 0.95)] if delays else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", default="50,100,200,400")
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--out", default="benchmarks/RESULTS_events_scale.md")
    args = parser.parse_args()
    from distributed import Client

    from dask_ddp.task import flush_interval_for

    port = 40000 + os.getpid() % 20000
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                              "--port", str(port), "--no-dashboard"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    address = f"tcp://127.0.0.1:{port}"
    rows = []
    try:
        with Client(address, timeout=60) as client:
            scheduler = psutil.Process(sched.pid)
            sizes = [int(x) for x in args.senders.split(",")]
            for n in sizes:
                rows.append(measure(client, scheduler, address, n, args.seconds, 1.0))
                print(rows[-1], flush=True)
            sized = flush_interval_for(1000, dask.config.get("ddp.events.flush-interval"),
                                       dask.config.get("ddp.events.max-batches-per-second"), rank=1)
            rows.append(measure(client, scheduler, address, sizes[-1], args.seconds, sized))
            print(rows[-1], flush=True)
    finally:
        sched.terminate()
        sched.wait(30)
    for r in rows:  # on a loaded machine the sender processes may not keep up: such a row measures little
        r["starved"] = r["rate"] < 0.8 * r["n"] / r["interval"]
    valid = [r["per_batch_ms"] for r in rows[:-1] if not r["starved"]] or [r["per_batch_ms"] for r in rows[:-1]]
    per_batch = sorted(valid)[len(valid) // 2]
    budget = dask.config.get("ddp.events.max-batches-per-second")
    lines = [
        "# The event path at many ranks", "",
        f"`python benchmarks/bench_events_scale.py --senders {args.senders} --seconds {args.seconds:g}` on "
        f"{platform.node()} ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end), "
        f"{time.strftime('%Y-%m-%d')}. A `dask scheduler` "
        "process, N real Dask workers (50 a process) each publishing one rank-shaped batch (5 reports, a telemetry "
        "item, 2 log lines) per interval with `worker.log_event`, this process's client subscribed through "
        "`TopicFeed`. Scheduler CPU in % of one core (psutil), idle = the same workers connected, sending nothing.",
        "",
        "| senders | interval s | batches/s received | scheduler idle % | scheduler sending % | scheduler ms/batch "
        "| client ms/batch | p95 delay s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['n']} | {r['interval']:.2f} | {r['rate']:.0f} | {r['idle'] * 100:.1f} | {r['sending'] * 100:.1f} "
              f"| {r['per_batch_ms']:.2f} | {r['client_per_batch_ms']:.2f} | {r['p95_delay']:.2f} |"
              + (" senders starved: left out" if r["starved"] else "") for r in rows]
    last = rows[-1]
    lines += ["", "Scheduler CPU per batch (median of the 1 s rows whose senders kept up, 80 % of the batches asked "
              f"for): **{per_batch:.2f} ms**. The rule "
              f"(`ddp.events.max-batches-per-second: {budget}`): a job sends at most {budget} batches a second; up to "
              f"{budget} ranks each rank flushes every 1 s, past that rank 0 keeps 1 s and the others flush every "
              f"(W - 1) / {budget - 1} s, at 1,000 ranks every {sized:.1f} s: about {budget * per_batch / 10:.1f} % "
              f"of one core of the "
              f"scheduler. Checked in the last row: {last['n']} senders at that interval cost "
              f"{(last['sending'] - last['idle']) * 100:.1f} % of a core, "
              f"{(last['sending'] - last['idle']) * 100 * 1000 / last['n']:.1f} % projected to 1,000 ranks."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
