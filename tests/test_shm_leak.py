"""Shared memory a rank made is removed when the rank ends, also where its code (or its children) set their own
SIGTERM handler: a cancel, or a job that fails.

What removes it is the rank's multiprocessing resource tracker, a process of the rank's group that ignores
SIGTERM and removes what is still registered once every process that can register more (the rank and what it
forked) has ended. Seen before: a rank and a forked child that ignore SIGTERM (or handle it and go on) outlived
the stop's SIGTERM and grace; SIGKILL to the rank alone left the child, which still holds the tracker's pipe, so
the tracker waited, and SIGKILL to the whole group then killed it too: the segments stayed in /dev/shm.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
from _cluster import leftover_processes, run, wait_until

import dask_ddp
from dask_ddp.checkpoint.folder import atomic_write
from dask_ddp.worker import process

SHM = "/dev/shm"


def _sleep_forever():
    while True:
        time.sleep(0.05)


class _OwnSegment:
    """A dataset whose DataLoader worker makes a shared memory segment of its own (registered with the rank's
    tracker, which the forked worker shares) and names it in ``folder``."""

    def __init__(self, folder):
        self.folder, self.segment = folder, None

    def __len__(self):
        return 10**9

    def __getitem__(self, i):
        from multiprocessing import shared_memory

        import torch

        if self.segment is None:
            self.segment = shared_memory.SharedMemory(create=True, size=4096)
            rank = dask_ddp.get_context().rank
            atomic_write(os.path.join(self.folder, f"loader{rank}.json"), json.dumps([self.segment.name]).encode())
        return torch.zeros(4)


def _shm_and_own_sigterm(folder, how, fail_rank=None):
    """Set a SIGTERM handler of the job's own (``how``: "ignore" or "handle", which goes on), make a shared
    memory segment, fork a child (it inherits the handler) and start a DataLoader worker that makes a segment of
    its own; name both in ``folder``; report steps until stopped, or raise on ``fail_rank``."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    from torch.utils.data import DataLoader

    signal.signal(signal.SIGTERM, signal.SIG_IGN if how == "ignore" else lambda *_: None)
    rank = dask_ddp.get_context().rank
    segment = shared_memory.SharedMemory(create=True, size=4096)
    child = mp.get_context("fork").Process(target=_sleep_forever)
    child.start()
    loader = iter(DataLoader(_OwnSegment(folder), num_workers=1, batch_size=None))
    next(loader)
    atomic_write(os.path.join(folder, f"rank{rank}.json"), json.dumps([segment.name]).encode())  # whole: globbed
    step = 0
    while True:
        dask_ddp.report(step=step)
        if rank == fail_rank and step == 5:
            raise RuntimeError("this rank fails on purpose")
        next(loader)
        step += 1
        time.sleep(0.05)


def _names(folder) -> list[str]:
    return [n for f in sorted(folder.glob("*.json")) for n in json.loads(f.read_text())]


@pytest.mark.slow
@pytest.mark.parametrize("how, end", [("ignore", "cancel"), ("handle", "cancel"), ("handle", "failure")])
def test_a_rank_with_its_own_sigterm_handler_leaves_no_shared_memory(client, tmp_path, how, end):
    fail_rank = 1 if end == "failure" else None
    job = run(client, _shm_and_own_sigterm, str(tmp_path), how, fail_rank)
    names: list[str] = []
    try:
        wait_until(lambda: len(list(tmp_path.glob("*.json"))) == 4, 120, what="both ranks' segments made")
        names = _names(tmp_path)
        assert len(names) == 4 and all(os.path.exists(os.path.join(SHM, n)) for n in names), names
        t0 = time.monotonic()
        if end == "cancel":
            wait_until(lambda: not job.metrics.empty and job.metrics["rank"].nunique() == 2, 120,
                       what="both ranks reporting")
            job.cancel()
            assert job.state == "CANCELLED"
        else:
            with pytest.raises(Exception, match="fails on purpose"):
                job.result(timeout=120)
        bound = process.STOP_GRACE + process.TRACKER_WAIT + 10
        gone = wait_until(lambda: not [n for n in names if os.path.exists(os.path.join(SHM, n))], bound,
                          interval=0.1, must=False)
        left = [n for n in names if os.path.exists(os.path.join(SHM, n))]
        print(f"{how} SIGTERM, {end}: the job's end to its shared memory gone: {time.monotonic() - t0:.2f} s")
        assert gone and not left, f"left in {SHM} after the {end}: {left}"
        assert leftover_processes(client) == []
    finally:
        job.cancel()
        for n in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, n))
