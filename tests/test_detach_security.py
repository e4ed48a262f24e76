"""Detached jobs on a TLS cluster, and their results kept as bytes in the scheduler's process.

Real parts: a LocalCluster with ``Security.temporary()`` (TLS between every process) and one without, worker
processes, gloo. Every detached job is cancelled whatever happens (``_cluster.detached``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from _cluster import CliWorkers, detached, wait_until
from dask.distributed import Client, LocalCluster

import dask_ddp

CAP = 1_000_000  # ddp.detached.max-result-bytes of the module's own scheduler


def steps(n):
    for step in range(n):
        dask_ddp.report(step=step)
    return dask_ddp.get_context().rank


class Bomb:
    """A return value whose unpickling records the process it ran in (a __reduce__ that runs code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_unpickled_in, (self.path,))


def _unpickled_in(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return "unpickled"


def returns_bomb(path):
    return Bomb(path)


def returns_bytes(n):
    return b"x" * n


@pytest.mark.slow
def test_a_detached_job_runs_on_a_tls_cluster():
    from distributed.security import Security

    security = Security.temporary()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0",
                      security=security) as cluster, Client(cluster, security=security) as client:
        assert cluster.scheduler_address.startswith("tls://")
        name = f"tls-{uuid.uuid4().hex[:6]}"
        with detached(client, name):
            job = dask_ddp.dispatch.run(client, steps, 5, name=name, detach=True, progress=False)
            assert job.result(timeout=180) == [0, 1]
            again = dask_ddp.attach(client, name)
            assert again.result(timeout=60) == [0, 1] and again.state == "FINISHED"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A scheduler in a process of its own (``dask scheduler``) and two ``dask worker`` processes."""
    file = tmp_path_factory.mktemp("scheduler") / "scheduler.json"
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "DASK_DDP__DETACHED__MAX_RESULT_BYTES": str(CAP)})
    workers = None
    try:
        wait_until(file.exists, 60, what="the scheduler's file")
        with Client(scheduler_file=str(file), timeout=60) as client:
            workers = CliWorkers(client.scheduler.address)
            workers.start("w1"), workers.start("w2")
            client.wait_for_workers(2, timeout=120)
            yield client
    finally:
        if workers is not None:
            workers.close()
        scheduler.terminate()
        scheduler.wait(30)


@pytest.mark.slow
def test_a_detached_jobs_results_are_unpickled_only_by_the_client_that_asks(plain, tmp_path):
    marker = tmp_path / "unpickled"
    scheduler_pid = plain.run_on_scheduler(os.getpid)
    name = f"bomb-{uuid.uuid4().hex[:6]}"
    with detached(plain, name):
        job = dask_ddp.dispatch.run(plain, returns_bomb, str(marker), name=name, detach=True, progress=False)
        assert job.result(timeout=180) == ["unpickled", "unpickled"]
    pids = {int(p) for p in marker.read_text().split()}
    assert scheduler_pid not in pids, "a rank's return value was unpickled inside the scheduler's process"
    assert pids == {os.getpid()}, pids


@pytest.mark.slow
def test_a_detached_jobs_results_are_capped(plain):
    name = f"big-{uuid.uuid4().hex[:6]}"
    with detached(plain, name):  # the scheduler of the fixture runs with a cap of CAP bytes
        job = dask_ddp.dispatch.run(plain, returns_bytes, 2 * CAP, name=name, detach=True, progress=False)
        with pytest.raises(dask_ddp.DaskDDPError, match=r"rank \d returned .*over .*ddp\.detached\.max-result-bytes"):
            job.result(timeout=180)
