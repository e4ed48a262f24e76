"""Metrics and logs from the ranks to the notebook, the sinks, callbacks and plots.

Three jobs on one real LocalCluster carry the integration checks (a busy job
with sinks and callbacks, a failing job, a job with bad reports and a live
stream); the sinks and the plot also get unit tests on synthetic events.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import time
import traceback
import uuid

import dask
import matplotlib

matplotlib.use("Agg")

import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _cluster import leftover_processes, wait_until  # noqa: E402

import dask_ddp  # noqa: E402
from dask_ddp import dispatch  # noqa: E402
from dask_ddp.client.events import EventOrder, TopicFeed
from dask_ddp.client.launch import flush_interval_for  # noqa: E402
from dask_ddp.observe.sinks import CSVSink, JSONLinesSink, TensorBoardSink, plot_metrics  # noqa: E402

N_REPORTS = 10_000


# ---- functions run on the ranks --------------------------------------------------------------------------

def chatty(n):
    """Talks on every channel, then reports ``n`` times as fast as it can; ``late`` appears halfway."""
    ctx = dask_ddp.get_context()
    print(f"hello from print on rank {ctx.rank}")
    print(f"hello from stderr on rank {ctx.rank}", file=sys.stderr)
    logging.getLogger("user.train").info("hello from logging on rank %d", ctx.rank)
    for i in range(n):
        if i < n // 2:
            dask_ddp.report(loss=1.0 / (i + 1))
        else:
            dask_ddp.report(loss=1.0 / (i + 1), late=i)
    return ctx.rank


def fails_after_reports(n):
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    for i in range(n):
        dask_ddp.report(loss=float(i))
    if ctx.rank == 1:
        raise ValueError("rank one gave up")
    dist.barrier()  # rank 0 waits for a rank that never comes; it is stopped
    time.sleep(60)


def bad_reports_then_some():
    import torch

    ctx = dask_ddp.get_context()
    errors = {}
    calls = {"text": lambda: dask_ddp.report(loss="high"), "reserved": lambda: dask_ddp.report(rank=3),
             "name": lambda: dask_ddp.report({1: 2.0}), "tensor": lambda: dask_ddp.report(acc=torch.ones(2)),
             "step": lambda: dask_ddp.report(loss=1.0, step=1.5)}
    for name, call in calls.items():
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - collected for the client to check
            errors[name] = (type(exc).__name__, str(exc))
    numpy_float = np.float32 if ctx.rank == 0 else np.float64  # float64 is a float subclass msgpack's check refuses
    for step in range(5):
        dask_ddp.report(loss=torch.tensor(1.0 / (step + 1)), acc=numpy_float(step / 10 + ctx.rank), step=step)
        time.sleep(0.05)
    return errors


# ---- callbacks --------------------------------------------------------------------------------------------

class Broken:
    """Raises in every hook: the job must finish anyway, and it is called once, then disabled."""

    def __init__(self):
        self.calls = 0

    def on_metrics(self, event):
        self.calls += 1
        raise RuntimeError("broken sink")

    def on_finish(self, job):
        self.calls += 1
        raise RuntimeError("broken finish")


class Recorder:
    def __init__(self):
        self.hooks = []

    def on_start(self, job):
        self.hooks.append("start")

    def on_failure(self, job, error):
        self.hooks.append("failure")

    def on_finish(self, job):
        self.hooks.append("finish")


# ---- the busy job -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def busy(client, tmp_path_factory):
    """One run of ``chatty`` with sinks and callbacks attached and progress on (output captured)."""
    tmp = tmp_path_factory.mktemp("busy")
    mem = f"memory://busy-{uuid.uuid4().hex[:8]}/metrics.jsonl"
    plain_events, broken, recorder = [], Broken(), Recorder()
    callbacks = [JSONLinesSink(str(tmp / "deep" / "dir" / "metrics.jsonl")), JSONLinesSink(mem),
                 CSVSink(str(tmp / "metrics.csv"), flush_interval=0), broken, plain_events.append, recorder]
    out, err = io.StringIO(), io.StringIO()
    # 10,000 reports as fast as the rank can: past the default budget per interval, which another test covers
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            dask.config.set({"ddp.events.max-bytes-per-interval": 16 << 20}):
        job = dispatch.run(client, chatty, N_REPORTS, callbacks=callbacks, progress=True)
        values = job.result(timeout=180)
    return {"job": job, "values": values, "tmp": tmp, "mem": mem, "plain": plain_events, "broken": broken,
            "recorder": recorder, "stdout": out.getvalue(), "stderr": err.getvalue()}


@pytest.mark.slow
def test_every_report_arrives_in_order(busy):
    job, m = busy["job"], busy["job"].metrics
    assert busy["values"] == [0, 1] and job.state == "FINISHED"
    assert len(m) == 2 * N_REPORTS
    assert list(m.columns[:4]) == ["rank", "attempt", "step", "time"] and {"loss", "late"} <= set(m.columns)
    for rank in (0, 1):
        steps = m.loc[m["rank"] == rank, "step"].to_numpy()  # in arrival order
        assert (np.diff(steps) > 0).all(), f"rank {rank}'s steps arrived out of order"
        assert steps.tolist() == list(range(N_REPORTS))
    assert m["late"].isna().sum() == N_REPORTS  # the first half of each rank had no 'late'
    batches = {o.rank: o.last_seq + 1 for o in job.attempt.outcomes.values()}  # events each rank put on the wire
    assert all(1 <= b <= N_REPORTS // 10 for b in batches.values()), f"one event per batch, not per call: {batches}"


def test_logs_carry_rank_prefixes_from_print_stderr_and_logging(busy):
    logs = busy["job"].logs
    for r in (0, 1):
        assert f"[rank {r}] hello from print on rank {r}" in logs
        assert f"[rank {r}] hello from stderr on rank {r}" in logs
        assert f"[rank {r}] INFO user.train: hello from logging on rank {r}" in logs
    streams = {e["stream"] for e in busy["job"].events if e["kind"] == "log"}
    assert {"stdout", "stderr", "logging"} <= streams
    assert "[rank 0] hello from print on rank 0" in busy["stdout"]  # echoed in the notebook


def test_progress_bar_is_drawn_when_asked(busy):
    job = busy["job"]
    assert f"{job.run_id} FINISHED" in busy["stderr"] and "step" in busy["stderr"]
    assert f"{N_REPORTS}" in busy["stderr"]  # the bar reached the last step


def few_steps(n):
    for i in range(n):
        dask_ddp.report(loss=0.5 ** i, epoch=0)
        time.sleep(0.05)


def test_wait_draws_a_bar_to_total_with_the_latest_metrics(client):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        job = dispatch.run(client, few_steps, 6, total=6, progress=True)
        assert job.wait(timeout=120)
    text = err.getvalue()
    assert "6/6" in text, "the bar runs to total="
    assert "loss=0.03125" in text, "rank 0's latest metrics are in the postfix"  # 0.5 ** 5
    assert f"{job.run_id} FINISHED" in text


def test_sinks_read_back(busy):
    m = busy["job"].metrics
    local = busy["tmp"] / "deep" / "dir" / "metrics.jsonl"
    for text in (local.read_text(), fsspec.filesystem("memory").cat(busy["mem"].split("://")[1]).decode()):
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == len(m) and "kind" not in rows[0]
        assert pd.DataFrame(rows)[["rank", "step", "loss"]].equals(m[["rank", "step", "loss"]])
    csv = pd.read_csv(busy["tmp"] / "metrics.csv")
    assert list(csv.columns) == ["rank", "attempt", "step", "time", "loss", "late"]
    assert len(csv) == len(m) and csv["late"].isna().sum() == N_REPORTS
    assert np.allclose(csv["loss"], m["loss"]) and csv["step"].tolist() == m["step"].tolist()


def test_broken_callback_is_disabled_and_changes_nothing(busy):
    assert busy["job"].state == "FINISHED" and busy["values"] == [0, 1]
    assert busy["broken"].calls == 1, "a broken callback is called once, then disabled"
    assert busy["recorder"].hooks == ["start", "finish"]
    plain = busy["plain"]
    assert sum(e["kind"] == "metric" for e in plain) == 2 * N_REPORTS
    assert any(e["kind"] == "log" for e in plain)


def _steps_forever():
    for i in range(100_000):
        dask_ddp.report(step=i, loss=1.0 / (i + 1))
        time.sleep(0.02)


def test_early_stopping_from_a_callback_cancels_at_once(client):
    """job.cancel() in on_metrics (stop once the loss is low enough): cancel() waited for the job to end, but the
    job's end needs the thread that runs the callback, so it blocked 30 s (its timeout) with the ranks training on."""
    seen: dict = {}

    def early_stop(item):
        if item.get("loss", 1.0) < 0.05 and "job" in seen and "took" not in seen:
            t0 = time.monotonic()
            seen["job"].cancel()
            seen["took"] = time.monotonic() - t0
            seen["stopped_at"] = time.monotonic()

    seen["job"] = job = dispatch.run(client, _steps_forever, progress=False, callbacks=[early_stop])
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result(timeout=120)
    ended = time.monotonic() - seen["stopped_at"]
    print(f"early stop: cancel() in the callback returned in {seen['took'] * 1000:.1f} ms, job ended {ended:.2f} s "
          "later")
    assert seen["took"] < 1.0 and ended < 10, seen
    assert job.state == "CANCELLED" and leftover_processes(client) == []


def test_result_in_a_callback_gives_the_outcome_in_on_finish_and_a_clear_error_before(client):
    """job.result() in on_finish waited for on_finish to return: the job never ended (result() in the notebook
    hung too). In on_finish it now gives the values; in on_metrics (the outcome not known yet) a RuntimeError.
    job.stream() likewise: in on_metrics it waited for the end forever, in on_finish too (done() turns True only
    after on_finish); now a RuntimeError before the end, every event in on_finish."""
    got: dict = {}

    class Peek:
        def on_metrics(self, item):
            for what, call in (("early", lambda: got["job"].result()),
                               ("early_stream", lambda: next(got["job"].stream()))):
                if what not in got:
                    try:
                        got[what] = call()
                    except RuntimeError as exc:
                        got[what] = exc

        def on_finish(self, job):
            got["finish"] = job.result()
            got["streamed"] = list(job.stream(timeout=10))

    got["job"] = job = dispatch.run(client, _report_step, progress=False, callbacks=[Peek()])
    assert job.result(timeout=60) == [0, 1]
    assert got["finish"] == [0, 1]
    for what in ("early", "early_stream"):
        assert isinstance(got[what], RuntimeError) and "would wait forever" in str(got[what]), got[what]
    assert got["streamed"] == job.events and any(e["kind"] == "metric" for e in got["streamed"])


def _report_step():
    dask_ddp.report(step=0, loss=1.0)
    return dask_ddp.get_context().rank


def test_stream_yields_every_event_then_ends(busy):
    job = busy["job"]
    seen = list(job.stream(timeout=10))
    assert seen == job.events and len(seen) > 2 * N_REPORTS
    assert {e["kind"] for e in seen} == {"metric", "log"}


def test_plot_returns_matplotlib_axes(busy):
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    axes = busy["job"].plot()
    assert isinstance(axes, np.ndarray) and [a.get_ylabel() for a in axes] == ["loss", "late"]
    assert all(len(a.get_lines()) == 2 for a in axes)  # one line per rank
    ax = busy["job"].plot("loss")
    assert isinstance(ax, Axes) and [line.get_label() for line in ax.get_lines()] == ["rank 0", "rank 1"]
    plt.close("all")


# ---- failure ------------------------------------------------------------------------------------------------

def _rank_0_fails_first(others_sleep: float):
    if dask_ddp.get_context().rank == 0:
        time.sleep(0.5)
        raise ValueError("rank 0 fails")
    time.sleep(others_sleep)


@pytest.mark.parametrize("others", [30, 30, 30, 0, 0], ids=["stopped", "stopped-again", "stopped-3", "returned",
                                                          "returned-again"])
def test_when_rank_0_fails_the_others_print_no_store_stack_trace(client, others):
    """Rank 0 hosts the store: when it failed first, every other rank's notice watcher printed torch's warning
    with 14 lines of C++ frames into the notebook (5 of 5 jobs before; a consequence of the stop), whether the
    other rank was still running (it is stopped) or had returned already (it waits for its watcher)."""
    job = dispatch.run(client, _rank_0_fails_first, others, progress=False)
    with pytest.raises(ValueError, match="rank 0 fails"):
        job.result(timeout=60)
    assert not [line for line in job.logs if "TCPStore" in line or "frame #" in line], job.logs


_STORE_SERVER = ("import datetime, sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, 2, True, "
                 "timeout=datetime.timedelta(seconds=60), wait_for_workers=False); print(s.port, flush=True); "
                 "time.sleep(60)")


def _own_store_closes():
    """A rank's own code waits on a store of its own, which closes: torch's warning is its to see."""
    import datetime
    import subprocess
    import threading

    import torch.distributed as dist

    server = subprocess.Popen([sys.executable, "-c", _STORE_SERVER], stdout=subprocess.PIPE, text=True)
    store = dist.TCPStore("127.0.0.1", int(server.stdout.readline()), is_master=False,
                          timeout=datetime.timedelta(days=1))

    def wait():
        try:
            store.wait(["never"], datetime.timedelta(days=1))
        except Exception as exc:
            print("own wait ended:", type(exc).__name__, flush=True)
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)
    server.kill()
    server.wait()
    waiter.join(10)
    print("after the warning", flush=True)
    return "ok"


def test_a_store_warning_outside_a_stop_is_relayed_whole(client):
    job = dispatch.run(client, _own_store_closes, workers=1, progress=False)
    assert job.result(timeout=60) == ["ok"]
    logs = job.logs
    first = next(i for i, line in enumerate(logs) if "TCPStore" in line and "Connection was likely closed" in line)
    assert any("frame #" in line for line in logs[first:]) and "[rank 0] after the warning" in logs


def test_failing_rank_last_reports_arrive_and_traceback_once(client, capsys):
    job = dispatch.run(client, fails_after_reports, 7, progress=False)
    with pytest.raises(ValueError, match="rank one gave up") as info:
        job.result(timeout=120)
    m = job.metrics
    assert m.loc[m["rank"] == 1, "step"].tolist() == list(range(7)), "the failing rank's last reports are lost"
    text = "".join(traceback.format_exception(info.value))
    assert "fails_after_reports" in text and 'raise ValueError("rank one gave up")' in text
    assert text.count("Traceback (most recent call last)") == 1
    assert not any("Traceback" in line or "gave up" in line for line in job.logs), job.logs
    captured = capsys.readouterr()
    assert "gave up" not in captured.out and "Traceback" not in captured.err
    assert "step/s" not in captured.err and f"{job.run_id}:" not in captured.err, "progress=False drew a bar"
    assert leftover_processes(client) == []


def reports_then_waits_or_fails():
    import torch.distributed as dist

    dask_ddp.report(step=0, held=0.0)  # goes at once (after a quiet spell)
    time.sleep(0.3)
    dask_ddp.report(step=1, held=1.0)  # held for the flush interval
    print("line held too", flush=True)
    logging.getLogger("user").warning("a record held too")
    if dist.get_rank() == 1:
        time.sleep(0.5)
        raise ValueError("rank one failed")
    time.sleep(120)  # rank 0 waits here, in no collective that could break, until it is stopped


def test_a_stopped_rank_sends_what_it_held_before_it_is_killed(client):
    """Rank 0 holds a report and a log record for the flush interval (30 s) when rank 1 fails: its supervisor
    asks it for them before killing it (it answers from a listener thread while its main thread trains or
    waits), so nothing it reported is lost. CI once lost a rank's last submit_result this way."""
    with dask.config.set({"ddp.events.flush-interval": 30.0}):
        job = dispatch.run(client, reports_then_waits_or_fails, progress=False)
    with pytest.raises(ValueError, match="rank one failed"):
        job.result(timeout=120)
    m = job.metrics
    assert sorted(m.loc[m["rank"] == 0, "step"].tolist()) == [0, 1], m
    assert any(line.startswith("[rank 0]") and "a record held too" in line for line in job.logs), job.logs
    assert job.attempt.outcomes[0].status.name == "ABORTED"
    assert leftover_processes(client) == []


# ---- bad input, live stream, TensorBoard ---------------------------------------------------------------------

def test_bad_reports_name_the_key_and_a_live_stream_and_tensorboard(client, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = dispatch.run(client, bad_reports_then_some, progress=False, callbacks=[TensorBoardSink(tmp_path / "tb")])
    live = []
    for event in job.stream(timeout=120):  # consumed while the job runs; ends by itself
        live.append(event)
    errors = job.result(timeout=10)[0]
    assert errors["text"][0] == "TypeError" and "loss" in errors["text"][1] and "str" in errors["text"][1]
    assert errors["reserved"][0] == "ValueError" and "'rank' is a reserved name" in errors["reserved"][1]
    assert errors["name"][0] == "TypeError" and "1" in errors["name"][1]
    assert errors["tensor"][0] == "TypeError" and "acc" in errors["tensor"][1]
    assert errors["step"][0] == "TypeError" and "step" in errors["step"][1]
    assert live == job.events and sum(e["kind"] == "metric" for e in live) == 10

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["acc/rank0", "acc/rank1", "loss/rank0", "loss/rank1"]
    loss1 = acc.Scalars("loss/rank1")
    assert [s.step for s in loss1] == list(range(5))
    assert np.allclose([s.value for s in loss1], [1.0 / (s + 1) for s in range(5)])
    assert np.allclose([s.value for s in acc.Scalars("acc/rank1")], [1 + s / 10 for s in range(5)])


def steady_then_lone(seconds, quiet):
    """Reports every 5 ms for ``seconds``, falls quiet for ``quiet`` s, reports once more, then idles a second."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dask_ddp.report(loss=0.1)
        time.sleep(0.005)
    time.sleep(quiet)
    dask_ddp.report(lone=1.0)
    time.sleep(1.0)


@pytest.mark.slow
def test_reports_go_in_few_batches_and_a_lone_report_at_once(client):
    """Each batch costs the worker, scheduler and client ~2 ms whatever its size: a rank reporting all the time sends
    one batch per ddp.events.flush-interval, and a report after a quiet spell goes at the next 0.1 s tick, not an
    interval later. A long interval (3 s) tells the two apart."""
    arrivals = {}

    def on_metrics(event):
        if "lone" in event:
            arrivals[event["rank"]] = time.time() - event["time"]

    seconds, interval = 2.5, 3.0
    # telemetry off: a quiet rank's telemetry-only batches (one per interval) would blur the count of report batches
    with dask.config.set({"ddp.events.flush-interval": interval, "ddp.telemetry.enabled": False}):
        job = dispatch.run(client, steady_then_lone, seconds, interval + 1, progress=False, callbacks=[on_metrics])
    job.result(timeout=120)
    batches = {o.rank: o.last_seq + 1 for o in job.attempt.outcomes.values()}
    reports = job.metrics.groupby("rank").size().to_dict()
    print(f"batches on the wire per rank: {batches} for {reports} reports; lone report's delay: {arrivals}")
    # the steady part: one batch at once, then one an interval later; the lone report; the final flush; 1 spare
    assert all(b <= 1 + 1 + 1 + 1 + 1 for b in batches.values()), batches
    assert all(n > 200 for n in reports.values()), reports
    assert sorted(arrivals) == [0, 1] and all(d < 0.5 for d in arrivals.values()), arrivals


def steady(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dask_ddp.report(loss=0.1)
        time.sleep(0.005)


def batches_of_a_steady_job(client, bound, seconds=5.0):
    """A 2-rank job reporting every 5 ms for ``seconds``, flushing every 0.25 s, at most ``bound`` batches a
    second in all: the job, and the batches each rank sent."""
    with dask.config.set({"ddp.events.flush-interval": 0.25, "ddp.events.max-batches-per-second": bound,
                          "ddp.events.per-host": False}):  # the rule without hubs (test_hub.py: with)
        job = dispatch.run(client, steady, seconds, progress=False)
    job.result(timeout=120)
    batches = {o.rank: o.last_seq + 1 for o in job.attempt.outcomes.values()}
    print(f"batches per rank in {seconds} s of reports: {batches}")
    return job, batches


@pytest.mark.slow
def test_a_large_job_flushes_less_often_so_its_batch_rate_is_bounded(client):
    """ddp.events.max-batches-per-second bounds the batches a whole job sends the scheduler: here 0.5 a second for
    2 ranks, so each rank flushes every 4 s instead of every 0.25 s. Every report still arrives."""
    job, batches = batches_of_a_steady_job(client, 0.5)
    # at once, one 4 s later, the final flush, and one spare for a log line: 20 without the bound
    assert all(b <= 4 for b in batches.values()), batches
    assert all(n > 300 for n in job.metrics.groupby("rank").size()), job.metrics.groupby("rank").size()


def test_flush_interval_for_world_sizes():
    assert flush_interval_for(8, 1.0) == 1.0 and flush_interval_for(60, 1.0, rank=59) == 1.0  # the default: 60
    assert flush_interval_for(1000, 1.0, rank=0) == 1.0 and flush_interval_for(1000, 1.0) == 999 / 59
    assert flush_interval_for(8, 1.0, 80) == 1.0 and flush_interval_for(80, 1.0, 80, rank=79) == 1.0
    # past the bound rank 0 keeps the interval (the notebook's live view), the others share the rest
    assert flush_interval_for(1000, 1.0, 80, rank=0) == 1.0
    assert flush_interval_for(1000, 1.0, 80, rank=1) == flush_interval_for(1000, 1.0, 80) == 999 / 79
    assert 1 / 1.0 + 999 / flush_interval_for(1000, 1.0, 80) == pytest.approx(80)  # the job's rate: the bound
    assert flush_interval_for(1000, 1.0, 100, rank=7) == 999 / 99
    assert flush_interval_for(1000, 1.0, None) == 1.0 and flush_interval_for(1000, 1.0, 0) == 1.0
    # a bound below rank 0's own rate: every rank alike
    assert flush_interval_for(2, 0.25, 0.5) == flush_interval_for(2, 0.25, 0.5, rank=0) == 4.0
    assert flush_interval_for(1, 1.0, 0.5, rank=0) == 2.0
    for bad in [(0, 1.0, 100), (4, 0.0, 100), (4, 1.0, -1)]:
        with pytest.raises(ValueError, match="flush_interval_for"):
            flush_interval_for(*bad)


@pytest.mark.slow
def test_past_the_bound_rank_0_keeps_its_interval_and_the_others_flush_less(client):
    """4.2 batches a second for 2 ranks flushing every 0.25 s: rank 0 keeps 0.25 s (4 a second), rank 1 gets
    what is left, one batch every 5 s. (The uniform rule gave both one every 0.48 s: about 11 in 5 s.)"""
    job, batches = batches_of_a_steady_job(client, 4.2)
    assert batches[0] >= 15, batches  # about 20 at 0.25 s
    assert batches[1] <= 4, batches  # at once, maybe at 5 s, the final flush, one spare
    assert all(n > 300 for n in job.metrics.groupby("rank").size()), job.metrics.groupby("rank").size()


def test_bad_event_settings_are_refused_before_anything_ships(client):
    for key, value in [("ddp.events.max-batches-per-second", -1), ("ddp.events.flush-interval", 0),
                       ("ddp.events.max-batches-per-second", "fast")]:
        with dask.config.set({key: value}), pytest.raises(dask_ddp.PlanError, match=key.replace(".", r"\.")):
            dispatch.run(client, steady, 0.1, progress=False)


def test_report_outside_a_rank():
    with pytest.raises(dask_ddp.NotInRankError, match=r"report\(\) was called outside a dask-ddp rank"):
        dask_ddp.report(loss=1.0)


class _ReportingDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        try:
            dask_ddp.report(x=1.0)
        except dask_ddp.NotInRankError as exc:
            return str(exc)
        return "reported"


def report_from_a_forked_dataloader_worker():
    import multiprocessing

    loader = torch.utils.data.DataLoader(_ReportingDataset(), num_workers=1, batch_size=None,
                                         multiprocessing_context=multiprocessing.get_context("fork"))
    return next(iter(loader))


def test_report_in_a_forked_dataloader_worker_says_where_to_report(client):
    """A forked worker inherits the rank's buffer but not its flusher: its reports would be lost without a word."""
    out = dispatch.run(client, report_from_a_forked_dataloader_worker, progress=False).result(timeout=120)
    assert all("no channel to the client" in o and "DataLoader worker" in o for o in out), out


# ---- events: late subscription ------------------------------------------------------------------------------

def _batch(seq):
    return {"run": "r-0", "rank": 0, "attempt": 0, "seq": seq,
            "items": [{"kind": "metric", "rank": 0, "attempt": 0, "step": seq, "time": time.time(), "x": seq}]}


def _drain(feed, order, want, timeout=10.0, first=()):
    """The seqs of the batches ``order`` makes ready from ``first`` and then from what ``feed`` delivers."""
    got = [m["seq"] for msg in first for m in order.take(msg)]
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got.extend(m["seq"] for msg in feed.get(0.1) for m in order.take(msg))
    return got


def _log_from_worker(topic, msg):
    from distributed import get_worker

    get_worker().log_event(topic, msg)


@pytest.mark.slow
def test_subscription_backfills_what_was_logged_before_it(client):
    topic = f"dask-ddp-test-{uuid.uuid4().hex[:8]}"
    for seq in (0, 1):
        client.log_event(topic, _batch(seq))
    wait_until(lambda: len(client.get_events(topic)) >= 2, 10, what="both events on the scheduler")
    feed, order = TopicFeed(client, topic), EventOrder()  # subscribing does not replay the past ...
    try:
        assert _drain(feed, order, 2, first=feed.backfill()) == [0, 1]  # ... the backfill does
        # Live delivery after subscribing, the way a job's ranks publish: from a task on a worker. The task is
        # submitted on the client's batched stream after the subscribe-topic message, so the scheduler has the
        # subscription before the task runs. (A client.log_event here would be an RPC on another connection,
        # which can overtake the subscription: the race that made this test fail under load in session 1.)
        client.submit(_log_from_worker, topic, _batch(2), pure=False).result(timeout=30)
        assert _drain(feed, order, 1) == [2]
        # a second backfill brings duplicates only: all dropped
        assert _drain(feed, order, 1, timeout=1.0, first=feed.backfill()) == []
        assert order.have_all(0, 0, 2) and order.last_seq[(0, 0, 0)] == 2
    finally:
        feed.close()


def test_batches_are_delivered_in_the_order_each_rank_sent_them():
    """A batch that a backfill brings late goes before its successors that came live, not after them."""
    order = EventOrder()
    seqs = lambda batches: [b["seq"] for b in batches]  # noqa: E731
    assert seqs(order.take(_batch(1))) == []         # held back: 0 has not come
    assert seqs(order.take(_batch(0))) == [0, 1]     # 0 arrives (e.g. by backfill): both, in order
    assert seqs(order.take(_batch(1))) == []         # a duplicate
    other_rank = dict(_batch(0), rank=1)
    assert order.take(other_rank) == [other_rank]    # each rank has its own order
    assert seqs(order.take(_batch(3))) == []         # 2 never comes ...
    assert seqs(order.flush()) == [3]                # ... so 3 is delivered late rather than lost
    assert order.last_seq[(0, 0, 0)] == 3 and not order.have_all(0, 0, 3)


def test_a_live_replacements_batches_are_its_own_not_the_lost_ranks_duplicates():
    """A live job's replacement of rank 1 counts its batches from seq 0 again (its relay is new): they must be
    delivered, in their own order, and its end awaited on its own sequence."""
    order = EventOrder()
    seqs = lambda batches: [(b.get("joined", 0), b["seq"]) for b in batches]  # noqa: E731
    assert seqs(order.take(_batch(0)) + order.take(_batch(1))) == [(0, 0), (0, 1)]
    assert seqs(order.take(dict(_batch(1), joined=1))) == []  # the replacement's 1 waits for its own 0
    assert seqs(order.take(dict(_batch(0), joined=1))) == [(1, 0), (1, 1)]
    assert order.have_all(0, 0, 1, joined=1) and not order.have_all(0, 0, 2, joined=1)


def test_a_users_handler_on_the_all_topic_is_kept(client):
    """dask-ddp listens on the scheduler's "all" topic for lost workers; a user's own handler stays in place."""
    seen = []

    def mine(event):
        seen.append(event[1])

    client.subscribe_topic("all", mine)
    try:
        def during_job():
            time.sleep(1.0)
            return 1

        job = dispatch.run(client, during_job, progress=False)
        assert job.result(timeout=120) == [1, 1]

        def of_the_job():  # the scheduler's own events while the job ran, e.g. its port Variable's client
            return [m for m in seen if job.run_id in str(m)]

        wait_until(of_the_job, 10, must=False)
        assert of_the_job(), f"the user's handler got nothing while the job ran: {seen}"
        assert client._event_handlers.get("all") is mine, "the user's handler must be put back"
    finally:
        client.unsubscribe_topic("all")


# ---- sinks and plot without a cluster -----------------------------------------------------------------------

def _event(rank, step, **values):
    return {"kind": "metric", "rank": rank, "attempt": 0, "step": step, "time": 1000.0 + step, **values}


def test_jsonl_sink_is_lazy_flushes_and_closes(tmp_path):
    path = tmp_path / "a" / "m.jsonl"
    sink = JSONLinesSink(str(path), flush_interval=0)
    assert not path.exists(), "a sink must not create a file before the first event"
    sink.on_metrics(_event(0, 0, loss=0.5))
    assert json.loads(path.read_text()) == {"rank": 0, "attempt": 0, "step": 0, "time": 1000.0, "loss": 0.5}
    sink.on_metrics(_event(1, 0, loss=0.25))
    sink.on_finish(None)
    sink.on_finish(None)  # twice is harmless
    assert len(path.read_text().splitlines()) == 2


def test_csv_sink_rewrites_the_file_when_a_column_appears(tmp_path):
    path = tmp_path / "m.csv"
    sink = CSVSink(str(path), flush_interval=0)
    sink.on_metrics(_event(0, 0, loss=0.5))
    sink.on_metrics(_event(0, 1, loss=0.4))
    assert path.read_text().splitlines() == ["rank,attempt,step,time,loss", "0,0,0,1000.0,0.5", "0,0,1,1001.0,0.4"]
    sink.on_metrics(_event(0, 2, loss=0.3, val_loss=0.9))  # a new column after rows were written
    sink.on_metrics(_event(1, 2, loss=0.3))
    sink.on_finish(None)
    df = pd.read_csv(path)
    assert list(df.columns) == ["rank", "attempt", "step", "time", "loss", "val_loss"]
    assert df["loss"].tolist() == [0.5, 0.4, 0.3, 0.3] and df["val_loss"].isna().tolist() == [True, True, False, True]


def test_csv_sink_buffers_between_flushes_and_writes_at_finish():
    url = f"memory://csv-{uuid.uuid4().hex[:8]}/m.csv"
    sink = CSVSink(url, flush_interval=3600)
    for step in range(3):
        sink.on_metrics(_event(0, step, loss=1.0, **({"acc": 0.5} if step == 2 else {})))
    sink.on_finish(None)
    with fsspec.open(url, "r") as f:
        df = pd.read_csv(f)
    assert list(df.columns) == ["rank", "attempt", "step", "time", "loss", "acc"] and len(df) == 3


def test_sinks_write_to_s3(s3):
    import s3fs

    base = f"s3://{s3['bucket']}/runs"
    sinks = [JSONLinesSink(f"{base}/m.jsonl", s3["storage_options"]), CSVSink(f"{base}/m.csv", s3["storage_options"])]
    for sink in sinks:
        for step in range(3):
            sink.on_metrics(_event(0, step, loss=1.0 / (step + 1)))
        sink.on_finish(None)
    fs = s3fs.S3FileSystem(**s3["storage_options"])
    assert len(fs.cat(f"{base}/m.jsonl").decode().splitlines()) == 3
    assert fs.cat(f"{base}/m.csv").decode().splitlines()[0] == "rank,attempt,step,time,loss"


def test_sink_that_cannot_open_names_the_url(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = JSONLinesSink(str(blocker / "m.jsonl"))
    with pytest.raises(OSError, match="could not open .*file/m.jsonl"):
        sink.on_metrics(_event(0, 0, loss=1.0))
    with pytest.raises(TypeError, match="path or fsspec URL"):
        CSVSink(None)


def test_plot_metrics_per_rank_attempts_and_errors():
    import matplotlib.pyplot as plt

    rows = [_event(r, s, loss=1.0 / (s + 1), **({"val": 0.1 * s} if s % 5 == 0 else {}))
            for r in (0, 1) for s in range(10)]
    rows += [dict(_event(0, s, loss=0.5), attempt=1) for s in range(3)]
    df = pd.DataFrame(rows).drop(columns="kind")
    axes = plot_metrics(df)
    assert [a.get_ylabel() for a in axes] == ["loss", "val"]
    assert [line.get_label() for line in axes[0].get_lines()] == [
        "rank 0 (attempt 1)", "rank 0 (attempt 2)", "rank 1 (attempt 1)"]
    assert len(axes[1].get_lines()[0].get_xdata()) == 2  # NaNs dropped: the 'val' points are connected
    fig, ax = plt.subplots()
    assert plot_metrics(df, y=["loss", "val"], x="time", ax=ax) is ax
    assert "loss rank 0 (attempt 1)" in [line.get_label() for line in ax.get_lines()]
    with pytest.raises(ValueError, match="no column 'nope'"):
        plot_metrics(df, y="nope")
    with pytest.raises(ValueError, match="plot\\(x='wall'\\)"):
        plot_metrics(df, x="wall")
    with pytest.raises(ValueError, match="no metrics were reported yet"):
        plot_metrics(df.iloc[:0])
    plt.close("all")
