"""Shared fixtures: a real S3 endpoint on 127.0.0.1 (moto's server) and a real Dask cluster.

Nothing here is mocked: the S3 server speaks HTTP on loopback, the clusters run
worker processes, and torch process groups use gloo over loopback.
"""

from __future__ import annotations

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


# The longest files first (minutes each on 2 cores; the order of the clean-clone run of 2026-11-28, session 11):
# the test command runs three files at a time (pytest-xdist, --dist loadfile), and the short files then fill the
# end of the run instead of one worker finishing a long file alone. Within a file the order stays as written.
LONGEST_FIRST = ("test_trainers.py", "test_slurm.py", "test_hosts.py", "test_preemption.py", "test_live_recovery.py",
                 "test_docs.py", "test_cli.py", "test_demo.py", "test_resilience.py", "test_typing.py",
                 "test_hardening.py", "test_sweep.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def client():
    """A client of a LocalCluster of 2 worker processes on 127.0.0.1, shared by the tests of one module."""
    from _cluster import local_client

    with local_client(2) as c:
        yield c


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
