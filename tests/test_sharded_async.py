"""Async sharded saves: staged copies, uploads in the background while training goes on, one in flight, failures
and stalls that surface at the next call (or report()) naming the rank and the key, and their telemetry."""

from __future__ import annotations

import threading
import time

import dask.config
import pytest
import torch
from _cluster import local_client, run

import dask_ddp
from dask_ddp.checkpoint.sharded import background as sharded_async
from dask_ddp.checkpoint.sharded import writer as dcp_storage


@pytest.fixture(autouse=True)
def no_faults():
    yield
    dcp_storage.FAULTS[0] = None
    sharded_async.FAILED[0] = None


def slow_store(seconds, point="file-open", times=1):
    """A FAULTS hook: the first ``times`` uploads stall ``seconds`` at ``point``."""
    left = {"n": times}

    def hook(where, info):
        if where == point and left["n"] > 0:
            left["n"] -= 1
            time.sleep(seconds)

    return hook


def test_async_save_returns_at_once_and_commits_the_staged_state(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dcp_storage.FAULTS[0] = slow_store(1.5, times=2)
    assert dask_ddp.save_sharded({"model": model, "optim": opt}, 1, directory=str(tmp_path), async_save=True) is None
    uploading = sharded_async._S.thread
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    steps = 0
    while uploading.is_alive() and steps < 5:  # training goes on while the upload stalls
        opt.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        steps += 1
    assert steps == 5 and uploading.is_alive(), "the save did not return before its upload ended"
    assert not any(torch.equal(snapshot[k], v) for k, v in model.state_dict().items() if k.endswith("weight"))
    dask_ddp.save_sharded({"model": model, "optim": opt}, 2, directory=str(tmp_path), async_save=True)
    first, second = list(sharded_async.SAVES)[-1], None
    dask_ddp.wait_sharded()
    second = sharded_async.SAVES[-1]
    assert first["step"] == 1 and first["async"] and first["bytes"] > 32 * 32 * 4
    assert second["step"] == 2 and second["waited_s"] > 0.3, "the second save did not wait for the first"
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    assert dask_ddp.load_sharded({"model": fresh}, directory=str(tmp_path), step=1) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, snapshot[k]), f"{k}: step 1 holds other values than those at its save"


def test_an_upload_failure_surfaces_at_the_next_save_with_rank_and_key(tmp_path):
    model = torch.nn.Linear(16, 16)
    dask_ddp.save_sharded({"model": model}, 1, directory=str(tmp_path))

    def broken(where, info):
        if where == "file-open":
            raise OSError("injected: the store refused the write")

    dcp_storage.FAULTS[0] = broken
    dask_ddp.save_sharded({"model": model}, 2, directory=str(tmp_path), async_save=True)
    sharded_async._S.thread.join()
    dcp_storage.FAULTS[0] = None
    with pytest.raises(dcp_storage.ShardError, match=r"rank 0: writing .*/sharded/step-000000002-[0-9a-f]{8}/"
                                                     r"[0-9a-f]{4}-rank-00000-000\.distcp failed: OSError: injected"):
        dask_ddp.save_sharded({"model": model}, 3, directory=str(tmp_path))
    assert [s.step for s in dask_ddp.checkpoint.list_sharded(str(tmp_path))] == [1]
    dask_ddp.save_sharded({"model": model}, 3, directory=str(tmp_path))  # raised once; the next save works


def test_a_stalled_upload_fails_after_the_deadline_naming_rank_and_key(tmp_path):
    model = torch.nn.Linear(16, 16)
    dcp_storage.FAULTS[0] = slow_store(6.0, point="item-written")
    with dask.config.set({"ddp.checkpoint.upload-timeout": 1.0}):
        started = time.monotonic()
        dask_ddp.save_sharded({"model": model}, 1, directory=str(tmp_path), async_save=True)
        with pytest.raises(dcp_storage.ShardError, match=r"rank 0: the upload of .*/step-000000001-[0-9a-f]{8}/"
                                                         r"[0-9a-f]{4}-rank-00000-000\.distcp did not finish within "
                                                         r"ddp.checkpoint.upload-timeout \(1.0 s\)"):
            dask_ddp.wait_sharded()
        assert time.monotonic() - started < 5.0, "the deadline did not cut the stalled upload"
    assert dask_ddp.checkpoint.list_sharded(str(tmp_path)) == []


def train_with_async_saves(steps, failing_rank, fail_from):
    """DDP training that saves sharded asynchronously every 2 steps; ``failing_rank``'s store refuses the writes
    from its ``fail_from``-th save on (each save writes one file per rank). Returns the steps it reached."""
    from torch.nn.parallel import DistributedDataParallel

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    uploads = {"n": 0}

    def store(where, info):
        if where != "file-open":
            return
        uploads["n"] += 1
        if ctx.rank == failing_rank and uploads["n"] >= fail_from:
            raise OSError(f"injected on rank {ctx.rank}")
        time.sleep(0.3)  # uploads take a while: training goes on meanwhile

    dcp_storage.FAULTS[0] = store
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        dask_ddp.report(step=step, loss=1.0, alive=threading.active_count())
        if step % 2 == 1:
            dask_ddp.save_sharded({"model": model, "optim": opt}, step, async_save=True)
    return steps


def test_in_a_job_a_failed_background_save_fails_the_job_at_report_naming_rank_and_key(tmp_path):
    """Two ranks on a LocalCluster: the saves of steps 1 and 3 commit (their telemetry reaches the client), the
    save of step 5 fails on rank 1's store while both ranks train on; a later report() raises it."""
    with local_client(2) as client:
        job = run(client, train_with_async_saves, 40, 1, 3, checkpoint_dir=str(tmp_path))
        with pytest.raises(dcp_storage.ShardError) as err:
            job.result(timeout=180)
        text = str(err.value)
        assert "rank 1" in text and "step-000000005-" in text and "injected on rank 1" in text, text
        committed = [s.step for s in dask_ddp.checkpoint.list_sharded(job.checkpoint_dir)]
        assert committed == [1, 3], committed
        reported = job.metrics
        assert reported["step"].max() > 5, "training stopped at the failing save instead of going on"
        telemetry = job._record.telemetry
        assert any(t.get("ckpt_step") in (1, 3) and t.get("ckpt_bytes") for t in telemetry.values()), telemetry
