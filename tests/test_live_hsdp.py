"""Live recovery of HSDP (issue 42, "sharded models too"): FSDP2 on a 2-D mesh of 2 replica groups of 2 ranks,
gloo on CPU, a real LocalCluster; a rank SIGKILLed mid-job. The ranks of the other replica group and the lost
rank's partner keep their processes; the lost rank's replacement takes its shards from the other replica's
memory; the result equals a run without the fault. Without a spare worker, the job falls back to a restart
and says why."""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
import torch
from _cluster import kill_recorded, local_client, run, stop_host, stopped_address, wait_until, worker_pid

import dask_ddp

STEPS = 16


@pytest.fixture(scope="module")
def cluster():
    """5 worker processes (4 ranks and a spare), shared by the module's tests: each waits for all 5 (a killed
    worker's Nanny starts a new one)."""
    with local_client(5) as client:
        yield client


@pytest.fixture(scope="module")
def clean(cluster):
    """The parameters of the job without a fault."""
    return run(cluster, train_hsdp, STEPS, 9, 0, workers=4, recovery="live").result(timeout=180)


def build(mesh):
    """The model sharded on ``mesh`` and its optimizer (Adam: state the heal must carry)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 1))
    dask_ddp.shard_model(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def train_hsdp(steps: int, kill_rank: int, kill_at: int, once: str | None = None, how: str = "process"):
    ctx = dask_ddp.get_context()
    runs, pid, killer = [], os.getpid(), False
    if once is not None and ctx.rank == kill_rank:
        killer = not os.path.exists(once)  # a replacement or a restart runs this code too: kill once only
    for step in dask_ddp.live_steps(steps, build=build, shards=2):
        with step:
            runs.append((step.index, step.rank, step.world_size, time.monotonic()))
            if killer and step.index == kill_at:
                open(once, "w").close()
                if how == "worker":  # its rank goes with it (the supervisor's pipe closes)
                    os.kill(worker_pid(ctx), signal.SIGKILL)
                    time.sleep(30)
                if how == "hang":  # a host cut off: the worker and the rank stop, no FIN ever comes
                    stop_host(ctx, once + ".pids")
                else:
                    os.kill(pid, signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * step.index + step.rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(step.model(x), x.sum(1, keepdim=True))
            step.optimizer.zero_grad()
            loss.backward()
            step.optimizer.step()
            dask_ddp.report(step=step.index, loss=loss.item())
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in step.model.parameters()])
    return {"rank": ctx.rank, "pids": (pid, os.getpid()), "runs": runs, "params": full}


def _forget(client, address: str) -> None:
    """Remove the stopped worker at ``address`` from the scheduler (``close=False``: it cannot answer), before it is
    killed: its silence made it lost to the job, not to the scheduler, which noticed its death only after a minute or
    more (a later test's job was planned onto it and waited past 240 s), and kept its name from the worker its nanny
    started in its place."""
    async def remove(dask_scheduler):
        if address in dask_scheduler.workers:
            await dask_scheduler.remove_worker(address, stimulus_id="test-forget-stopped-worker", close=False)

    client.run_on_scheduler(remove)
    wait_until(lambda: address not in client.scheduler_info()["workers"], 30, what="the stopped worker gone")


@pytest.mark.parametrize("how", ["process", "worker", "hang"])
def test_a_rank_of_an_hsdp_replica_group_is_replaced_and_heals_from_the_other_replica(cluster, clean, tmp_path,
                                                                                       how):
    """Rank 3 (replica group 1, shard 1) lost at step 6 of a 4-rank HSDP job with a spare worker (its process
    SIGKILLed; its Dask worker SIGKILLed; or both stopped, a host cut off, found silent after ddp.worker-timeout
    while its peers wait inside FSDP's collectives): ranks 0-2 keep their PIDs and redo at most one step; rank
    3's replacement starts at step 6 with the shards of rank 1 (its replica) from memory; every rank ends with the
    parameters of a run without the fault (1e-6)."""
    once = str(tmp_path / "killed")
    cluster.wait_for_workers(5, timeout=60)
    try:
        job = run(cluster, train_hsdp, STEPS, 3, 6, once, how, workers=4, recovery="live", stall_timeout=60,
                  timeout=300)
        out = job.result(timeout=240)
    finally:
        stopped = stopped_address(once + ".pids")  # (job.plan names rank 3's replacement by now)
        if stopped:  # gone from the scheduler before its nanny's new worker registers under its name, and before
            _forget(cluster, stopped)  # the next test plans
        kill_recorded(once + ".pids")
    history = [h[-1] for h in job.history]
    print(history)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert any("its replacement starts on" in h for h in history), history
    for o in out[:3]:
        assert o["pids"][0] == o["pids"][1]
        indices = [i for i, *_ in o["runs"]]
        assert len(indices) - STEPS <= 1 and sorted(set(indices)) == list(range(STEPS)), indices
        assert {w for *_, w, _ in o["runs"]} == {4}
        redo = [t for i, _, _, t in o["runs"] if i == 6]
        print(f"rank {o['rank']}: the failed step begun to its redo begun: {redo[-1] - redo[0]:.2f} s")
        assert redo[-1] - redo[0] < 60, "released by a timeout, not by the recovery"
    assert [i for i, *_ in out[3]["runs"]] == list(range(6, STEPS))
    assert out[3]["pids"][0] not in {o["pids"][0] for o in out[:3]}
    for a, b in zip(out, clean):
        diff = (a["params"] - b["params"]).abs().max().item()
        print(f"rank {a['rank']}: largest difference from the clean run {diff:.2e}")
        assert diff <= 1e-6, f"rank {a['rank']}: parameters differ from the clean run by {diff}"
    assert job.state == "FINISHED"


def test_an_hsdp_replica_group_left_short_falls_back_to_a_restart_and_says_why(cluster, tmp_path):
    """No worker free (ddp.live.replace off): rank 1's replica group cannot be whole again, so live recovery
    cannot go on; the attempt ends, job.history says why, and the restart (max_restarts=1) finishes the job."""
    cluster.wait_for_workers(5, timeout=60)
    with dask.config.set({"ddp.live.replace": False}):
        job = run(cluster, train_hsdp, STEPS, 1, 6, str(tmp_path / "killed"), workers=4, recovery="live",
                  max_restarts=1, stall_timeout=60)
        out = job.result(timeout=240)
        history = [h[-1] for h in job.history]
        print(history)
        assert any("re-forms whole replica groups of 2 ranks only" in h for h in history), history
        assert job.attempt.index == 1 and [o["rank"] for o in out] == [0, 1, 2, 3]
        for o in out[1:]:
            assert torch.equal(o["params"], out[0]["params"])
