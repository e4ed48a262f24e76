"""A sweep whose notebook is killed, continued from its SQLite study by a new one (``load_if_exists=True``).

Real parts: a LocalCluster of 2 worker processes, a subprocess client (the first notebook) SIGKILLed mid-sweep,
Optuna's SQLite storage on local disk, whole checkpoints on local disk, gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import optuna
import pytest
from _cluster import leftover_processes, local_client, no_running_ranks, wait_until

import dask_ddp

optuna.logging.set_verbosity(optuna.logging.WARNING)
HERE = os.path.dirname(os.path.abspath(__file__))


def work(lr, folder, resume_from=None, steps=8, step_time=0.25):
    """Saves a checkpoint every step; notes the first step it ran (after a resume: the one after the save)."""
    ctx = dask_ddp.get_context()
    state = dask_ddp.load_checkpoint(resume_from) if resume_from else None
    first = state["step"] + 1 if state else 0
    with open(os.path.join(folder, f"{ctx.run_id}.first"), "w") as f:
        f.write(str(first))
    if first >= steps:  # the interrupted trial had saved its last step: report its value, as a finished trial
        dask_ddp.report(loss=lr + 1.0 / steps, step=steps - 1)
    for step in range(first, steps):
        dask_ddp.report(loss=lr + 1.0 / (step + 1), step=step)
        dask_ddp.save_checkpoint({"step": step}, step)
        time.sleep(step_time * (4 if lr > 0.5 and not resume_from else 1))  # some trials run long: interrupted


def test_a_killed_notebooks_sweep_is_continued_from_its_study(tmp_path):
    db, name = f"sqlite:///{tmp_path}/sweep.db", "continued"
    space = {"lr": [0.1, 0.9, 0.2, 0.8, 0.3, 0.7]}
    common = {"metric": "loss", "scheduler": "none", "sampler": "grid", "storage": db, "name": name,
              "kwargs": {"folder": str(tmp_path)}, "run_options": {"checkpoint_dir": str(tmp_path / "ckpt")},
              "max_concurrent": 2, "progress": False}
    with local_client(2) as client:
        for bad in ({}, {"storage": db}, {"storage": db, "name": name, "detach": True}):  # nothing to continue
            with pytest.raises(ValueError, match="load_if_exists=True continues a study kept in a storage"):
                dask_ddp.sweep(client, work, space, n_trials=1, metric="loss", load_if_exists=True, **bad)
        script = tmp_path / "notebook.py"
        script.write_text(textwrap.dedent(f"""
            import sys, time
            sys.path.insert(0, {HERE!r})
            from dask.distributed import Client
            import dask_ddp
            from test_sweep_continue import work

            if __name__ == "__main__":
                client = Client({client.scheduler.address!r})
                s = dask_ddp.sweep(client, work, {space!r}, n_trials=6, **{common!r})
                while True:  # two trials ended, one running with a checkpoint
                    df = s.results()
                    running = df[df["state"] == "RUNNING"]
                    if (df["state"] == "COMPLETE").sum() >= 2 and (running["steps"] >= 2).any():
                        break
                    time.sleep(0.05)
                print("RUNNING", flush=True)
                time.sleep(3600)
        """))
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "RUNNING"
            proc.kill()
            proc.wait(30)
            wait_until(lambda: no_running_ranks(client), 30, what="the dead notebook's trials stopped")
        finally:
            if proc.poll() is None:
                proc.kill()
        with pytest.raises(optuna.exceptions.DuplicatedStudyError):
            dask_ddp.sweep(client, work, space, n_trials=6, **common)
        s = dask_ddp.sweep(client, work, space, n_trials=6, load_if_exists=True, **common)
        try:
            assert s.wait(180) and s.state == "FINISHED", (s.state, s.cause)
        finally:
            s.cancel()
        df = s.results()
        assert leftover_processes(client) == []
    interrupted = df[df["error"].fillna("").str.startswith("interrupted")]
    kept = df.drop(interrupted.index)
    show = df[["trial", "state", "params_lr", "steps", "last_step", "resumed_from", "run_id"]].to_string()
    print(show)
    assert len(interrupted) >= 1 and (interrupted["state"] == "FAILED").all(), show
    assert len(kept) == 6 and (kept["state"] == "COMPLETE").all(), show  # n_trials counts the kept trials
    assert sorted(kept["params_lr"]) == sorted(space["lr"])  # the grid walked once, interrupted points again
    assert kept["run_id"].notna().all() and (kept["last_step"] == 7).all(), show  # each kept trial ran to its end
    started = interrupted[interrupted["run_id"].notna()]  # the others were in line, not started yet
    assert (started["steps"] >= 2).any(), show  # what the first notebook waited for
    for row in started.itertuples():
        again = kept[kept["resumed_from"] == row.trial]
        assert len(again) == 1 and again["params_lr"].iloc[0] == row.params_lr, show
        first = int((tmp_path / f"{again['run_id'].iloc[0]}.first").read_text())
        # from the interrupted trial's own checkpoint: it saved each step after reporting it
        assert first >= row.steps - 1 and again["steps"].iloc[0] == max(1, 8 - first), (row, first, show)
    study = optuna.load_study(study_name=name, storage=db)
    assert len(study.trials) == len(df) and {t.state.name for t in study.trials} <= {"COMPLETE", "FAIL"}
