"""Live recovery (issue 42, first part): a rank killed with SIGKILL costs its peers the step in flight, not a
restart. A real LocalCluster of 3 worker processes, gloo, a real process death (the rank's own SIGKILL, or its
Dask worker's); the survivors keep their processes and re-form their group without it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _cluster import local_client, run, wait_until

import dask_ddp
from dask_ddp.wire.errors import PlanError

STEPS = 24


def train_live(steps: int, kill_rank: int, kill_at: int, when: str, worker_pid_file: str | None = None):
    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    runs, pid = [], os.getpid()
    for step in dask_ddp.live_steps(steps, model=net, optimizer=opt):
        with step:
            runs.append((step.index, step.rank, step.world_size, time.monotonic()))
            mine = ctx.rank == kill_rank and step.index == kill_at
            if mine and when == "worker":
                os.kill(os.getppid() if worker_pid_file is None else int(open(worker_pid_file).read()),
                        signal.SIGKILL)
                time.sleep(30)  # the worker's death ends this process (it dies with its parent)
            if mine and when == "before":
                os.kill(pid, signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * step.index + step.rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mine and when == "after":  # its vote is in: the step commits everywhere, the next is redone
                os.kill(pid, signal.SIGKILL)
            dask_ddp.report(step=step.index, loss=loss.item())
            time.sleep(0.02)
    return {"rank": ctx.rank, "pids": (pid, os.getpid()), "runs": runs,
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}


def _check(out, history, kill_at, when):
    assert [o["rank"] for o in out] == [0, 1], out  # the values of the ranks that finished
    for o in out:
        assert o["pids"][0] == o["pids"][1]
        indices = [i for i, *_ in o["runs"]]
        assert sorted(set(indices)) == list(range(STEPS)), indices  # every step committed
        redone = len(indices) - STEPS
        assert redone <= 1, f"rank {o['rank']} redid {redone} steps: {indices}"
        assert {w for i, _, w, _ in o["runs"] if i > kill_at + 1} == {2}  # the group of the 2 survivors
        assert {w for i, _, w, _ in o["runs"] if i < kill_at} == {3}
        last3 = max(t for _, _, w, t in o["runs"] if w == 3)
        first2 = min(t for _, _, w, t in o["runs"] if w == 2)
        print(f"rank {o['rank']}: {redone} step(s) redone; the last step begun in the group of 3 to the first in "
              f"the group of 2: {first2 - last3:.2f} s")
    assert torch.equal(out[0]["params"], out[1]["params"]), "the survivors' parameters differ"
    assert any("live recovery" in cause for *_, cause in history), history


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_rank_killed_mid_job_costs_its_peers_one_step(when):
    """SIGKILL of rank 2's process at step 10, before its gradients are in (its peers' all-reduce fails) or
    after its vote (the step commits everywhere; the next one fails): ranks 0 and 1 keep their PIDs, redo at most
    one step, re-form a group of 2 and finish with equal parameters."""
    with local_client(3) as client:
        started = time.monotonic()
        job = run(client, train_live, STEPS, 2, 10, when, recovery="live", max_restarts=0)
        out = job.result(timeout=180)
        took = time.monotonic() - started
        history = job.history
        print(f"{when}: {took:.1f} s; history: {[h[-1] for h in history]}")
        _check(out, history, 10, when)
        assert job.state == "FINISHED"


def test_a_dask_worker_killed_mid_job_costs_its_peers_one_step(tmp_path):
    """SIGKILL of rank 2's Dask worker process (its rank dies with it): the controller sees the worker lost and
    the two survivors go on, as for a rank's own death."""
    with local_client(3) as client:
        job = run(client, train_live, STEPS, 2, 10, "worker", recovery="live")
        out = job.result(timeout=180)
        _check(out, job.history, 10, "worker")


def test_recovery_is_checked():
    with local_client(1) as client:
        with pytest.raises(PlanError, match="recovery="):
            run(client, train_live, 2, 9, 9, "none", recovery="alive")


def test_live_steps_outside_a_live_job_says_how_to_start_one():
    with pytest.raises(dask_ddp.LiveRecoveryError, match='recovery="live"'):
        next(dask_ddp.live_steps(3, model=torch.nn.Linear(1, 1), optimizer=None))
