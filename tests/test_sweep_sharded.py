"""A pruned FSDP2 trial saves a sharded checkpoint at its agreed step; resumed on another number of ranks.

Real parts: a LocalCluster of 3 worker processes, gloo, FSDP2's ``fully_shard`` on CPU, torch DCP through
``save_sharded``/``load_sharded`` on local disk (resharded 2 -> 3 ranks), Optuna's ThresholdPruner.
"""

from __future__ import annotations

import os
import time

import optuna
import pytest
import torch._dynamo  # noqa: F401 - imported once here: the forked ranks' fully_shard needs it
from _cluster import leftover_processes, local_client

import dask_ddp

optuna.logging.set_verbosity(optuna.logging.WARNING)


def fsdp_trial(lr, steps, folder, resume_from=None, step_time=0.05):
    """An FSDP2 model trained on fixed data; saves sharded where its ranks agree to stop, and resumes."""
    import torch
    from torch.distributed.fsdp import fully_shard

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "opt": opt, "step": -1}
    if resume_from:
        assert dask_ddp.load_sharded(state, directory=resume_from) is not None
    weight = model[0].weight.full_tensor()  # collective: every rank
    with open(os.path.join(folder, f"{ctx.run_id}.{ctx.rank}.first"), "w") as f:
        f.write(f"{state['step'] + 1} {ctx.world_size} {float(weight.sum()):.6f}")
    dask_ddp.on_preemption(lambda: state, sharded=True)
    x, y = torch.linspace(-1, 1, 64 * 16).reshape(64, 16), torch.linspace(0, 1, 64).reshape(64, 1)
    for step in range(state["step"] + 1, state["step"] + 1 + steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["step"] = step
        w = model[0].weight.full_tensor()  # collective: every rank
        if ctx.rank == 0:  # what the model holds after each step (the test compares the resumed weights)
            with open(os.path.join(folder, f"{ctx.run_id}.w{step}"), "w") as f:
                f.write(f"{float(w.sum()):.6f}")
        dask_ddp.report(loss=lr, step=step)
        time.sleep(step_time)


def test_a_pruned_fsdp_trial_resumes_from_its_sharded_checkpoint_on_more_ranks(tmp_path):
    pruner = optuna.pruners.ThresholdPruner(upper=0.5, n_warmup_steps=2)  # lr > 0.5 stops at step 2
    with local_client(3) as client:
        space = {"lr": {"low": 0.8, "high": 1.0}, "steps": 400}
        s = dask_ddp.sweep(client, fsdp_trial, space, n_trials=1, metric="loss", ranks_per_trial=2,
                           scheduler=pruner, sampler="random", seed=0, kwargs={"folder": str(tmp_path)},
                           run_options={"checkpoint_dir": str(tmp_path / "ckpt")}, progress=False)
        try:
            assert s.wait(180) and s.state == "FINISHED", (s.state, s.cause)
            first = s.results().iloc[0]
            assert first["state"] == "PRUNED" and first["stopped_step"] >= 2, first
            saved = dask_ddp.checkpoint.list_sharded(first["checkpoint"])
            assert [c.step for c in saved] == [first["stopped_step"]], saved  # saved at the agreed step
            with pytest.warns(UserWarning, match="out of range"):  # Optuna's: lr off the space, taken all the same
                s.resume(0, ranks=3, params={"lr": 0.2, "steps": 3})  # PBT-style: another lr, more ranks
            assert s.wait(180) and s.state == "FINISHED", (s.state, s.cause)
        finally:
            s.cancel()
        df = s.results()
        second = df.iloc[1]
        assert second["state"] == "COMPLETE" and second["ranks"] == 3 and second["resumed_from"] == 0, df
        firsts = [(tmp_path / f"{second['run_id']}.{r}.first").read_text().split() for r in range(3)]
        assert {(a, b) for a, b, _ in firsts} == {(str(first["stopped_step"] + 1), "3")}, firsts
        held = (tmp_path / f"{first['run_id']}.w{first['stopped_step']}").read_text()
        fresh = (tmp_path / f"{first['run_id']}.0.first").read_text().split()[2]
        assert {w for _, _, w in firsts} == {held} != {fresh}  # the saved step's weights, resharded 2 -> 3
        assert leftover_processes(client) == []
