"""``ddp.warm-cuda`` (sweeps' trials): a job forks each worker's next rank as it starts and has it start CUDA
while the job runs; the next job of a rank alone on its host runs in it, a job whose ranks share a host never does
(they re-list ``CUDA_VISIBLE_DEVICES`` before CUDA starts).

Real parts: a LocalCluster with worker processes, gloo (and nccl on a GPU). Only on a host with a GPU driver's
device node does a job fork early (``Launcher.gpus_present``): on this CPU machine the module's workers are told
there is one (the one mock here: a GPU cannot exist), so the rank forked ahead gets its WarmCuda, finds no GPU
and waits as any rank forked ahead; one test checks that without the node nothing is forked early. The GPU test
checks that CUDA had started in the rank before its job.
"""

from __future__ import annotations

import os
import time

import dask
import pytest
from _cluster import local_client, run, wait_until

from dask_ddp.client import dispatch


def _spares(dask_worker):
    from dask_ddp.worker.plugin import RankHost

    forked = RankHost.of(dask_worker).launcher._forked
    return None if forked is None else (forked.pid, forked.cuda_warm)


def _job(hold: float = 0.0):
    import torch

    from dask_ddp.rank import warm

    time.sleep(hold)
    return os.getpid(), warm.WARMED, torch.cuda.is_initialized()


def _spare_of(client, address):
    return wait_until(lambda: client.run(_spares, workers=[address])[address], 30, what="the rank forked ahead")


@pytest.fixture(scope="module")
def client():
    with local_client(2) as c:
        dispatch.warm_up(c)
        c.run(_set_idle, 300.0)  # no rank replaced while a test waits on a loaded machine (one test sets 1 s)
        c.run(_say_gpus, True)
        yield c


def _say_gpus(present: bool | None) -> None:
    """In a worker: make ``Launcher.gpus_present`` answer ``present`` through the device nodes it looks for (True:
    ``/``, which exists; None: the real ones again)."""
    from dask_ddp.worker import launcher

    real = vars(launcher).setdefault("_real_gpu_nodes", launcher.GPU_NODES)
    launcher.GPU_NODES = real if present is None else ("/",) if present else ()


def _gpus_present() -> bool:
    from dask_ddp.worker.launcher import Launcher

    return Launcher.gpus_present()


def test_a_warm_cuda_job_forks_the_next_rank_at_its_start_and_the_next_job_runs_in_it(client):
    first = sorted(client.scheduler_info()["workers"])[0]
    with dask.config.set({"ddp.warm-cuda": True}):
        job = run(client, _job, 3.0, workers=[first])
        pid_ahead, told = wait_until(lambda: (lambda s: s if s and s[1] else None)(
            client.run(_spares, workers=[first])[first]), 20, what="the next rank forked while the job runs")
        assert not job.done(), "the next rank must be forked while the job runs, not at its end"
        (pid1, _, _), = job.result(timeout=120)
        nxt = run(client, _job, workers=[first])
        (pid2, warmed, _), = nxt.result(timeout=120)
    assert told and pid1 != pid_ahead and pid2 == pid_ahead, "the next job must run in the rank forked ahead"
    assert warmed is False, "no GPU here: the rank forked ahead must have found none and said so"


def test_without_a_gpu_driver_nothing_is_forked_early(client):
    """On a host without a GPU driver's device node ddp.warm-cuda changes nothing: the next rank is forked at the
    job's end, as without it (a CPU cluster's sweep keeps its turnover)."""
    first = sorted(client.scheduler_info()["workers"])[0]
    client.run(_say_gpus, None, workers=[first])
    try:
        if client.run(_gpus_present, workers=[first])[first]:
            pytest.skip("this host has a GPU driver")
        with dask.config.set({"ddp.warm-cuda": True}):
            run(client, _job, workers=[first]).result(timeout=120)
            assert _spare_of(client, first)[1] is False
            job = run(client, _job, 2.0, workers=[first])
            time.sleep(1.0)
            assert not job.done() and client.run(_spares, workers=[first])[first] is None, \
                "without a GPU nothing may be forked while a job runs"
            job.result(timeout=120)
    finally:
        client.run(_say_gpus, True, workers=[first])


def test_without_warm_cuda_the_next_rank_is_forked_at_the_jobs_end(client):
    first = sorted(client.scheduler_info()["workers"])[0]
    with dask.config.set({"ddp.warm-cuda": False}):
        run(client, _job, workers=[first]).result(timeout=120)  # no warm spare left by an earlier test
        before = _spare_of(client, first)
        assert before[1] is False
        job = run(client, _job, 2.0, workers=[first])
        time.sleep(1.0)
        assert not job.done() and client.run(_spares, workers=[first])[first] is None, \
            "without ddp.warm-cuda nothing is forked while a job runs"
        job.result(timeout=120)


def test_ranks_sharing_a_host_never_start_in_a_rank_that_started_cuda(client):
    workers = sorted(client.scheduler_info()["workers"])
    with dask.config.set({"ddp.warm-cuda": True}):
        job = run(client, _job, 1.0, workers=[workers[0]])
        ahead, told = wait_until(lambda: (lambda s: s if s and s[1] else None)(
            client.run(_spares, workers=[workers[0]])[workers[0]]), 20, what="a rank told to start CUDA")
        job.result(timeout=120)
        assert told
        both = run(client, _job, workers=workers).result(timeout=120)  # two ranks on one host: local_world_size 2
    pids = [pid for pid, _, _ in both]
    assert ahead not in pids, "a rank that may have started CUDA must not run a rank that re-lists its GPUs"
    wait_until(lambda: not _alive(ahead), 30, what="the rank that started CUDA ended")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.gpu
def test_on_a_gpu_the_next_trial_finds_cuda_started(client):
    """Needs a GPU (the lent GPU machine): the rank forked ahead started CUDA before its job; the job computes on
    its GPU with nccl (alone: its communicator made at the first collective)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    first = sorted(client.scheduler_info()["workers"])[0]

    def on_gpu():
        import torch
        import torch.distributed as dist

        from dask_ddp.rank import warm

        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        return warm.WARMED, dist.get_backend(), float(x.sum())

    with dask.config.set({"ddp.warm-cuda": True}):
        run(client, _job, 2.0, workers=[first]).result(timeout=120)
        assert _spare_of(client, first)[1]
        (warmed, backend, total), = run(client, on_gpu, workers=[first], backend="nccl").result(timeout=120)
    assert warmed and backend == "nccl" and total == 4.0


def _set_idle(seconds: float) -> float:
    from dask_ddp.worker import launcher

    before, launcher.WARM_CUDA_IDLE = launcher.WARM_CUDA_IDLE, seconds
    return before


def test_a_rank_that_started_cuda_and_waits_too_long_is_replaced_by_one_that_did_not(client):
    """Once a sweep has ended, no worker keeps a CUDA context in a waiting rank: after WARM_CUDA_IDLE (here 1 s)
    the rank told to start CUDA is ended and a plain one forked ahead in its place."""
    first = sorted(client.scheduler_info()["workers"])[0]
    before = client.run(_set_idle, 1.0, workers=[first])[first]  # 300 s: the fixture's
    try:
        with dask.config.set({"ddp.warm-cuda": True}):
            job = run(client, _job, workers=[first])
            job.result(timeout=120)
        warm = _spare_of(client, first)
        if not warm[1]:  # the job ended before its fork: the one forked at its end does not start CUDA
            pytest.fail(f"expected the rank forked at the job's start, told to start CUDA: {warm}")
        plain = wait_until(lambda: (lambda s: s if s and not s[1] else None)(
            client.run(_spares, workers=[first])[first]), 30, what="the warm rank replaced by a plain one")
        assert plain[0] != warm[0]
        wait_until(lambda: not _alive(warm[0]), 30, what="the warm rank's end")
        (pid, warmed, _), = run(client, _job, workers=[first]).result(timeout=120)
        assert pid == plain[0] and warmed is False
    finally:
        client.run(_set_idle, before, workers=[first])


def _trial(x):
    import dask_ddp

    time.sleep(1.0)  # long enough for the watch below to see the rank forked at its start, under load
    dask_ddp.report(value=x * x, step=0)


def test_a_sweeps_trials_start_cuda_ahead_and_its_end_ends_those_ranks(client):
    """ddp.sweep.warm-cuda (off by default: it takes GPU memory from running trials) reaches every trial of the
    sweep; once the sweep has ended no worker keeps a rank that started CUDA (here WARM_CUDA_IDLE is 300 s: only
    the sweep's end can end them)."""
    import dask_ddp

    seen: list = []

    def watch():
        while not s.done():
            seen.extend(v for v in client.run(_spares).values() if v and v[1])
            time.sleep(0.1)

    with dask.config.set({"ddp.sweep.warm-cuda": True}):  # read when the sweep starts
        s = dask_ddp.sweep(client, _trial, {"x": {"low": -1.0, "high": 1.0}}, n_trials=4, metric="value",
                           scheduler=None, sampler="random", seed=0, progress=False)
    try:
        watch()
        assert s.wait(120) and len(s.results()) == 4
    finally:
        s.cancel()
    assert seen, "the sweep's trials must fork the next rank at their start and have it start CUDA"
    plain = wait_until(lambda: all(v is None or not v[1] for v in client.run(_spares).values()), 30,
                       what="the ranks that started CUDA ended with the sweep")
    assert plain
    for pid, _ in set(seen):
        wait_until(lambda: not _alive(pid), 30, what=f"rank {pid} that started CUDA ended")


def test_by_default_a_sweep_starts_no_cuda_ahead(client):
    """Off by default: a rank that started CUDA while a trial runs holds ~0.5 GB of the GPU the trial may need."""
    import dask_ddp

    seen: list = []
    s = dask_ddp.sweep(client, _trial, {"x": {"low": -1.0, "high": 1.0}}, n_trials=3, metric="value",
                       scheduler=None, sampler="random", seed=1, progress=False)
    try:
        while not s.done():
            seen.extend(v for v in client.run(_spares).values() if v and v[1])
            time.sleep(0.1)
        assert s.wait(120)
    finally:
        s.cancel()
    assert seen == []
