"""Lightning, Hugging Face Transformers and Accelerate, unchanged, in dask-ddp jobs: real libraries, tiny models
built from configs, CPU and gloo, 2 worker processes.

With their defaults (no ``cpu=True``, no ``devices``/``num_nodes``) each trains distributed: world size 2 in the
trainer, different samples per rank, identical parameters at the end (dask_ddp.rank.trainers). The callbacks of
dask_ddp.integrations report the trainer's metrics, and a rank killed mid-run resumes from the trainer's own newest
checkpoint to the same final parameters as a run without the fault."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from _cluster import local_client, run, wait_until

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _killed_once(marker: str | None, rank: int, at: bool) -> None:
    """SIGKILL this rank's process once (the first attempt's rank 1 at the point ``at``), as a crash does."""
    if marker and at and rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the rules alone ---------------------------------------------------------------------------------------------
def test_lightnings_devices_and_nodes_for_even_and_uneven_hosts():
    from dask_ddp.rank.trainers import lightning_topology

    assert lightning_topology(4, 2, 2, gpu=False) == (2, 2)  # torchrun's: ranks per host, hosts
    assert lightning_topology(4, 2, 2, gpu=True) == (2, 2)
    assert lightning_topology(8, 1, 8, gpu=True) == (1, 8)  # a GPU per pod
    assert lightning_topology(3, 2, 2, gpu=False) == (3, 1)  # uneven (2 + 1): every CPU device is the CPU
    assert lightning_topology(3, 1, 2, gpu=False) == (3, 1)
    assert lightning_topology(3, 2, 2, gpu=True) is None  # uneven GPU hosts: no pair Lightning accepts


def test_the_environment_leaves_what_the_worker_set_and_drops_the_slurm_task_variables():
    from dask_ddp.rank.trainers import environment

    put, drop = environment(2, 2, 1, False, {"SLURM_NTASKS": "8", "SLURM_JOB_ID": "7", "PL_TRAINER_DEVICES": "1"})
    assert put == {"ACCELERATE_USE_CPU": "true", "PL_TRAINER_NUM_NODES": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1"}
    assert drop == ["SLURM_NTASKS"]
    put, drop = environment(2, 2, 1, True, {})
    assert put == {"PL_TRAINER_DEVICES": "2", "PL_TRAINER_NUM_NODES": "1", "LT_DEVICES": "2", "LT_NUM_NODES": "1"}
    assert drop == []


# ---- Hugging Face Trainer -------------------------------------------------------------------------------------
def hf_train(out: str, callback: bool = False, kill: str | None = None, steps: int = 8, pause: float = 0.0):
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
    seen: list[int] = []

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(tokens)

        def __getitem__(self, i):
            seen.append(i)
            return {"input_ids": tokens[i], "labels": tokens[i]}

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _killed_once(kill, dist.get_rank(), state.global_step == 5)
            time.sleep(pause)

    callbacks = [Crash()]
    if callback:
        from dask_ddp.integrations.transformers import DaskDDPCallback

        callbacks.append(DaskDDPCallback())
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps, logging_steps=2,
                             save_steps=2, save_strategy="steps" if callback else "no", report_to=[], seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks)
    trainer.train()
    return {"world": args.world_size, "seen": sorted(set(seen)), "params": _params(model)}


def test_transformers_trainer_with_its_defaults_trains_distributed(client, tmp_path):
    out = run(client, hf_train, str(tmp_path / "hf")).result(timeout=300)
    assert [o["world"] for o in out] == [2, 2]
    assert not set(out[0]["seen"]) & set(out[1]["seen"]), "both ranks read the same samples"
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_the_transformers_callback_reports_and_resumes_a_killed_rank_from_the_trainers_checkpoint(client,
                                                                                                 tmp_path):
    clean = run(client, hf_train, str(tmp_path / "clean"), True).result(timeout=300)
    job = run(client, hf_train, str(tmp_path / "hf"), True, str(tmp_path / "killed"), max_restarts=1,
              checkpoint_dir=str(tmp_path / "ckpt"))
    out = job.result(timeout=300)
    assert job.attempt.index == 1, job.history
    assert os.path.isdir(tmp_path / "hf" / "checkpoint-4")
    rows = job.metrics
    assert {"loss", "learning_rate"} <= set(rows.columns), rows.columns
    steps = sorted(set(rows[rows["loss"].notna()]["step"]))
    assert steps[:2] == [2, 4] and steps[-1] == 8, steps  # every logging step, the redone ones again
    for a, b in zip(out, clean):
        diff = (a["params"] - b["params"]).abs().max().item()
        print(f"largest difference from the run without the fault: {diff:.2e}")
        assert diff == 0, diff


# ---- Accelerate ------------------------------------------------------------------------------------------------
def accelerate_train():
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.arange(64.).view(16, 4), torch.zeros(16, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    seen = []
    for x, y in loader:
        seen += x[:, 0].tolist()
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        opt.step()
        opt.zero_grad()
    return {"world": accelerator.num_processes, "seen": seen, "params": _params(net)}


def test_accelerate_with_its_defaults_trains_distributed(client):
    out = run(client, accelerate_train).result(timeout=300)
    assert [o["world"] for o in out] == [2, 2]
    assert not set(out[0]["seen"]) & set(out[1]["seen"])
    assert torch.equal(out[0]["params"], out[1]["params"])


# ---- Lightning -------------------------------------------------------------------------------------------------
def lightning_train(callback: bool = False, kill: str | None = None, epochs: int = 1, pause: float = 0.0):
    import lightning as L
    import torch.distributed as dist

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.seen: list[float] = []

        def training_step(self, batch, i):
            x, y = batch
            _killed_once(kill, dist.get_rank(), self.current_epoch == 2)
            time.sleep(pause)
            self.seen += x[:, 0].tolist()
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.001)

    torch.manual_seed(0)
    model = Model()
    data = torch.utils.data.TensorDataset(torch.arange(64.).view(16, 4), torch.zeros(16, 1))
    callbacks = []
    if callback:
        from dask_ddp.integrations.lightning import DaskDDPCallback

        callbacks.append(DaskDDPCallback())
    trainer = L.Trainer(max_epochs=epochs, log_every_n_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(callback))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    return {"world": trainer.world_size, "seen": model.seen, "params": _params(model)}


def test_lightning_with_its_defaults_trains_distributed(client):
    job = run(client, lightning_train)
    out = job.result(timeout=300)
    assert [o["world"] for o in out] == [2, 2]
    assert not set(out[0]["seen"]) & set(out[1]["seen"])
    assert torch.equal(out[0]["params"], out[1]["params"])
    said = [line for line in job.logs if "GPU available" in line]
    assert len(said) == 1, said  # Lightning's own console handler prints it; dask-ddp's does not again


def test_the_lightning_callback_reports_and_resumes_a_killed_rank_from_its_checkpoint(client, tmp_path):
    clean = run(client, lightning_train, True, None, 4, checkpoint_dir=str(tmp_path / "clean")).result(timeout=300)
    job = run(client, lightning_train, True, str(tmp_path / "killed"), 4, max_restarts=1,
              checkpoint_dir=str(tmp_path / "ckpt"))
    out = job.result(timeout=300)
    assert job.attempt.index == 1, job.history
    folder = tmp_path / "ckpt" / job.run_id / "lightning"
    assert sorted(os.listdir(folder)) == ["step-12.ckpt", "step-16.ckpt"]  # 4 steps an epoch, the newest 2 kept
    rows = job.metrics
    assert "loss" in rows.columns and rows["step"].max() == 16
    assert out[0]["seen"] == [x for x in clean[0]["seen"]][len(clean[0]["seen"]) // 2:]  # epochs 2 and 3 only
    for a, b in zip(out, clean):
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()


def slurm_lightning():
    import os

    return {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "PL_TRAINER_"))} | lightning_train()


def test_lightning_under_a_slurm_allocation_takes_its_ranks_from_dask_ddp():
    """The workers carry a SLURM allocation's task variables (as under dask-jobqueue): Lightning would take its
    ranks from them (SLURMEnvironment comes first); the ranks' environment has none of them."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "4"}
    with local_client(2, env=slurm) as client:
        out = run(client, slurm_lightning).result(timeout=300)
    for o in out:
        assert o["world"] == 2
        assert o["SLURM_JOB_ID"] == "77" and "SLURM_NTASKS" not in o and "SLURM_PROCID" not in o
        assert o["PL_TRAINER_DEVICES"] == "2" and o["PL_TRAINER_NUM_NODES"] == "1"
    assert not set(out[0]["seen"]) & set(out[1]["seen"])


def fabric_train(logged: bool = False):
    from lightning.fabric import Fabric

    from dask_ddp.integrations.lightning import DaskDDPLogger

    fabric = Fabric(loggers=[DaskDDPLogger()] if logged else None)  # no devices=, no num_nodes=, no strategy=
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net, opt = fabric.setup(net, opt)
    data = torch.utils.data.TensorDataset(torch.arange(64.).view(16, 4), torch.zeros(16, 1))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=2))
    seen = []
    for i, (x, y) in enumerate(loader):
        seen += x[:, 0].tolist()
        loss = torch.nn.functional.mse_loss(net(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        fabric.log_dict({"loss": loss, "note": "not a number"}, step=i)
    return {"world": fabric.world_size, "seen": seen, "params": _params(net)}


def test_lightning_fabric_with_its_defaults_trains_distributed(client):
    out = run(client, fabric_train).result(timeout=300)
    assert [o["world"] for o in out] == [2, 2]
    assert not set(out[0]["seen"]) & set(out[1]["seen"])
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_fabrics_logs_reach_job_metrics_through_the_logger(client):
    job = run(client, fabric_train, True)
    job.result(timeout=300)
    rows = job.metrics
    assert sorted(rows[rows["rank"] == 0]["step"]) == list(range(4)), rows  # 8 batches of 2 over 2 ranks
    assert set(rows["rank"]) == {0, 1} and rows["loss"].notna().all() and "note" not in rows.columns


# ---- output ----------------------------------------------------------------------------------------------------
def redraws():
    import sys
    import time

    for i in range(40):
        sys.stderr.write(f"\rbar {i}/40")
        sys.stderr.flush()
        time.sleep(0.1)
    sys.stderr.write("\n")
    import logging

    logging.getLogger("mine").warning("first line\nsecond line")


def test_a_progress_bar_is_seen_while_it_moves_and_a_multi_line_record_is_prefixed_on_every_line(client):
    job = run(client, redraws, workers=1)
    started = time.monotonic()
    wait_until(lambda: any("bar " in line for line in job.logs), 60, what="a redraw before the end")
    assert job.state == "RUNNING" or time.monotonic() - started < 4
    job.result(timeout=120)
    bars = [line for line in job.logs if "bar " in line]
    assert 3 <= len(bars) <= 15, bars  # 40 redraws in 4 s, at most two a second relayed
    record = [line for line in job.logs if "first line" in line]
    assert record == ["[rank 0] WARNING mine: first line\n[rank 0] second line"], record


def test_a_trainer_left_undistributed_by_the_workers_environment_is_warned_of_on_rank_0():
    """ACCELERATE_USE_CPU=false in the workers' environment (dask-ddp leaves a variable the worker sets): Accelerate
    runs each rank alone, and rank 0 says so, with what to change."""
    with local_client(2, env={"ACCELERATE_USE_CPU": "false"}) as client:
        def alone():
            import time

            out = accelerate_train()
            time.sleep(1.5)  # the watch looks once a second
            return out

        job = run(client, alone)
        out = job.result(timeout=300)
    assert [o["world"] for o in out] == [1, 1]
    warned = [line for line in job.logs if "each rank trains alone" in line]
    assert len(warned) == 1 and warned[0].startswith("[rank 0]"), job.logs


@pytest.mark.parametrize("library", ["lightning", "transformers"])
def test_a_retired_worker_makes_the_trainer_save_at_the_agreed_step_and_no_step_is_lost(tmp_path, library):
    """retire_workers on rank 1's worker mid-run (3 workers, 2 ranks): every rank stops at one agreed step, the
    trainer saves its own checkpoint there, the job restarts on the 2 workers left and resumes from it; the final
    parameters are those of a run without the notice."""
    with local_client(3) as client:
        if library == "lightning":
            fn, args = lightning_train, (True, None, 4)
        else:
            fn, args = hf_train, (str(tmp_path / "hf"), True, None, 16)
        clean = run(client, fn, *args, workers=2, checkpoint_dir=str(tmp_path / "clean")).result(timeout=300)
        job = run(client, fn, *args, 0.25, workers=2, checkpoint_dir=str(tmp_path / "ckpt"))
        wait_until(lambda: len(job.metrics) >= 6, 180, what="6 reports")
        victim = job.plan.addresses[1]
        client.retire_workers([victim])
        out = job.result(timeout=300)
    states = [h[2] for h in job.history]
    print(job.history)
    assert "RESTARTING" in states and states[-1] == "FINISHED", job.history
    cause = next(h[3] for h in job.history if h[2] == "RESTARTING")
    assert cause.startswith("preempted:") and "0 steps lost" in cause, cause
    assert victim not in job.plan.addresses
    saved = int(cause.split("saved step ")[1].split()[0])
    assert 0 < saved < 16, cause
    steps = job.metrics[job.metrics["rank"] == 0]["step"].tolist()
    every = 1 if library == "lightning" else 2  # the logging steps: each reported once, none redone or skipped
    assert steps == list(range(every, 17, every)), steps
    for a, b in zip(out, clean):  # the data position too (Lightning's plain DataLoader through the callback's
        assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()  # SkipOnce)
    if library == "lightning":  # the samples of the resumed attempt: the rest of the clean run's, in order
        assert out[0]["seen"] == clean[0]["seen"][len(clean[0]["seen"]) - len(out[0]["seen"]):], out[0]["seen"]


def imported_before():
    import sys
    import time

    before = "transformers" in sys.modules
    started = time.perf_counter()
    import transformers  # noqa: F401

    return {"before": before, "import_s": time.perf_counter() - started}


def test_the_warm_process_preloads_the_listed_modules_and_the_history_says_so():
    """ddp.zygote-preload: the warm process imports transformers before any job (a job's import then costs
    nothing); a module that does not import is named in the history, and the rest still preload."""
    import dask

    with dask.config.set({"ddp.zygote-preload": ["transformers", "no_such_module_for_dask_ddp"]}), \
            local_client(2) as client:
        job = run(client, imported_before)
        out = job.result(timeout=300)
    assert [o["before"] for o in out] == [True, True], out
    print("import transformers in the job:", [round(o["import_s"], 4) for o in out])
    notes = [h[3] for h in job.history if "ddp.zygote-preload" in h[3]]
    assert len(notes) == 1, job.history
    assert "had imported transformers" in notes[0] and "no_such_module_for_dask_ddp (ModuleNotFoundError" in notes[0]


def test_without_preload_a_job_imports_transformers_itself(client):
    out = run(client, imported_before).result(timeout=300)
    assert [o["before"] for o in out] == [False, False]


@pytest.mark.slow
@pytest.mark.parametrize("library", ["transformers", "lightning", "accelerate"])
def test_an_unchanged_script_prints_the_same_result_line_under_dask_ddp_run_as_under_torchrun(client, library):
    """examples/trainers/<library>_tiny.py under ``dask-ddp run`` (the module's 2 workers, through --scheduler) and
    under torchrun (2 processes), given there the variables a dask-ddp rank gets (without them torchrun trains each
    rank alone on CPUs)."""
    import subprocess
    import sys

    from test_cli import ROOT, run_cli

    script = ROOT / "examples" / "trainers" / f"{library}_tiny.py"
    ours = run_cli("run", "--scheduler", client.scheduler.address, script, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    env = dict(os.environ, ACCELERATE_USE_CPU="true", PL_TRAINER_DEVICES="2", PL_TRAINER_NUM_NODES="1")
    theirs = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", str(script)], capture_output=True,
                            text=True, timeout=300, env=env, cwd=ROOT)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    line = [ln for ln in theirs.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(line) == 1 and "world=2" in line[0], theirs.stdout
    assert f"[rank 0] {line[0]}" in ours.stdout.splitlines(), (line, ours.stdout)


def lightning_trial(lr: float):
    """A sweep trial: the Lightning loop with the callback (its loss, reported every step, is what Optuna reads)."""
    return lightning_train(True, None, 50, 0.02)["world"]


def test_a_pruned_sweep_trial_of_a_lightning_trainer_stops_on_all_its_ranks(client):
    """The callback reports the trainer's loss at every logging step on every rank; the pruner stops the trial at
    step 2 (its loss is far above 0.5), and both ranks stop at one agreed step, long before its 200 steps."""
    optuna = pytest.importorskip("optuna")
    import dask_ddp

    s = dask_ddp.sweep(client, lightning_trial, {"lr": {"low": 0.1, "high": 0.2}}, n_trials=1, metric="loss",
                       ranks_per_trial=2, scheduler=optuna.pruners.ThresholdPruner(upper=0.5, n_warmup_steps=2),
                       sampler="random", seed=0, progress=False)
    try:
        assert s.wait(180) and s.state == "FINISHED", (s.state, s.cause)
    finally:
        s.cancel()
    row = s.results().iloc[0]
    assert row["state"] == "PRUNED" and row["pruned_at"] == 2, row
    assert 2 <= row["stopped_step"] < 200, row


def accelerate_settings():
    from accelerate import Accelerator

    accelerator = Accelerator()
    return {"world": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
            "dynamo": os.environ.get("ACCELERATE_DYNAMO_BACKEND")}


def test_an_accelerate_config_file_is_applied_to_every_rank_as_accelerate_launch_would(client, tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: bf16\n"
                      "num_processes: 2\nuse_cpu: true\n")
    out = run(client, accelerate_settings, accelerate_config=str(config)).result(timeout=300)
    assert out == [{"world": 2, "mixed_precision": "bf16", "dynamo": "NO"}] * 2, out
    plain = run(client, accelerate_settings).result(timeout=300)
    assert [o["mixed_precision"] for o in plain] == ["no", "no"]  # the variables were the job's, not the workers'


def accelerate_kind():
    import time

    from accelerate import Accelerator

    accelerator = Accelerator()
    wrapped = accelerator.prepare(torch.nn.Linear(4, 2))
    time.sleep(1.5)  # the watch looks once a second
    return {"kind": str(accelerator.distributed_type), "wrapper": type(wrapped).__name__}


def test_an_fsdp_accelerate_config_on_cpu_workers_is_warned_of_not_dropped_silently(client, tmp_path):
    """Accelerate takes FSDP on GPUs only: on CPU workers it wraps the model in DDP without a word (found trying
    to route its FSDP2 checkpoints). The job's rank 0 says so, once."""
    config = tmp_path / "fsdp.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_processes: 2\n"
                      "fsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: SHARDED_STATE_DICT\n")
    job = run(client, accelerate_kind, accelerate_config=str(config))
    out = job.result(timeout=300)
    assert out == [{"kind": "DistributedType.MULTI_CPU", "wrapper": "DistributedDataParallel"}] * 2, out
    warned = [line for line in job.logs if "was asked for FSDP" in line]
    assert len(warned) == 1 and warned[0].startswith("[rank 0]"), job.logs
    plain = run(client, accelerate_kind)
    plain.result(timeout=300)
    assert not [line for line in plain.logs if "was asked for FSDP" in line], plain.logs


def test_a_bad_accelerate_config_is_refused_before_the_job_starts(client, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        run(client, accelerate_settings, accelerate_config=str(tmp_path / "missing.yaml"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nno_such_key: 3\n")
    with pytest.raises(ValueError, match="no_such_key"):
        run(client, accelerate_settings, accelerate_config=str(unknown))
    deepspeed = tmp_path / "deepspeed.yaml"
    deepspeed.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 2\n"
                         "deepspeed_config:\n  zero_stage: 2\n")
    with pytest.raises(ValueError, match="DeepSpeed"):
        run(client, accelerate_settings, accelerate_config=str(deepspeed))
