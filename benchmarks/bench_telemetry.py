"""What per-rank telemetry costs a training step, and how long a straggler takes to be named.

Usage::

    python benchmarks/bench_telemetry.py [--blocks 60] [--steps 200] [--window 30]
                                         [--out benchmarks/RESULTS_telemetry.md]

Two ranks on a ``LocalCluster(n_workers=2, threads_per_worker=1)``, gloo,
CPU, ``torch.set_num_threads(1)`` in every rank.

1. Per-step overhead, in one job: a small CNN (two 3x3 convolutions on
   1x28x28 batches of 32 from a ``DataLoader`` over an in-memory dataset)
   trains in ``--blocks`` pairs of blocks of ``--steps`` steps. The
   *instrumented* block uses the first DDP model built in the rank (which
   carries dask-ddp's timing comm hook), the timed ``DataLoader`` iterator
   and ``report(loss=loss)`` every step; the *plain* block uses a second DDP
   model of the same shape (left alone by dask-ddp), the DataLoader's own
   ``__next__`` and no report. Which block goes first alternates. The
   overhead is the median over pairs of (instrumented / plain - 1), with the
   mean and its 95 % confidence interval, and the training thread's own CPU
   (``time.thread_time``) per step, instrumented minus plain.
2. The sampler (the flusher thread's once-a-second telemetry sample): the
   cost of one ``sample()``, timed in the rank, as a share of a second.
3. Time to name a straggler: rank 1 starts sleeping 0.1 s per step after
   ``5 s`` of even steps; the delay is the client's ``on_straggler`` time
   minus the time rank 1 began to sleep, with ``ddp.telemetry.straggler-window``
   set to ``--window`` (30 s, the default) and to 5 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_report import _mean_ci, pct, run_job
from bench_report_cpu import publish

import dask_ddp


def step_overhead(blocks, steps):
    """Seconds per step with and without telemetry + report() every step, in alternating blocks."""
    import statistics
    import time

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset, dataloader

    from dask_ddp.rank import telemetry

    torch.set_num_threads(1)
    ctx = dask_ddp.get_context()

    def cnn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    timed_model, plain_model = DDP(cnn()), DDP(cnn())  # the first carries the timing hook
    assert hasattr(timed_model, "_dask_ddp_timing") and not hasattr(plain_model, "_dask_ddp_timing")
    gen = torch.Generator().manual_seed(ctx.rank)
    data = TensorDataset(torch.randn(32 * 64, 1, 28, 28, generator=gen), torch.randint(0, 10, (32 * 64,), generator=gen))
    loader = DataLoader(data, batch_size=32, shuffle=False)
    base = dataloader._BaseDataLoaderIter
    patched = base.__next__
    original = patched.__wrapped__

    def block(n, on):
        model = timed_model if on else plain_model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        base.__next__ = patched if on else original
        it, done = iter(loader), 0
        c0, t0 = time.thread_time(), time.perf_counter()
        while done < n:
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                continue
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if on:
                dask_ddp.report(loss=loss)
            done += 1
        took = time.perf_counter() - t0
        base.__next__ = patched
        return took / n, (time.thread_time() - c0) / n

    block(30, True)
    block(30, False)  # warm-up
    on, off, cpu_on, cpu_off = [], [], [], []
    for b in range(blocks):
        for flag in ((True, False) if b % 2 else (False, True)):
            wall, cpu = block(steps, flag)
            (on if flag else off).append(wall)
            (cpu_on if flag else cpu_off).append(cpu)
    sampler = telemetry.Sampler(ctx.rank, 0)  # a second sampler on the same counters: timed, never sent
    sampler.device = ctx.device
    costs = []
    for _ in range(200):
        t0 = time.perf_counter()
        sampler.sample()
        costs.append(time.perf_counter() - t0)
    return {"on": statistics.median(on), "off": statistics.median(off),
            "pairs": [a / b - 1 for a, b in zip(on, off)],
            "cpu_pairs": [(a - b) / w for a, b, w in zip(cpu_on, cpu_off, off)],
            "sample_us": statistics.median(costs) * 1e6}


def straggle(even_s, slow_s, sleep):
    """Even steps for ``even_s`` seconds, then rank 1 sleeps ``sleep`` s per step for ``slow_s`` seconds."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    ctx = dask_ddp.get_context()
    model = DDP(torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, slow_since = time.time(), None
    while time.time() - start < even_s + slow_s:
        loss = model(torch.randn(16, 64)).pow(2).mean()
        if time.time() - start > even_s and ctx.rank == 1:
            if slow_since is None:
                slow_since = time.time()
                dask_ddp.report(slow_since=slow_since)
            time.sleep(sleep)
        else:
            time.sleep(0.01)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return slow_since


class Named:
    def __init__(self):
        self.at = []

    def on_straggler(self, job, event):
        self.at.append((time.time(), event))


def time_to_warning(client, window, even_s=5.0, sleep=0.1):
    import dask

    named = Named()
    with dask.config.set({"ddp.telemetry.straggler-window": window}):
        _, since = run_job(client, straggle, even_s, window + 8.0, sleep, callbacks=[named])
    if not named.at:
        return None, None
    at, event = named.at[0]
    return at - since[1], event


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=60)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--out", default=str(Path(__file__).with_name("RESULTS_telemetry.md")))
    args = ap.parse_args(argv)

    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as client:
        run_job(client, lambda: None, warm=False)  # start the zygotes
        _, over = run_job(client, step_overhead, args.blocks, args.steps)
        delays = [(w, *time_to_warning(client, w)) for w in sorted({args.window, 5.0})]

    rows = []
    for rank, o in enumerate(over):
        pairs = o["pairs"]
        mean, half = _mean_ci(pairs)
        cm, ch = _mean_ci(o["cpu_pairs"])
        rows.append((f"CNN step, rank {rank}: plain -> telemetry + report() every step (ms)",
                     f"{o['off'] * 1000:.2f} -> {o['on'] * 1000:.2f}",
                     f"median of {len(pairs)} paired blocks **{statistics.median(pairs) * 100:+.2f} %** (middle half "
                     f"{pct(pairs, 0.25) * 100:+.1f} to {pct(pairs, 0.75) * 100:+.1f} %), mean {mean * 100:+.2f} % "
                     f"(95 % CI {(mean - half) * 100:+.2f} to {(mean + half) * 100:+.2f} %); goal < 1 %"))
        rows.append((f"CNN step, rank {rank}: the training thread's own extra CPU, share of the step",
                     f"{statistics.median(o['cpu_pairs']) * 100:+.2f} %",
                     f"mean {cm * 100:+.2f} % (95 % CI {(cm - ch) * 100:+.2f} to {(cm + ch) * 100:+.2f} %); "
                     "time.thread_time(): the comm hook, the timed loader and report() on this thread"))
        rows.append((f"one telemetry sample (flusher thread, once a second), rank {rank}",
                     f"{o['sample_us']:.0f} us", f"{o['sample_us'] / 1e4:.3f} % of one core"))
    for window, delay, event in delays:
        rows.append((f"slow-down -> straggler named, window {window:g} s", "not named" if delay is None else
                     f"{delay:.1f} s", "" if event is None else f"rank {event['rank']}, cause {event['cause']}"))
    head = ("| measure | value | notes |", "|---|---|---|")
    table = "\n".join(head + tuple(f"| {a} | {b} | {c} |" for a, b, c in rows))
    publish("Telemetry benchmark", table, args.out, f"torch {__import__('torch').__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
