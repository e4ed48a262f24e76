"""Helpers for tests on real Dask clusters: cluster builders, a job runner, polling, leftover-process checks."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator

import psutil
from dask.distributed import Client, LocalCluster

from dask_ddp import dispatch


@contextlib.contextmanager
def local_client(n_workers: int = 2, **cluster_kw: Any) -> Iterator[Client]:
    """A client of a fresh LocalCluster with worker processes (Nannies), one thread each, on 127.0.0.1."""
    cluster_kw.setdefault("threads_per_worker", 1)
    cluster_kw.setdefault("host", "127.0.0.1")
    cluster_kw.setdefault("dashboard_address", "127.0.0.1:0")
    with LocalCluster(n_workers=n_workers, processes=True, **cluster_kw) as cluster, Client(cluster) as client:
        yield client


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


def rank_process_pids(client) -> dict:
    from dask_ddp.plugin import rank_process_pids as probe

    return client.run(probe)


def leftover_processes(client, wait: float = 10.0) -> list:
    """Descendants of the Dask worker processes that are not the (at most one) warm spare per worker.

    Waits up to ``wait`` seconds for killed processes to be reaped; returns what is left.
    """
    deadline = time.monotonic() + wait
    while True:
        worker_pids = client.run(os.getpid)
        spares = {p for got in rank_process_pids(client).values() for p in got["spare"]}
        left = []
        for pid in worker_pids.values():
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
