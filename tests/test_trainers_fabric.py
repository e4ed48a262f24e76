"""Lightning Fabric's checkpoints through ``dask_ddp.integrations.fabric.DaskDDPCheckpoints``: real Fabric
(``accelerator="cpu"``, ``strategy="ddp"``, gloo) on a real LocalCluster of 2 worker processes.

A rank killed mid-run resumes from the newest checkpoint to the same final parameters, bit for bit, as a run
without the fault; ``keep`` leaves that many checkpoints; a retired worker makes every rank save at the agreed step
and the job resumes there with no step lost; bad settings fail with the rank named. The loop's batches come from
the step and the rank alone, and the optimizer has momentum: a resume that skipped the load, or loaded the weights
without the optimizer, ends with other parameters."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _cluster import leftover_processes, rank_process_pids, run, wait_until

pytest.importorskip("lightning")

STEPS = 12


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fabric_train(every: int, keep: int, kill: str | None = None, progress: str | None = None, pause: float = 0.0,
                 logged: bool = False):
    """STEPS steps of a Fabric loop with the helper, and a last save; rank 1 of the first attempt SIGKILLs itself
    in step 8 when ``kill`` names a marker file that does not exist yet; rank 0 writes the steps done to
    ``progress``."""
    from lightning.fabric import Fabric

    from dask_ddp.integrations.fabric import DaskDDPCheckpoints
    from dask_ddp.integrations.lightning import DaskDDPLogger

    fabric = Fabric(accelerator="cpu", strategy="ddp", loggers=[DaskDDPLogger()] if logged else None)
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    net, opt = fabric.setup(net, opt)
    ckpt = DaskDDPCheckpoints(fabric, every=every, keep=keep)
    state = {"model": net, "optimizer": opt, "step": 0}
    start = ckpt.resume(state)
    assert state["step"] == start, (state["step"], start)
    ran = []
    for step in range(start, STEPS):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 * step + fabric.global_rank))
        loss = (net(x) - 1).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        if kill and step == 7 and fabric.global_rank == 1 and not os.path.exists(kill):
            open(kill, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no save, no goodbye
        state["step"] = step + 1
        ran.append(step + 1)
        if logged:
            fabric.log("loss", loss, step=step + 1)  # a report(): the preemption point before the helper's
        if progress and fabric.global_rank == 0:
            with open(progress, "w") as f:
                f.write(str(step + 1))
        time.sleep(pause)
        ckpt.step(step + 1, state)
    ckpt.save(STEPS, state)  # the loop's own last save (over step()'s, where that saved this step too)
    return {"start": start, "ran": ran, "params": _params(net)}


@pytest.fixture(scope="module")
def clean(client, tmp_path_factory):
    """The run without a fault: a checkpoint every step, the newest 3 kept; its results and its folder."""
    folder = tmp_path_factory.mktemp("clean")
    job = run(client, fabric_train, 1, 3, checkpoint_dir=str(folder))
    return job.result(timeout=300), folder / job.run_id / "fabric"


def test_keep_leaves_the_newest_checkpoints_and_no_temporary_file(clean):
    out, folder = clean
    assert sorted(os.listdir(folder)) == ["step-10.ckpt", "step-11.ckpt", "step-12.ckpt"]
    assert [o["start"] for o in out] == [0, 0] and out[0]["ran"] == list(range(1, STEPS + 1))
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_a_killed_rank_resumes_from_the_newest_checkpoint_to_the_same_parameters(client, clean, tmp_path):
    job = run(client, fabric_train, 2, 2, str(tmp_path / "killed"), max_restarts=1,
              checkpoint_dir=str(tmp_path / "ckpt"))
    out = job.result(timeout=300)
    assert job.attempt.index == 1, job.history
    assert [o["start"] for o in out] == [6, 6], out  # step 8's crash: step-6 was the newest
    assert out[0]["ran"] == list(range(7, STEPS + 1))
    assert sorted(os.listdir(tmp_path / "ckpt" / job.run_id / "fabric")) == ["step-10.ckpt", "step-12.ckpt"]
    for a, b in zip(out, clean[0]):
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()
    assert leftover_processes(client) == []


def bad_settings():
    from lightning.fabric import Fabric

    from dask_ddp.integrations.fabric import DaskDDPCheckpoints

    fabric = Fabric(accelerator="cpu", strategy="ddp")
    fabric.launch()
    errors = []
    for fabric_, kwargs in [(fabric, {"every": 0}), (fabric, {"keep": 0}), (fabric, {"every": 2.0}),
                            (fabric, {"keep": True}), (object(), {})]:
        try:
            DaskDDPCheckpoints(fabric_, **kwargs)
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    ckpt = DaskDDPCheckpoints(fabric, every=1)
    try:
        ckpt.step(-1, {})
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    net = fabric.setup(torch.nn.Linear(2, 1))
    state = {"model": net, "step": 0}
    return {"rank": fabric.global_rank, "errors": errors, "start": ckpt.resume(state),
            "saved": [ckpt.step(1, state), ckpt.step(2, state)]}


def test_bad_settings_fail_naming_the_rank_and_a_job_without_a_folder_saves_nothing(client):
    job = run(client, bad_settings)
    out = job.result(timeout=300)
    for o in out:
        who = f"DaskDDPCheckpoints on rank {o['rank']}: "
        assert o["errors"] == [f"ValueError: {who}every must be >= 1, got 0",
                               f"ValueError: {who}keep must be >= 1, got 0",
                               f"TypeError: {who}every must be an int, got float",
                               f"TypeError: {who}keep must be an int, got bool",
                               f"TypeError: {who}fabric must be a lightning.Fabric, got object (without save, load, "
                               "broadcast, barrier)",
                               f"ValueError: {who}step must be >= 0, got -1"], o["errors"]
        assert o["start"] == 0 and o["saved"] == [False, False], o
    warned = [line for line in job.logs if "saves no checkpoints" in line]
    assert len(warned) == 1 and warned[0].startswith("[rank 0]"), job.logs


def _past_step_3(progress) -> bool:
    return progress.exists() and progress.read_text() not in ("", "1", "2")


def test_a_sigterm_to_a_rank_makes_the_helper_alone_save_at_the_agreed_step(client, clean, tmp_path):
    """SIGTERM to rank 1's process (a pod's signal), a loop without a logger: the helper's ``step`` is the
    protocol's only point, agrees on the step, saves there; the job resumes from it on the same workers."""
    progress = tmp_path / "progress"
    job = run(client, fabric_train, 100, 2, None, str(progress), 0.3, checkpoint_dir=str(tmp_path / "ckpt"))
    wait_until(lambda: _past_step_3(progress), 180, what="3 steps")
    [pid] = rank_process_pids(client)[job.plan.addresses[1]]["running"]
    os.kill(pid, signal.SIGTERM)
    out = job.result(timeout=300)
    cause = next((h[3] for h in job.history if h[2] == "RESTARTING"), job.history)
    assert "received SIGTERM" in cause and "saved step" in cause, cause
    saved = int(cause.split("saved step ")[1].split()[0])
    assert 3 <= saved < STEPS, cause
    assert [o["start"] for o in out] == [saved, saved] and out[0]["ran"] == list(range(saved + 1, STEPS + 1)), out
    assert set(os.listdir(tmp_path / "ckpt" / job.run_id / "fabric")) == {f"step-{saved}.ckpt", "step-12.ckpt"}
    for a, b in zip(out, clean[0]):
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()


def test_a_retired_worker_makes_every_rank_save_at_the_agreed_step_and_no_step_is_lost(client, clean, tmp_path):
    """retire_workers on rank 1's worker mid-run (a third worker added for the restart): the ranks agree on a
    step, the helper saves there and raises Preempted, and the job resumes from that save on the 2 workers left.
    The loop also logs each step through DaskDDPLogger, a report() of the same step before the helper's: the
    protocol's point may be that report, and the save is still the helper's."""
    client.cluster.scale(3)
    client.wait_for_workers(3, timeout=120)
    progress = tmp_path / "progress"
    job = run(client, fabric_train, 100, 2, None, str(progress), 0.3, True, workers=2,
              checkpoint_dir=str(tmp_path / "ckpt"))
    wait_until(lambda: _past_step_3(progress), 180, what="3 steps")
    victim = job.plan.addresses[1]
    client.retire_workers([victim])
    out = job.result(timeout=300)
    print(job.history)
    states = [h[2] for h in job.history]
    assert "RESTARTING" in states and states[-1] == "FINISHED", job.history
    cause = next(h[3] for h in job.history if h[2] == "RESTARTING")
    assert cause.startswith("preempted:") and "0 steps lost" in cause, cause
    assert victim not in job.plan.addresses
    saved = int(cause.split("saved step ")[1].split()[0])
    assert 3 <= saved < STEPS, cause
    assert [o["start"] for o in out] == [saved, saved] and out[0]["ran"] == list(range(saved + 1, STEPS + 1)), out
    assert set(os.listdir(tmp_path / "ckpt" / job.run_id / "fabric")) == {f"step-{saved}.ckpt", "step-12.ckpt"}
    steps = job.metrics[job.metrics["rank"] == 0]["step"].tolist()
    assert steps == list(range(1, STEPS + 1)), steps  # each step reported once: none redone or skipped
    for a, b in zip(out, clean[0]):
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()
    assert leftover_processes(client) == []
