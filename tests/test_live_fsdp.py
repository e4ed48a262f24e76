"""Live recovery of plain FSDP2 (issue 42, the memory tier): one copy of each shard, so each rank's shards are
also kept in a peer's memory after every step (dask_ddp.rank.live_memory). 3 ranks, FSDP2 on gloo, Adam, a real
LocalCluster; rank 1 SIGKILLed mid-job. With a spare worker the replacement gets rank 1's shards from its peer's
memory; without one the 2 ranks left take them, resharded. No storage is read: the job has no checkpoint_dir."""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
import torch
from _cluster import local_client, run, worker_pid

import dask_ddp

STEPS, BATCH = 16, 12  # a global batch of 12 samples, split over the ranks: the result does not depend on how many


def build(mesh):
    """The model sharded on ``mesh`` (ragged shards: 3 rows of 5 over 2 or 3 ranks) and its optimizer."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5), torch.nn.ReLU(),
                              torch.nn.Linear(5, 1))
    dask_ddp.shard_model(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def train_fsdp(steps: int, kill_rank: int, kill_at: int, once: str | None = None, how: str = "process",
               budget: int = 4 << 30):
    ctx = dask_ddp.get_context()
    torch.use_deterministic_algorithms(True)
    runs, pid = [], os.getpid()
    killer = once is not None and ctx.rank == kill_rank and not os.path.exists(once)
    for step in dask_ddp.live_steps(steps, build=build, memory_budget=budget):
        with step:
            runs.append((step.index, step.rank, step.world_size, time.monotonic()))
            if killer and step.index == kill_at:
                open(once, "w").close()
                os.kill(worker_pid(ctx) if how == "worker" else pid, signal.SIGKILL)
                time.sleep(30)  # the worker's rank goes with it
            g = torch.Generator().manual_seed(step.index)
            x = torch.randn(BATCH, 8, generator=g).chunk(step.world_size)[step.rank]
            loss = torch.nn.functional.mse_loss(step.model(x), x.sum(1, keepdim=True))
            step.optimizer.zero_grad()
            loss.backward()
            step.optimizer.step()
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in step.model.parameters()])
    return {"rank": ctx.rank, "pids": (pid, os.getpid()), "runs": runs, "params": full}


@pytest.fixture(scope="module")
def cluster():
    """4 worker processes (3 ranks and a spare), shared by the module's tests: each waits for all 4 (a killed
    worker's Nanny starts a new one)."""
    with local_client(4) as client:
        yield client


@pytest.fixture(scope="module")
def clean(cluster):
    """The result of the job without a fault."""
    return run(cluster, train_fsdp, STEPS, 9, 0, workers=3, recovery="live").result(timeout=180)


def _check(out, clean, survivors, world, tol):
    for o in out:
        if o["rank"] in survivors:
            assert o["pids"][0] == o["pids"][1]
            indices = [i for i, *_ in o["runs"]]
            assert sorted(set(indices)) == list(range(STEPS)), indices
            print(f"rank {o['rank']}: {len(indices) - STEPS} step(s) redone: {indices}")
            assert len(indices) - STEPS <= 2, indices
            assert {w for i, _, w, _ in o["runs"] if i > 8} == {world}
    for o in out:
        diff = (o["params"] - clean[0]["params"]).abs().max().item()
        print(f"rank {o['rank']}: largest difference from the clean run {diff:.2e}")
        assert diff <= tol, f"rank {o['rank']}: parameters differ from the clean run by {diff}"


@pytest.mark.parametrize("how", ["process", "worker"])
def test_a_lost_fsdp_rank_is_replaced_with_its_shards_from_a_peers_memory(cluster, clean, tmp_path, how):
    """Rank 1 lost at step 6 (its process or its Dask worker SIGKILLed) with a spare worker: ranks 0 and 2 keep
    their PIDs; the group rolls back to the newest step whose snapshot every rank's shards have (its own, or its
    peer's copy of rank 1's), the replacement takes rank 1's shards from there, and the parameters end equal to
    a run without the fault."""
    cluster.wait_for_workers(4, timeout=60)
    job = run(cluster, train_fsdp, STEPS, 1, 6, str(tmp_path / "killed"), how, workers=3, recovery="live",
              stall_timeout=60)
    out = job.result(timeout=240)
    history = [h[-1] for h in job.history]
    print(history)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert any("its replacement starts on" in h for h in history), history
    _check(out, clean, (0, 2), 3, 1e-6)


def test_a_lost_fsdp_rank_with_no_worker_free_leaves_its_shards_resharded_to_the_ranks_left(cluster, clean, tmp_path):
    """Rank 1 SIGKILLed at step 6 with no worker free (ddp.live.replace off): ranks 0 and 2 go on as a group of 2
    with rank 1's shards from memory, resharded onto 2 ranks (ragged: 5 rows over 3, then over 2); the result is
    the clean run's (up to the order of float sums: the global batch is split in 2 instead of 3)."""
    cluster.wait_for_workers(4, timeout=60)
    with dask.config.set({"ddp.live.replace": False}):
        job = run(cluster, train_fsdp, STEPS, 1, 6, str(tmp_path / "killed"), workers=3, recovery="live",
                  stall_timeout=60)
        out = job.result(timeout=240)
    history = [h[-1] for h in job.history]
    print(history)
    assert [o["rank"] for o in out] == [0, 2]
    _check(out, clean, (0, 2), 2, 1e-4)


def test_snapshots_past_the_memory_budget_turn_the_tier_off_and_a_loss_restarts(cluster, tmp_path):
    """A memory budget of 1 KB: the first snapshot would pass it, so the tier is off (a warning in the job's log);
    rank 1's loss cannot be healed from memory, the attempt ends saying so, and the restart finishes."""
    cluster.wait_for_workers(4, timeout=60)
    with dask.config.set({"ddp.live.replace": False}):
        job = run(cluster, train_fsdp, STEPS, 1, 6, str(tmp_path / "killed"), "process", 1000, workers=3,
                  recovery="live", max_restarts=1, stall_timeout=60)
        out = job.result(timeout=240)
    history = [h[-1] for h in job.history]
    print(history)
    assert any("memory tier holds no snapshot" in h for h in history), history
    assert job.attempt.index == 1 and [o["rank"] for o in out] == [0, 1, 2]
    assert any("memory tier is off" in line for line in job.logs), job.logs
