"""Shared fixtures: a real S3 endpoint on 127.0.0.1 (moto's server) and a real Dask cluster.

Nothing here is mocked: the S3 server speaks HTTP on loopback, the clusters run
worker processes, and torch process groups use gloo over loopback.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The longest files first (minutes each on 2 cores): the test command runs two files at a time
# (pytest-xdist, --dist loadfile), and the short files then fill the end of the run instead of one worker
# finishing a long file alone. Within a file the order stays as written.
LONGEST_FIRST = ("test_preemption.py", "test_hosts.py", "test_resilience.py", "test_demo.py", "test_cli.py",
                 "test_hardening.py", "test_slurm.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class _SharedCluster:
    """One LocalCluster of 2 worker processes per test process (xdist worker), handed from module to module while
    it stays as a module found it; else closed and started afresh for the next module.

    A fresh cluster costs ~18 CPU-s (two workers, two zygotes importing torch, the scheduler): the 24 modules
    that take ``client`` started one each, on a suite that is CPU-bound on 2 cores. "As found": the same two
    workers (none killed, closed or added), no rank running, no process left under a worker but what it keeps
    warm. A module that changes its workers in ways this cannot see sets ``FRESH_CLUSTER = True``."""

    def __init__(self):
        self._stack = None
        self.client = None
        self._workers: set = set()

    def take(self):
        from _cluster import local_client

        if self.client is not None and self._why_not_reused() is None:
            return self.client
        self.close()
        self._stack = contextlib.ExitStack()
        self.client = self._stack.enter_context(local_client(2))
        self._workers = set(self.client.scheduler_info()["workers"])
        return self.client

    def _why_not_reused(self):
        from _cluster import leftover_processes, no_running_ranks

        try:
            if self.client.status != "running":
                return "its client closed"
            if set(self.client.scheduler_info()["workers"]) != self._workers:
                return "its workers changed"
            if not no_running_ranks(self.client):
                return "ranks still run"
            left = leftover_processes(self.client, wait=5)
            return f"processes left: {left}" if left else None
        except Exception as exc:  # noqa: BLE001 - any doubt: a fresh one
            return repr(exc)

    def close(self):
        if self._stack is not None:
            with contextlib.suppress(Exception):
                self._stack.close()
        self._stack, self.client = None, None


@pytest.fixture(scope="session")
def _shared_cluster():
    shared = _SharedCluster()
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def client(request, _shared_cluster):
    """A client of a LocalCluster of 2 worker processes on 127.0.0.1, shared by the tests of one module, and
    handed on to the next module that takes one while it stays as the module found it (:class:`_SharedCluster`);
    a module with ``FRESH_CLUSTER = True`` gets one of its own."""
    if getattr(request.module, "FRESH_CLUSTER", False):
        from _cluster import local_client

        with local_client(2) as c:
            yield c
        return
    yield _shared_cluster.take()


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1, on a port it binds itself; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server):
    """storage_options for s3fs against the test server, and a fresh bucket name per test."""
    import uuid

    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    opts = {"client_kwargs": {"endpoint_url": s3_server}, "key": "testing", "secret": "testing"}
    return {"endpoint": s3_server, "bucket": bucket, "storage_options": opts}
