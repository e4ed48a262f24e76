"""Preemption and growth on real clusters: a worker told to leave gives the job time to save; jobs grow.

Real parts throughout: LocalClusters of Nannies and ``dask worker`` processes started from the command
line (as in a pod), gloo process groups on loopback, checkpoints in real folders. The training function is
bitwise repeatable on CPU (fixed seeds, each step's data drawn from its step number), so a resumed run can be
compared with an uninterrupted one of the same world size.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import dask_ddp
from dask_ddp import elastic
from dask_ddp.outcome import RankOutcome, Status

from _cluster import leftover_processes, local_client, run, wait_until


def train_steps(n_steps, pause=0.05, every=None, register=True):
    """``n_steps`` DDP steps, resumable from any step; returns the final parameters, flattened."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start, step = 0, -1
    state = dask_ddp.load_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1

    def snapshot():
        return {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}

    if register:
        dask_ddp.on_preemption(snapshot)
    for step in range(start, n_steps):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if every and step % every == every - 1:
            dask_ddp.save_checkpoint(snapshot(), step=step)
        if not register and (p := dask_ddp.preempted()) is not None:
            dask_ddp.save_checkpoint(snapshot(), step=p.step)
            raise p
        dask_ddp.report(step=step, loss=loss.item(), world=ctx.world_size, t=time.time())
        time.sleep(pause)
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


def states(job):
    return [h[2] for h in job.history]


def steps_of(job, rank=0):
    m = job.metrics
    return sorted(m[m["rank"] == rank]["step"])


def test_retire_workers_saves_and_resumes_on_the_worker_left(tmp_path):
    with local_client(2) as c:
        job = run(c, train_steps, 60, checkpoint_dir=str(tmp_path), workers=(1, 2))
        wait_until(lambda: len(job.metrics) >= 20, 120, what="20 reports")
        victim = job.plan.addresses[1]
        c.retire_workers([victim])
        values = job.result(timeout=180)
        assert states(job) == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
        cause = job.history[1][3]
        print("history:", cause)
        assert cause.startswith("preempted:") and "0 steps lost" in cause and victim in cause
        assert len(values) == 1 and victim not in job.plan.addresses
        assert steps_of(job, 0) == list(range(60)), "steps were lost or repeated"
        assert leftover_processes(c) == []
