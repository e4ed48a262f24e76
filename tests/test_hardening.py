"""What real users do to a job, on a real LocalCluster: a client that goes away, odd names, odd input, repeats."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dask_ddp

from _cluster import leftover_processes, rank_process_pids, run, wait_until

NOTEBOOK = textwrap.dedent('''
    import os, sys, time
    import dask_ddp
    from dask.distributed import Client

    def forever():
        dask_ddp.report(started=1.0)
        while True:
            time.sleep(0.05)

    client = Client(sys.argv[1])
    job = dask_ddp.dispatch.run(client, forever, progress=False)
    while job.metrics["rank"].nunique() < 2 if not job.metrics.empty else True:
        time.sleep(0.05)
    print("running", flush=True)
    if sys.argv[2] == "close":
        client.close()
        print("closed", flush=True)
        time.sleep(60)
    else:
        time.sleep(60)  # the test kills this process
''')


def running_ranks(client) -> list[int]:
    return [pid for got in rank_process_pids(client).values() for pid in got["running"]]


@pytest.mark.parametrize("how", ["close", "kill"])
def test_ranks_stop_when_the_client_that_started_them_goes_away(client, how):
    """A notebook's kernel restarted (or its client closed) mid-training: its ranks must not train on as orphans."""
    proc = subprocess.Popen([sys.executable, "-c", NOTEBOOK, client.scheduler.address, how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running", proc.stderr.read()
        assert len(running_ranks(client)) == 2
        if how == "close":
            assert proc.stdout.readline().strip() == "closed"
        else:
            proc.send_signal(signal.SIGKILL)
        gone_at = time.monotonic()
        wait_until(lambda: not running_ranks(client), 30, what="every rank stopped")
        took = time.monotonic() - gone_at
    finally:
        proc.kill()
        proc.wait()
    print(f"client {how}: ranks stopped {took:.2f} s later")
    assert took < 10, f"the ranks outlived their client by {took:.1f} s"
    assert leftover_processes(client) == []
    assert run(client, lambda: "next").result(timeout=120) == ["next", "next"]  # the workers are free
