"""Helpers for tests on real Dask clusters: cluster builders, a job runner, polling, leftover-process checks,
``dask worker`` processes started from the command line (also used by benchmarks/bench_preemption.py), and a
synthetic plan (also used by benchmarks/bench_events_scale.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import cloudpickle
import psutil
from dask.distributed import Client, LocalCluster

import dask_ddp
from dask_ddp import dispatch

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its helpers run in ranks too (worker_pid)


@contextlib.contextmanager
def local_client(n_workers: int = 2, **cluster_kw: Any) -> Iterator[Client]:
    """A client of a fresh LocalCluster with worker processes (Nannies), one thread each, on 127.0.0.1."""
    cluster_kw.setdefault("threads_per_worker", 1)
    cluster_kw.setdefault("host", "127.0.0.1")
    cluster_kw.setdefault("dashboard_address", "127.0.0.1:0")
    with LocalCluster(n_workers=n_workers, processes=True, **cluster_kw) as cluster, Client(cluster) as client:
        yield client


def worker_pid(ctx) -> int:
    """Inside a rank: the PID of its Dask worker, the process listening on its address (a rank's parent is its
    zygote)."""
    import psutil

    port = int(ctx.worker.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)


def stop_host(ctx, record: str) -> None:
    """Inside a rank: stop its Dask worker and itself (SIGSTOP: a host cut off, no FIN ever comes), their pids and
    the worker's address written to ``record`` first for :func:`stopped_address` and :func:`kill_recorded`."""
    worker, me = worker_pid(ctx), os.getpid()
    with open(record, "w") as f:
        f.write(f"{worker} {me} {ctx.worker}")
    os.kill(worker, signal.SIGSTOP)
    os.kill(me, signal.SIGSTOP)


def stopped_address(record: str) -> str | None:
    """The address of the Dask worker :func:`stop_host` stopped, None if it did not."""
    return open(record).read().split()[2] if os.path.exists(record) else None


def kill_recorded(record: str) -> bool:
    """In the test's ``finally``: SIGKILL the processes :func:`stop_host` stopped, if it did (they never go on);
    True if it had."""
    if not os.path.exists(record):
        return False
    for pid in map(int, open(record).read().split()[:2]):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return True


def run(client, fn, *args, **kwargs):
    """``dispatch.run`` without the progress bar (tests read job.metrics instead)."""
    kwargs.setdefault("progress", False)
    return dispatch.run(client, fn, *args, **kwargs)


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
               what: str = "the condition", must: bool = True) -> Any:
    """Poll ``predicate`` until it returns something true and return that.

    After ``timeout`` s: fail the test (``must``), or return the last (false) value for the caller's own assert.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            if not value and must:
                raise AssertionError(f"{what} did not hold within {timeout} s (last value: {value!r})")
            return value
        time.sleep(interval)


def result_watching_the_scheduler(client, job, held_bytes: Callable, rss0: int, timeout: float = 240):
    """``job.result(timeout)`` while a thread samples, every 0.25 s, how far this process (it hosts the scheduler
    and the client) has grown past ``rss0`` and what ``held_bytes(topic)`` says the scheduler holds of the job's
    topic (run there with ``run_on_scheduler``): returns (result, peak growth in bytes, most bytes held)."""
    from dask_ddp.wire.task import topic_of

    me, peak, held, stop = psutil.Process(), [0], [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss - rss0)
            try:
                held[0] = max(held[0], client.run_on_scheduler(held_bytes, topic_of(job.run_id)))
            except Exception:  # noqa: BLE001 - the topic is dropped at the job's end
                pass
            time.sleep(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = job.result(timeout=timeout)
    finally:
        stop.set()
        watcher.join()
    return result, peak[0], held[0]


def rank_process_pids(client) -> dict:
    from dask_ddp.worker.plugin import rank_process_pids as probe

    return client.run(probe)


def leftover_processes(client, wait: float = 10.0) -> list:
    """Descendants of the Dask worker processes and of their zygotes (a zygote host's children) that are not what
    a worker keeps warm (its zygote and the rank it forked ahead for the next job, or its spare:
    ``rank_process_pids``' ``"spare"``).

    Waits up to ``wait`` seconds for killed processes to be reaped; returns what is left.
    """
    deadline = time.monotonic() + wait
    while True:
        worker_pids = client.run(os.getpid)
        warm = rank_process_pids(client).values()
        spares = {p for got in warm for p in got["spare"]}
        left = []
        for pid in {*worker_pids.values(), *(got["zygote"] for got in warm if got["zygote"])}:
            try:
                kids = psutil.Process(pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for kid in kids:
                try:
                    if kid.pid in spares or kid.status() == psutil.STATUS_ZOMBIE:
                        continue
                    left.append((kid.pid, " ".join(kid.cmdline())))
                except psutil.NoSuchProcess:
                    continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def no_running_ranks(client) -> bool:
    return all(not got["running"] for got in rank_process_pids(client).values())


_ENDED = ("FINISHED", "FAILED", "CANCELLED")


@contextlib.contextmanager
def detached(client, name: str, timeout: float = 60.0) -> Iterator[str]:
    """Around a test's code that starts the detached job ``name`` (``run(..., name=name, detach=True)``, in this
    process or a notebook's subprocess): on the way out, whatever happened, the job is cancelled and its ranks
    are gone, so that a failing test never leaves ranks that starve the module's next tests."""
    try:
        yield name
    except BaseException:
        with contextlib.suppress(Exception):  # the test's own failure is the one to report
            cancel_detached(client, name, timeout)
        raise
    cancel_detached(client, name, timeout)


def cancel_detached(client, name: str, timeout: float = 60.0) -> None:
    """Cancel every detached job of that name or run id that has not ended, and wait until none runs a rank.

    A job still starting in the scheduler (known, but without its driver's job yet) is cancelled as soon as it
    has one. Raises AssertionError if a job or a rank is still there after ``timeout`` seconds.
    """
    from dask_ddp.client import detach

    deadline, cancelled = time.monotonic() + timeout, set()
    while True:
        live = [f["run_id"] for f in client.run_on_scheduler(detach._find, name) if f["state"] not in _ENDED]
        for run_id in set(live) - cancelled:
            if client.run_on_scheduler(detach._cancel, run_id):  # False while its driver is still starting
                cancelled.add(run_id)
        if not live and no_running_ranks(client):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"detached job {name!r} still runs {timeout} s after it was cancelled: "
                                 f"{live or rank_process_pids(client)}")
        time.sleep(0.2)


def train_with_checkpoints(epochs, step_time):
    """DDP training that saves a checkpoint every epoch and resumes from the latest one: 5 steps an epoch,
    ``step_time`` s each; returns (world size, restart count, first epoch run, the parameters)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    state = dask_ddp.load_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, epochs):
        for _ in range(5):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            dask_ddp.report(loss=loss, epoch=epoch, world=ctx.world_size, at=time.time())
            time.sleep(step_time)
        dask_ddp.save_checkpoint({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                                  "epoch": epoch}, step=epoch, keep=2)
    return ctx.world_size, ctx.restart_count, start, torch.cat([p.detach().flatten() for p in model.parameters()])


def elastic_job_past_its_first_checkpoint(client, folder, ranks: int):
    """Start :func:`train_with_checkpoints` (10 epochs of 1 s) as an elastic job (``workers=(2, None)``, one
    restart) and return it once every one of its ``ranks`` ranks is in epoch 1 (a checkpoint saved)."""
    job = run(client, train_with_checkpoints, 10, 0.2, workers=(2, None), max_restarts=1, checkpoint_dir=str(folder))
    wait_until(lambda: not job.metrics.empty and (job.metrics["epoch"] >= 1).sum() >= ranks, 240,
               what="every rank in epoch 1 (a checkpoint saved)")
    return job


def first_step_after_restart(job) -> float:
    """When the first step of the job's last attempt was reported (``at``, the rank's clock)."""
    m = job.metrics
    return float(m.loc[m["attempt"] == m["attempt"].max(), "at"].min())


class CliWorkers:
    """``dask worker`` processes started from the command line (as a pod runs them), each with its Nanny."""

    def __init__(self, scheduler: str):
        self.scheduler, self.procs = scheduler, {}

    def start(self, name: str, **env) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "distributed.cli.dask_worker", self.scheduler, "--name", name, "--nthreads",
               "1", "--host", "127.0.0.1", "--no-dashboard", "--nanny"]
        self.procs[name] = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True)
        return self.procs[name]

    def descendants(self) -> list:
        out = []
        for proc in self.procs.values():
            try:
                out += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def synthetic_plan(hosts: int, per_host: int):
    """The plan for ``hosts`` hosts of ``per_host`` workers each, from a synthetic scheduler view (no cluster)."""
    from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info

    view = {f"tcp://10.0.{h // 250}.{h % 250 + 1}:{4000 + w}": {"host": f"10.0.{h // 250}.{h % 250 + 1}",
                                                             "name": f"h{h}-gpu{w}"}
            for h in range(hosts) for w in range(per_host)}
    return make_plan(workers_from_scheduler_info({"workers": view}))
