"""Helpers for tests on real Dask clusters: leftover-process checks and cluster builders."""

from __future__ import annotations

import os
import time

import psutil


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
