"""Sweeps (``dask_ddp.sweep``): many DDP trials on one cluster, searched and pruned by Optuna.

Without a cluster: the pure parts (gang placement, the search space) and the decision code replayed on a
recorded metric trace against Optuna's pruners alone. On a real LocalCluster of 4 worker processes (one
for the module): trials of 1 and 2 ranks with real gloo all-reduces, ASHA pruning, failures, the failure
limit, cancel, and bad input; every test checks that no rank process is left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict

import optuna
import pandas as pd
import psutil
import pytest
from _cluster import leftover_processes, local_client, no_running_ranks, wait_until

import dask_ddp
from dask_ddp.sweeps import search
from dask_ddp.sweeps.driver import Driver, SweepSpec
from dask_ddp.sweeps.placement import pick, place
from dask_ddp.sweeps.trial import TRIAL_ENDED
from dask_ddp.wire.errors import PlanError, SerializationError
from dask_ddp.wire.plan import WorkerInfo

optuna.logging.set_verbosity(optuna.logging.WARNING)
STEPS = 40  # of each trial of the 40-trial test: a stop decided at an early rung reaches its ranks before the end


# ---- what the trials run (in the rank processes) ------------------------------------------------------------
def train(lr, ranks, folder, steps=10, step_time=0.1):
    """A DDP trial: an all-reduce a step (every rank must take part), the loss reported on every rank; each
    rank leaves its pid in ``folder`` so that a test can check that it is gone."""
    import torch
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    assert ctx.world_size == ranks, (ctx.world_size, ranks)
    with open(os.path.join(folder, f"{ctx.run_id}.{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    done = -1
    try:
        for step in range(steps):
            t = torch.tensor([(lr - 0.3) ** 2 + 1.0 / (step + 1)])
            dist.all_reduce(t)
            dask_ddp.report(loss=t.item() / ctx.world_size, step=step)
            done = step  # the last step whose report returned
            time.sleep(step_time)
    finally:  # a pruned trial's ranks stop in a report: each says at which step
        with open(os.path.join(folder, f"{ctx.run_id}.{ctx.rank}.last"), "w") as f:
            f.write(str(done))
    return ctx.rank


def resumable(lr, folder, resume_from=None, steps=30, step_time=0.05):
    """A trial that saves its state where its ranks agree to stop (on_preemption) and continues from a
    checkpoint folder when the sweep gives one; each rank notes the first step it ran."""
    import torch
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    state = dask_ddp.load_checkpoint(resume_from) if resume_from else None
    state = state or {"w": 0.0, "step": -1}
    with open(os.path.join(folder, f"{ctx.run_id}.{ctx.rank}.first"), "w") as f:
        f.write(f"{state['step'] + 1} {ctx.world_size}")
    dask_ddp.on_preemption(lambda: dict(state))
    for step in range(state["step"] + 1, state["step"] + 1 + steps):
        t = torch.tensor([lr])
        dist.all_reduce(t)
        state["w"], state["step"] = state["w"] + t.item(), step
        dask_ddp.report(loss=lr, step=step)
        time.sleep(step_time)


def raises_above(lr, limit=0.5):
    dask_ddp.report(loss=lr, step=0)
    if lr > limit:
        raise ValueError(f"lr {lr} is too large for this model")
    return lr


def reports_other_keys(lr):
    dask_ddp.report(acc=1 - lr, epoch=0)


def hangs(lr):
    dask_ddp.report(loss=lr, step=0)
    time.sleep(3600)


def slow(lr, folder):
    ctx = dask_ddp.get_context()
    with open(os.path.join(folder, f"{ctx.run_id}.{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    for step in range(40):
        dask_ddp.report(loss=lr, step=step)
        time.sleep(0.1)


def forever(lr):
    step = 0
    while True:
        dask_ddp.report(loss=lr, step=step)
        step += 1
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client4():
    with local_client(4) as c:
        dask_ddp.dispatch.warm_up(c)
        yield c


def _clean(client) -> None:
    assert no_running_ranks(client)
    assert leftover_processes(client) == []


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _intervals_overlap_per_worker(df: pd.DataFrame) -> list[str]:
    """Workers that two trials held at once (a trial holds its workers from its start to its end)."""
    held = defaultdict(list)
    for row in df.dropna(subset=["started"]).itertuples():
        for w in row.workers.split(","):
            held[w].append((row.started, row.ended, row.trial))
    bad = []
    for w, spans in held.items():
        spans.sort()
        bad += [f"{w}: trials {a[2]} and {b[2]}" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return bad


def _most_busy(df: pd.DataFrame) -> int:
    """The most workers busy with the sweep's trials at one moment."""
    edges = []
    for row in df.dropna(subset=["started"]).itertuples():
        edges += [(row.started, row.ranks), (row.ended, -row.ranks)]
    busy = top = 0
    for _, d in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a start at the same instant
        busy += d
        top = max(top, busy)
    return top


# ---- on the cluster -----------------------------------------------------------------------------------------
def test_forty_trials_of_one_and_two_ranks_with_asha(client4, tmp_path):
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2)
    s = dask_ddp.sweep(client4, train, {"lr": {"low": 0.0, "high": 1.0}, "ranks": [1, 2]}, n_trials=40,
                       metric="loss", ranks_per_trial="ranks", scheduler=pruner, seed=1,
                       kwargs={"folder": str(tmp_path), "steps": STEPS, "step_time": 0.05})
    try:
        assert s.wait(400), f"the sweep did not end: {s!r}"
    finally:
        s.cancel()
    df = s.results()
    assert s.state == "FINISHED", (s.state, s.cause)
    assert len(df) == 40 and set(df["state"]) <= set(TRIAL_ENDED), df[["trial", "state", "error"]]
    counts = df["state"].value_counts().to_dict()
    # asynchronous successive halving promotes the first trial to reach a rung (so one trial at least
    # completes) and then only the top half at each rung: how many complete depends on the order trials end
    assert counts.get("PRUNED", 0) >= 3 and counts.get("COMPLETE", 0) >= 1, counts
    assert set(df["ranks"]) == {1, 2}
    assert (df["workers"].str.split(",").map(len) == df["ranks"]).all()
    assert {"params_lr", "params_ranks", "value", "last", "best", "steps", "started", "ended", "duration",
            "run_id"} <= set(df.columns)
    assert df[["started", "ended", "run_id", "last", "best", "value"]].notna().all().all(), df
    # a pruned trial counts its reports up to the decision's step, a complete one all of them
    pruned, done = df[df["state"] == "PRUNED"], df[df["state"] == "COMPLETE"]
    assert (pruned["last_step"] == pruned["pruned_at"]).all() and (pruned["pruned_at"] < STEPS - 1).all(), pruned
    assert (done["steps"] == STEPS).all() and (done["value"] == done["last"]).all(), done
    # Optuna was told the same ends
    told = {t.number: t.state.name for t in s.study.trials}
    assert told == dict(zip(df["trial"], df["state"])), told
    # every rank of every pruned trial ran, stopped at one step (the agreed one, at or after the decision's;
    # or, when the stop reached it after its last step, all ran to the end), and its process is gone
    stopped = pruned["stopped_step"].notna()
    assert stopped.any(), pruned[["trial", "pruned_at", "stopped_step"]]
    print(f"{stopped.sum()} of {len(pruned)} pruned trials stopped at an agreed step (the others had ended first)")
    for row in pruned.itertuples():
        pids = [int((tmp_path / f"{row.run_id}.{r}").read_text()) for r in range(row.ranks)]
        alive = [p for p in pids if not _gone(p)]
        assert not alive, f"trial {row.trial} pruned at {row.pruned_at}: ranks still alive {alive}"
        last = {int((tmp_path / f"{row.run_id}.{r}.last").read_text()) for r in range(row.ranks)}
        at = STEPS - 1 if pd.isna(row.stopped_step) else row.stopped_step
        assert last == {at} and at >= row.pruned_at, (row, last)
    # gang placement: a worker serves one trial at a time, never more than the cluster at once
    assert _intervals_overlap_per_worker(df) == []
    assert _most_busy(df) <= 4
    assert s.best["value"] == done["value"].min()
    _clean(client4)


def test_a_pruned_trial_saves_at_its_agreed_step_and_resumes_from_it_on_more_ranks(client4, tmp_path):
    """Pause/resume through checkpoints: the pruned trial's ranks save at the step they agreed to stop at; a
    resumed trial (PBT-style: another lr, 2 ranks instead of 1) continues from that step's checkpoint; the
    finished sweep runs again for it. With exploit=True new trials start from the best trial's checkpoint."""
    pruner = optuna.pruners.ThresholdPruner(upper=0.5, n_warmup_steps=2)
    # 400 steps: the stop reaches the ranks long before their end, however loaded the machine
    s = dask_ddp.sweep(client4, resumable, {"lr": {"low": 0.8, "high": 1.0}, "steps": 400}, n_trials=1, metric="loss",
                       scheduler=pruner, sampler="random", seed=0, kwargs={"folder": str(tmp_path)},
                       run_options={"checkpoint_dir": str(tmp_path / "ckpt")}, progress=False)
    try:
        assert s.wait(120) and s.state == "FINISHED", (s.state, s.cause)
        first = s.results().iloc[0]
        assert first["state"] == "PRUNED" and first["pruned_at"] == 2 and first["stopped_step"] >= 2, first
        assert dask_ddp.latest_checkpoint(first["checkpoint"]) is not None, first["checkpoint"]
        with pytest.raises(ValueError, match="unknown_param|not a parameter"):
            s.resume(0, params={"unknown_param": 1})
        s.resume(0, ranks=2, params={"lr": 0.2, "steps": 10})  # lr off the space: Optuna warns, and takes it
        assert s.wait(120) and s.state == "FINISHED", (s.state, s.cause)
    finally:
        s.cancel()
    df = s.results()
    second = df.iloc[1]
    assert len(df) == 2 and second["state"] == "COMPLETE" and second["resumed_from"] == 0, df
    assert second["ranks"] == 2 and second["params_lr"] == 0.2 and second["checkpoint"] != first["checkpoint"]
    starts = {(tmp_path / f"{second['run_id']}.{r}.first").read_text() for r in range(2)}
    assert starts == {f"{first['stopped_step'] + 1} 2"}, starts  # both ranks from the step after the save
    assert min(s.study.trials[1].intermediate_values) == first["stopped_step"] + 1
    # PBT-style exploit: the later trials start from the best ended trial's checkpoint
    e = dask_ddp.sweep(client4, resumable, {"lr": {"low": 0.0, "high": 0.4}}, n_trials=3, metric="loss",
                       scheduler="none", max_concurrent=1, exploit=True, kwargs={"folder": str(tmp_path), "steps": 4},
                       run_options={"checkpoint_dir": str(tmp_path / "ckpt")}, progress=False)
    try:
        assert e.wait(120) and e.state == "FINISHED", (e.state, e.cause)
    finally:
        e.cancel()
    rows = e.results()
    assert rows["resumed_from"].isna().iloc[0] and rows["resumed_from"].notna().iloc[1:].all(), rows
    assert (rows["state"] == "COMPLETE").all() and rows["steps"].eq(4).all(), rows
    _clean(client4)


def test_job_stop_cancels_ranks_that_reach_no_report_within_the_grace(client4):
    """Job.stop's fallback (a pruned trial whose ranks report no more): after ``grace`` s they are killed
    together, the job ends CANCELLED without a stopped step."""
    job = dask_ddp.dispatch.run(client4, hangs, 0.1, progress=False)
    try:
        wait_until(lambda: not job.metrics.empty, 120, what="the job's first report")
        job.stop("a test", grace=1.0)
        assert job.wait(60, progress=False)
    finally:
        job.cancel()
    assert job.state == "CANCELLED" and job.stopped_step is None, job.history
    _clean(client4)


def _metrics_text(client) -> str:
    import urllib.request

    with urllib.request.urlopen(client.dashboard_link.rsplit("/", 1)[0] + "/metrics", timeout=60) as r:
        return r.read().decode()


def _sweep_samples(text: str, name: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dask_ddp_sweep") and sample.labels.get("sweep") == name:
                out[(sample.name, sample.labels.get("state"))] = sample.value
    return out


def test_the_dashboard_prometheus_and_mlflow_show_the_sweep(client4, tmp_path, monkeypatch):
    """Seen: the scheduler's DDP state and page list the sweep's trials by state, /metrics exports them and the
    slot occupancy while it runs; MLflow (a real file store) has one parent run and one child run per trial."""
    mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed: pip install 'dask-ddp[mlflow]'")
    from dask_ddp.dashboard.page import sweeps_html
    from dask_ddp.dashboard.plugin import NAME

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    pruner = optuna.pruners.ThresholdPruner(upper=0.5, n_warmup_steps=1)
    s = dask_ddp.sweep(client4, slow, {"lr": [0.2, 0.9, 0.3, 0.8]}, n_trials=4, metric="loss", sampler="grid",
                       scheduler=pruner, max_concurrent=2, name="seen", kwargs={"folder": str(tmp_path)},
                       mlflow=dask_ddp.MLflowSink(store, experiment="sweeps"), progress=False)
    try:
        got = wait_until(lambda: (m := _sweep_samples(_metrics_text(client4), "seen")).get(
            ("dask_ddp_sweep_trials", "RUNNING"), 0) >= 1 and m, 120, what="the running sweep on /metrics")
        assert got[("dask_ddp_sweep_workers", None)] == 4 and got[("dask_ddp_sweep_busy_workers", None)] >= 1, got
        assert 0 < got[("dask_ddp_sweep_occupancy_ratio", None)] <= 1, got
        assert s.wait(180) and s.state == "FINISHED", (s.state, s.cause)
    finally:
        s.cancel()
    counts = s.counts()
    assert counts["PRUNED"] == 2 and counts["COMPLETE"] == 2, counts

    def seen():
        return client4.run_on_scheduler(lambda dask_scheduler: dict(
            dask_scheduler.plugins[NAME].state.sweeps.get("seen") or {}))
    view = wait_until(lambda: seen().get("state") == "FINISHED" and seen(), 30, what="the sweep's end on the page")
    assert view["trials"]["PRUNED"] == 2 and view["trials"]["COMPLETE"] == 2 and view["n_trials"] == 4, view
    assert 0 < view["occupancy"] <= 1, view
    page = sweeps_html([view])
    assert "<td>seen</td><td>FINISHED</td>" in page and "<td>2</td>" in page, page
    assert ("dask_ddp_sweep_trials", "PRUNED") not in _sweep_samples(_metrics_text(client4), "seen")  # ended

    reader = mlflow.MlflowClient(tracking_uri=store)
    runs = reader.search_runs([reader.get_experiment_by_name("sweeps").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.run_name == "seen" and parents[0].info.status == "FINISHED"
    parent = parents[0]
    children = {int(r.data.tags["dask_ddp.trial"]): r for r in runs if r is not parent}
    assert sorted(children) == [0, 1, 2, 3]
    df = s.results().set_index("trial")
    for number, child in children.items():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["dask_ddp.trial_state"] == df.loc[number, "state"]
        assert float(child.data.params["lr"]) == df.loc[number, "params_lr"]
        assert child.data.tags["dask_ddp.run_id"] == df.loc[number, "run_id"]
        assert reader.get_metric_history(child.info.run_id, "loss/rank0"), number
    best = reader.get_metric_history(parent.info.run_id, "best_value")
    assert min(m.value for m in best) == s.best["value"]
    _clean(client4)


def test_failed_trials_are_recorded_with_their_traceback_and_the_sweep_goes_on(client4, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    s = dask_ddp.sweep(client4, raises_above, {"lr": [0.1, 0.2, 0.7, 0.9]}, n_trials=4, metric="loss",
                       sampler="grid", scheduler="none", max_failures=None, max_workers=2, storage=storage,
                       name="fails")
    try:
        assert s.wait(120)
    finally:
        s.cancel()
    df = s.results().set_index("params_lr")
    assert s.state == "FINISHED", s.cause
    err = capsys.readouterr().err  # wait()'s progress bar over the trials, as it closed
    assert any("fails FINISHED" in ln and "4/4" in ln and "failed=2" in ln for ln in err.splitlines()), err[-2000:]
    assert list(df.loc[[0.7, 0.9], "state"]) == ["FAILED", "FAILED"], df
    assert list(df.loc[[0.1, 0.2], "state"]) == ["COMPLETE", "COMPLETE"], df
    for lr in (0.7, 0.9):
        error = df.loc[lr, "error"]
        assert "ValueError" in error and f"lr {lr} is too large" in error and "raises_above" in error, error
    assert _most_busy(s.results()) <= 2  # max_workers
    # the study is in the SQLite file, with the same ends
    stored = optuna.load_study(study_name="fails", storage=storage)
    assert sorted((t.params["lr"], t.state.name) for t in stored.trials) == [
        (0.1, "COMPLETE"), (0.2, "COMPLETE"), (0.7, "FAIL"), (0.9, "FAIL")]
    assert s.best == {"trial": s.best["trial"], "value": 0.1, "params": {"lr": 0.1}, "run_id": s.best["run_id"]}
    _clean(client4)


def test_the_failure_limit_stops_the_sweep(client4):
    s = dask_ddp.sweep(client4, raises_above, {"lr": {"low": 0.6, "high": 1.0}}, n_trials=30, metric="loss",
                       max_failures=2, kwargs={"limit": 0.5})
    try:
        assert s.wait(120)
    finally:
        s.cancel()
    df = s.results()
    assert s.state == "FAILED" and "2 trials failed (max_failures=2)" in s.cause and "too large" in s.cause
    assert (df["state"] == "FAILED").sum() >= 2 and set(df["state"]) <= {"FAILED", "CANCELLED"}, df
    assert len(df) < 30  # it stopped asking
    _clean(client4)


def test_a_metric_never_reported_fails_the_trial_naming_the_keys_reported(client4):
    s = dask_ddp.sweep(client4, reports_other_keys, {"lr": [0.1]}, n_trials=1, metric="loss")
    try:
        assert s.wait(120)
    finally:
        s.cancel()
    row = s.results().iloc[0]
    assert row["state"] == "FAILED"
    assert "'loss'" in row["error"] and "acc, epoch" in row["error"], row["error"]
    with pytest.raises(ValueError, match="no trial has completed"):
        s.best  # noqa: B018
    _clean(client4)


def test_cancel_stops_every_trial(client4):
    s = dask_ddp.sweep(client4, forever, {"lr": {"low": 0.0, "high": 1.0}}, n_trials=10, metric="loss",
                       scheduler="none", ranks_per_trial=2)
    try:
        wait_until(lambda: (s.results()["steps"] > 0).sum() == 2, 120,
                   what="two trials (all the 4 workers hold) reporting")
    finally:
        assert s.cancel(60)
    df = s.results()
    assert s.state == "CANCELLED" and set(df["state"]) == {"CANCELLED"}, df
    assert "CANCELLED" in repr(s) and "cancelled" in s._repr_html_()
    assert (df["steps"] > 0).sum() == 2  # the two that ran had reported
    _clean(client4)


def test_a_hanging_trial_is_failed_by_the_stall_watch_and_the_sweep_goes_on(client4):
    s = dask_ddp.sweep(client4, hangs, {"lr": [0.1, 0.2]}, n_trials=2, metric="loss", sampler="grid",
                       max_failures=None, run_options={"stall_timeout": 1.0})
    try:
        assert s.wait(120)
    finally:
        s.cancel()
    df = s.results()
    assert s.state == "FINISHED" and list(df["state"]) == ["FAILED", "FAILED"], df
    assert df["error"].str.contains("StallError").all(), df["error"].tolist()
    _clean(client4)


def test_the_client_dying_stops_every_trial(client4, tmp_path):
    """A notebook's kernel killed while its sweep runs: the trials' ranks stop (the rule of every job)."""
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from dask.distributed import Client
        import dask_ddp

        def forever(lr):
            step = 0
            while True:
                dask_ddp.report(loss=lr, step=step)
                step += 1
                time.sleep(0.1)

        if __name__ == "__main__":
            client = Client({client4.scheduler.address!r})
            s = dask_ddp.sweep(client, forever, {{"lr": {{"low": 0.0, "high": 1.0}}}}, n_trials=8, metric="loss",
                               scheduler="none")
            while (s.results()["steps"] > 0).sum() < 4:  # four trials' ranks run and report
                time.sleep(0.1)
            print("RUNNING", flush=True)
            time.sleep(3600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "RUNNING"
        assert not no_running_ranks(client4)
        proc.kill()
        proc.wait(30)
        killed = time.monotonic()
        wait_until(lambda: no_running_ranks(client4), 10, what="every trial's ranks stopped within 10 s")
        print(f"ranks gone {time.monotonic() - killed:.1f} s after the client was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
    _clean(client4)


def test_a_detached_sweep_survives_its_killed_client_and_attach_sweep_sees_and_cancels_it(client4, tmp_path):
    """A kernel restart: the sweep runs with detach=True in a subprocess client that is then SIGKILLed; the
    sweep runs on (trials keep ending and starting), attach_sweep from another client sees every trial it has
    asked, and cancel() stops the rest; every trial ends in a recorded state, no rank left."""
    script = tmp_path / "notebook.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from dask.distributed import Client
        import dask_ddp

        def short(lr, steps):
            for step in range(steps):
                dask_ddp.report(loss=lr + 1 / (step + 1), step=step)
                time.sleep(0.1)

        if __name__ == "__main__":
            client = Client({client4.scheduler.address!r})
            s = dask_ddp.sweep(client, short, {{"lr": {{"low": 0.0, "high": 1.0}}, "steps": 10}}, n_trials=400,
                               metric="loss", scheduler="none", name="survivor", detach=True, progress=False)
            while (s.results()["steps"] > 0).sum() < 4:  # four trials' ranks run and report
                time.sleep(0.1)
            print("RUNNING", flush=True)
            time.sleep(3600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    s = None
    try:
        assert proc.stdout.readline().strip() == "RUNNING"
        proc.kill()
        proc.wait(30)
        s = dask_ddp.attach_sweep(client4, "survivor", progress=False)
        assert s.detached and s.state == "RUNNING", (s.state, s.cause)
        before = s.counts()["COMPLETE"]
        wait_until(lambda: s.counts()["COMPLETE"] >= before + 4, 120, what="trials ending after the client died")
        assert not no_running_ranks(client4)
        assert s.cancel(120), s
    finally:
        if proc.poll() is None:
            proc.kill()
        if s is None:  # the detached sweep runs on the scheduler whatever failed above: find it to stop it
            with contextlib.suppress(Exception):
                s = dask_ddp.attach_sweep(client4, "survivor", progress=False)
        if s is not None:
            s.cancel(120)
    df = s.results()
    assert s.state == "CANCELLED" and "cancel" in s.cause, (s.state, s.cause)
    assert list(df["trial"]) == list(range(len(df))) and len(df) >= 8, df  # every trial asked, by number
    assert set(df["state"]) <= set(TRIAL_ENDED) and (df["state"] == "CANCELLED").any(), df["state"].value_counts()
    assert (df.loc[df["state"] == "COMPLETE", "steps"] == 10).all()
    assert no_running_ranks(client4)
    with pytest.raises(dask_ddp.SweepNotFound, match="no detached sweep named 'nobody'"):
        dask_ddp.attach_sweep(client4, "nobody")
    _clean(client4)


def test_a_worker_killed_mid_trial_fails_that_trial_and_the_sweep_goes_on(client4, tmp_path):
    """Last of the cluster tests: the killed worker's nanny starts a new one (a new address)."""
    s = dask_ddp.sweep(client4, slow, {"lr": [0.1, 0.2, 0.3, 0.4, 0.5]}, n_trials=5, metric="loss", sampler="grid",
                       scheduler="none", max_failures=None, max_concurrent=2, kwargs={"folder": str(tmp_path)})
    try:
        wait_until(lambda: len(s.results().query("state == 'RUNNING' and steps > 0")) == 2, 120,
                   what="two trials reporting")
        victim = s.results().query("state == 'RUNNING'").iloc[0]
        client4.run(os._exit, 1, workers=[victim["workers"]], on_error="ignore")
        assert s.wait(180)
    finally:
        s.cancel()
    df = s.results().set_index("trial")
    assert s.state == "FINISHED", s.cause
    assert df.loc[victim["trial"], "state"] == "FAILED", df
    assert "WorkerLostError" in df.loc[victim["trial"], "error"], df.loc[victim["trial"], "error"]
    assert (df.drop(index=victim["trial"])["state"] == "COMPLETE").all(), df
    pid = int((tmp_path / f"{df.loc[victim['trial'], 'run_id']}.0").read_text())
    wait_until(lambda: _gone(pid), 30, what=f"the killed worker's rank process {pid} gone")
    wait_until(lambda: len(client4.scheduler_info(n_workers=-1)["workers"]) == 4, 60, what="the worker's return")
    _clean(client4)


def test_a_bug_in_the_driver_cancels_the_running_trials_and_ends_the_sweep(client4, monkeypatch):
    """The driver's own failure (made here by a broken metric handler) must not leave trials running."""
    def broken(self, number, item):
        raise RuntimeError("a bug in the driver")

    monkeypatch.setattr(Driver, "_metric", broken)
    s = dask_ddp.sweep(client4, forever, {"lr": [0.1, 0.2]}, n_trials=2, metric="loss", sampler="grid")
    try:
        assert s.wait(120)
    finally:
        s.cancel()
    assert s.state == "FAILED" and "a bug in the driver" in s.cause and "cancelled" in s.cause, s.cause
    df = s.results()
    assert set(df["state"]) <= {"CANCELLED", "QUEUED"} and (df["state"] == "CANCELLED").any(), df
    assert {t.state.name for t in s.study.trials if t.number in set(df.query("state == 'CANCELLED'")["trial"])} \
        == {"FAIL"}
    _clean(client4)


def test_a_client_closing_under_the_drivers_call_cancels_the_sweep_not_fails_it(client4, monkeypatch):
    """Seen: the client closed between the driver's look at it and its next call to the scheduler, which raised
    (``AttributeError: 'NoneType' object has no attribute 'identity'``), and the sweep ended FAILED as if the
    driver had a bug. A closed client cancels its sweep, whenever it closes."""
    from dask.distributed import Client

    from dask_ddp.sweeps import driver as sweep_driver

    other = Client(client4.scheduler.address, set_as_default=False)
    real, started, closed = sweep_driver.scheduler_workers, [], []

    def closes_first(client):  # the driver's look at the cluster, every second while nothing ends
        if started and not closed and (started[0].results()["steps"] > 0).sum() == 4:  # every worker's trial
            closed.append(other.close())  # reports (a trial still being launched would show its rank after the end)
        return real(client)

    monkeypatch.setattr(sweep_driver, "scheduler_workers", closes_first)
    s = dask_ddp.sweep(other, forever, {"lr": {"low": 0.0, "high": 1.0}}, n_trials=8, metric="loss",
                       scheduler="none", progress=False)
    started.append(s)
    try:
        assert s.wait(120)
    finally:
        other.close()
    assert closed and s.state == "CANCELLED", (s.state, s.cause)
    assert s.cause == sweep_driver.CLIENT_CLOSED
    df = s.results()
    assert set(df["state"]) == {"CANCELLED"} and (df["steps"] > 0).sum() == 4, df  # none FAILED by the close
    wait_until(lambda: no_running_ranks(client4), 60, what="the closed client's trials stopped")
    _clean(client4)


def test_client_close_mid_sweep_cancels_it_and_none_of_its_trials_fail(client4):
    """``client.close()`` while a sweep runs: seen, trials whose jobs ended (ClientClosedError) before the driver
    saw the closed client were recorded FAILED, and a sweep stayed RUNNING a minute after. Now every trial is
    CANCELLED and the sweep ends CANCELLED at once."""
    from dask.distributed import Client

    from dask_ddp.sweeps import driver as sweep_driver

    other = Client(client4.scheduler.address, set_as_default=False)
    try:
        s = dask_ddp.sweep(other, forever, {"lr": {"low": 0.0, "high": 1.0}}, n_trials=8, metric="loss",
                           scheduler="none", progress=False)
        wait_until(lambda: (s.results()["steps"] > 0).sum() == 4, 120, what="a trial on every worker reporting")
    finally:
        other.close()
    closed = time.monotonic()
    assert s.wait(60), s
    print(f"client.close() -> the sweep ended: {time.monotonic() - closed:.2f} s")
    df = s.results()
    assert s.state == "CANCELLED" and s.cause == sweep_driver.CLIENT_CLOSED, (s.state, s.cause)
    assert set(df["state"]) == {"CANCELLED"}, df[["trial", "state", "error"]]
    wait_until(lambda: no_running_ranks(client4), 60, what="the closed client's trials stopped")
    _clean(client4)


@pytest.mark.parametrize("kw, error, match", [
    ({"ranks_per_trial": 5}, PlanError, "ranks_per_trial=5, but the sweep may use only 4 workers"),
    ({"ranks_per_trial": 2, "max_workers": 1}, PlanError, "only 1 workers"),
    ({"space": {"lr": {"low": 1.0, "high": 0.1}}}, ValueError, r"space\['lr'\]"),
    ({"space": {"lr": object()}}, TypeError, r"space\['lr'\].*not a distribution"),
    ({"space": {"timeout": [1, 2]}}, ValueError, "'timeout' is also a keyword of dispatch.run"),
    ({"run_options": {"workers": 2}}, ValueError, "set by the sweep"),
    ({"mode": "best"}, ValueError, "mode='best'"),
    ({"scheduler": "pbt"}, ValueError, "scheduler='pbt': unknown"),
    ({"sampler": "grid", "space": {"lr": {"low": 0.0, "high": 1.0}}}, ValueError, "lr is a range"),
    ({"n_trials": 0}, PlanError, "n_trials=0"),
    ({"kwargs": {"lock": threading.Lock()}}, SerializationError, "keyword argument 'lock'"),
    ({"ranks_per_trial": "width"}, ValueError, "names no parameter"),
])
def test_bad_input_is_refused_before_anything_starts(client4, kw, error, match):
    args = {"space": {"lr": [0.1, 0.2]}, "n_trials": 2, "metric": "loss", **kw}
    space = args.pop("space")
    with pytest.raises(error, match=match):
        dask_ddp.sweep(client4, raises_above, space, **args)


def _claims(dask_scheduler=None) -> dict:
    from dask_ddp.sweeps import names as sweep_names

    with sweep_names.LOCK:
        return dict(sweep_names._CLAIMS)


def _refused(match: str, *args, **kwargs) -> None:
    """``dask_ddp.sweep(*args, **kwargs)`` raises a ValueError matching ``match``; a sweep it started anyway (a
    detached one outlives its client) is cancelled before the test fails, so it cannot starve the tests after."""
    try:
        started = dask_ddp.sweep(*args, **kwargs)
    except ValueError as exc:
        assert re.search(match, str(exc)), str(exc)
        return
    started.cancel(60)
    pytest.fail(f"the sweep was not refused: {started!r}")


def test_one_running_sweep_per_name_on_a_cluster(client4):
    """The DDP page, Prometheus and attach_sweep know a sweep by its name: a second sweep of a name that runs is
    refused (from the same client, another one, or detached); the name is free again at the sweep's end, and a
    claim whose client is gone (a dead notebook) is void."""
    from dask.distributed import Client

    space, kw = {"lr": {"low": 0.0, "high": 1.0}}, {"n_trials": 4, "metric": "loss", "scheduler": "none"}
    first = dask_ddp.sweep(client4, forever, space, name="one name", **kw)
    other = Client(client4.scheduler.address, set_as_default=False)
    try:
        for who, detach in ((client4, False), (other, False), (client4, True)):
            _refused("a sweep named 'one name' is running on this cluster", who, forever, space, name="one name",
                     detach=detach, **kw)
        assert first.state == "RUNNING"
        dying = dask_ddp.sweep(other, forever, space, name="its client dies", **kw)
        _refused("'its client dies' is running", client4, forever, space, name="its client dies", **kw)
    finally:
        other.close()
        assert first.cancel(60)
    assert dying.state in ("RUNNING", "CANCELLED")  # its client closed: its trials stop, its claim is void
    for name in ("one name", "its client dies"):
        again = dask_ddp.sweep(client4, raises_above, {"lr": [0.1]}, n_trials=1, metric="loss", name=name)
        # the scheduler holds no claim of a client that is gone (its memory stays bounded), only this one
        assert client4.run_on_scheduler(_claims) == {name: client4.id}
        assert again.wait(60) and again.state == "FINISHED", again.cause
    assert client4.run_on_scheduler(_claims) == {}  # each ended sweep released its name
    wait_until(lambda: no_running_ranks(client4), 60, what="the dead client's trials stopped")
    _clean(client4)


# ---- without a cluster ----------------------------------------------------------------------------------------
def _trace(n_trials: int = 24, steps: int = 12) -> list[list[float]]:
    """A recorded metric trace: each trial's loss at steps 0..steps-1 (a curve per trial, with noise)."""
    import random

    rng = random.Random(7)
    out = []
    for _ in range(n_trials):
        floor, speed = rng.uniform(0.1, 1.0), rng.uniform(0.2, 1.0)
        out.append([floor + 1.0 / (1 + speed * s) + rng.gauss(0, 0.02) for s in range(steps)])
    return out


def _optuna_alone(pruner, trace) -> list[int | None]:
    """Optuna's pruner by itself on the trace: each trial's prune step (None: it ran to its end)."""
    decisions = []

    def objective(trial):
        for step, value in enumerate(trace[trial.number]):
            trial.report(value, step)
            if trial.should_prune():
                decisions.append(step)
                raise optuna.TrialPruned()
        decisions.append(None)
        return trace[trial.number][-1]

    optuna.create_study(study_name="replay", pruner=pruner).optimize(objective, n_trials=len(trace))
    return decisions


class _Ended:
    """What the driver reads of a trial's ended job (replay only: no cluster, no job)."""

    def __init__(self):
        self.state, self.cancelled = "FINISHED", False

    def cancel(self, timeout=None):
        self.cancelled = True

    def stop(self, cause, grace=None):
        self.cancelled = True

    def result(self, timeout=None, progress=None):
        return [None]


def _through_the_sweep(pruner, trace) -> list[int | None]:
    """The same trace through the sweep's driver: rank 0's and rank 1's report items as a 2-rank trial's job
    posts them, each step twice (a duplicate), the job cancelled on the driver's decision."""
    study = optuna.create_study(study_name="replay", pruner=pruner)
    spec = SweepSpec(name="replay", fn=train, args=(), kwargs={}, fixed={}, ranks=lambda p: 2, metric="loss",
                     minimize=True, n_trials=len(trace), max_concurrent=None, max_workers=None, workers=None,
                     max_failures=None, run_options={})
    driver, decisions = Driver(None, spec, study, {}), []
    for values in trace:
        driver.ask()
        number = driver.queue.start(0)
        job = driver._jobs[number] = _Ended()
        for step, value in enumerate(values):
            for item in ({"rank": 1, "step": step, "loss": value + 5}, {"rank": 0, "step": step, "loss": value},
                         {"rank": 0, "step": step, "loss": value + 9}):
                driver._metric(number, item)
            if job.cancelled:
                break
        driver._ended(number, job)
        rec = driver.trials[number]
        decisions.append(rec.pruned_at)
        assert rec.state == ("PRUNED" if job.cancelled else "COMPLETE"), rec
    return decisions


@pytest.mark.parametrize("make", [
    lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
    lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=12, reduction_factor=3),
    lambda: optuna.pruners.MedianPruner(n_startup_trials=3),
], ids=["asha", "hyperband", "median"])
def test_replayed_trace_gives_the_decisions_of_optunas_pruner_alone(make):
    trace = _trace()
    alone, ours = _optuna_alone(make(), trace), _through_the_sweep(make(), trace)
    assert ours == alone
    assert 0 < sum(d is not None for d in alone) < len(trace), alone  # some pruned, some not: a real comparison


def _workers(**per_host) -> list[WorkerInfo]:
    return [WorkerInfo(f"tcp://{h}:{4000 + i}", h, 4000 + i, f"{h}-{i}") for h, n in per_host.items()
            for i in range(n)]


def test_placement_takes_the_best_fitting_host_then_as_few_hosts_as_possible():
    free = _workers(**{"10.0.0.1": 3, "10.0.0.2": 2, "10.0.0.3": 1})
    assert place(1, free) == ["tcp://10.0.0.3:4000"]  # the smallest hole that fits
    assert place(2, free) == ["tcp://10.0.0.2:4000", "tcp://10.0.0.2:4001"]
    assert place(3, free) == [f"tcp://10.0.0.1:{p}" for p in (4000, 4001, 4002)]
    assert place(5, free) == [f"tcp://10.0.0.1:{p}" for p in (4000, 4001, 4002)] + [
        "tcp://10.0.0.2:4000", "tcp://10.0.0.2:4001"]
    assert place(7, free) is None
    with pytest.raises(ValueError, match="positive int"):
        place(0, free)


def test_pick_lets_a_smaller_trial_pass_a_waiting_one_only_a_few_times():
    assert pick([2, 1], free=2, passed=0, patience=4) == 0
    assert pick([2, 1], free=1, passed=0, patience=4) == 1
    assert pick([2, 1], free=1, passed=4, patience=4) is None  # the 2-rank trial now holds the free worker
    assert pick([3, 3], free=2, passed=0, patience=4) is None
    assert pick([], free=4, passed=0, patience=4) is None


@pytest.mark.parametrize("name, kind", [("tpe", "TPESampler"), (None, "TPESampler"), ("random", "RandomSampler"),
                                        ("grid", "GridSampler"), ("gp", "GPSampler")])
def test_samplers_by_name(name, kind):
    searched, _ = search.distributions({"lr": [0.1, 0.2]})
    assert type(search.make_sampler(name, searched, seed=0)).__name__ == kind


@pytest.mark.parametrize("name, kind", [("asha", "SuccessiveHalvingPruner"), ("hyperband", "HyperbandPruner"),
                                        ("median", "MedianPruner"), ("none", "NopPruner"), (None, "NopPruner")])
def test_pruners_by_name(name, kind):
    assert type(search.make_pruner(name)).__name__ == kind


def test_space_entries_become_optuna_distributions():
    searched, fixed = search.distributions({"lr": {"low": 1e-4, "high": 1e-1, "log": True}, "layers": {
        "low": 1, "high": 4}, "act": ["relu", "gelu"], "epochs": 3, "opt": optuna.distributions.FloatDistribution(
        0, 1)})
    assert isinstance(searched["lr"], optuna.distributions.FloatDistribution) and searched["lr"].log
    assert isinstance(searched["layers"], optuna.distributions.IntDistribution)
    assert searched["act"].choices == ("relu", "gelu") and fixed == {"epochs": 3}
    with pytest.raises(ValueError, match="nothing to search"):
        search.distributions({"epochs": 3})
    with pytest.raises(ValueError, match=r"space\['lr'\].*'low' and 'high'"):
        search.distributions({"lr": {"low": 0.1}})
    with pytest.raises(TypeError, match="identifiers"):
        search.distributions({"learning rate": [1]})


def test_a_trial_row_has_the_columns_of_an_empty_results_table():
    from dask_ddp.sweeps.trial import COLUMNS, TrialRecord

    row = TrialRecord(3, {"lr": 0.1, "ranks": 2}, 2).row()
    assert [k for k in row if not k.startswith("params_")] == list(COLUMNS)
    assert row["params_lr"] == 0.1 and list(row).index("params_lr") == 2  # the parameters after the state
