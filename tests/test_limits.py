"""What a rank reports cannot exhaust the scheduler, its worker or the notebook (``ddp.events.max-*``).

Seen before these limits: a rank calling ``report()`` in a tight loop took the scheduler+client process
from 116 MiB to 1.3 GiB in 10 s (small reports; 1.0 GiB still held after the job), to 619 MiB with 2,000
keys a report, and a report of long keys travelled whole, however large. The pure tests pin each limit
(rank buffer, worker relay, client record, dashboard state); the cluster test throws hypothesis-drawn
payloads (sizes, key counts, key lengths, value types) at a running job, measures the scheduler's topic and
the process's memory while it floods, and checks that the drops are counted where people look.
"""

from __future__ import annotations

import time

import dask
import msgpack
import psutil
import pytest
from _cluster import result_watching_the_scheduler, run, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import dask_ddp
from dask_ddp.client.record import JobRecord
from dask_ddp.dashboard.plugin import NAME
from dask_ddp.dashboard.state import DashboardState, rank_rows
from dask_ddp.observe.display import job_html
from dask_ddp.rank import reporting
from dask_ddp.wire.events import EventLimits, item_size, items_of, pack_items
from dask_ddp.wire.task import topic_of
from dask_ddp.worker.relay import Relay

SMALL = EventLimits(batch_bytes=4096, interval_bytes=4096, report_bytes=1024, report_keys=8, key_length=16)


@pytest.fixture
def buffer():
    buf = reporting.EventBuffer(rank=3, attempt=1, limits=SMALL)
    saved, reporting._BUFFER = reporting._BUFFER, buf
    yield buf
    reporting._BUFFER = saved


def dropped(items: list[dict]) -> dict:
    return {(it["what"], it["reason"]): it["count"] for it in items if it["kind"] == "dropped"}


# ---- the rank: report() ---------------------------------------------------------------------------------------

def test_report_drops_what_passes_each_limit_counts_why_and_keeps_counting_steps(buffer):
    dask_ddp.report(loss=1.0)
    dask_ddp.report({f"k{i}": 1.0 for i in range(9)})  # 9 keys > 8
    dask_ddp.report({"x" * 17: 1.0})  # a 17-character name > 16
    dask_ddp.report({f"key{i:02d}": float(i) for i in range(8)}, step=50)  # 8 keys, 8 characters: fits
    items = buffer.drain()
    kept = [it for it in items if it["kind"] == "metric"]
    assert [it["step"] for it in kept] == [0, 50]  # the dropped calls still took steps 1 and 2
    assert dropped(items) == {("report", "keys"): 1, ("report", "key-length"): 1}
    limits = EventLimits(report_bytes=200)
    assert limits.report_fault({"a": 1.0}, 201) == "size" and limits.report_fault({"a": 1.0}, 200) is None
    buffer.pace(0.01)  # 4 KiB every 10 ms: a tight loop of 1,000 reports passes the budget within this test
    t0 = time.monotonic()
    for i in range(1000):  # past the budget: report() waits for room, nothing is dropped (tests/test_report_complete)
        dask_ddp.report(loss=float(i))
    took = time.monotonic() - t0
    items = buffer.drain()
    sent = sum(item_size(it) for it in items if it["kind"] == "metric")
    assert [it["step"] for it in items if it["kind"] == "metric"] == list(range(51, 1051)) and not dropped(items)
    assert sent <= SMALL.burst_bytes + took * SMALL.interval_bytes / 0.01 + 200  # the pace held
    waited = [it for it in items if it["kind"] == "throttled"]
    assert len(waited) == 1 and waited[0]["calls"] > 0 and 0 < waited[0]["seconds"] <= took


def test_log_records_share_the_budget_and_are_counted_as_lines(buffer):
    import logging

    handler = reporting._LogHandler(buffer)
    for i in range(500):
        handler.emit(logging.LogRecord("user", logging.INFO, __file__, 1, "line %d " + "x" * 50, (i,), None))
    items = buffer.drain()
    logs = [it for it in items if it["kind"] == "log"]
    assert 0 < len(logs) < 500 and dropped(items) == {("line", "rate"): 500 - len(logs)}


# ---- the worker: the relay --------------------------------------------------------------------------------

class FakeWorker:
    def __init__(self):
        self.sent = []

    def log_event(self, topic, msg):
        self.sent.append(msg)


def test_the_relay_packs_batches_and_drops_past_twice_the_budget_whatever_the_rank_sends():
    worker = FakeWorker()
    relay = Relay(worker, "t", 2, 0, "run-0", interval=60.0, limits=SMALL)
    for i in range(300):
        relay.log("stdout", f"line {i} " + "y" * 40)
    # a rank that bypasses report(): one huge report and a flood of small ones go straight to the relay
    relay.extend([{"kind": "metric", "rank": 2, "attempt": 0, "step": 0, "time": 0.0, "k" * 5000: 1.0}])
    relay.extend([{"kind": "metric", "rank": 2, "attempt": 0, "step": i, "time": 0.0, "loss": 1.0}
                  for i in range(1, 500)] + [{"kind": "telemetry", "rank": 2, "attempt": 0, "time": 0.0}], now=True)
    relay.flush()
    assert worker.sent and all(isinstance(msg["items"], bytes) for msg in worker.sent)
    assert all(len(msg["items"]) <= 2 * SMALL.batch_bytes for msg in worker.sent)
    items = [it for msg in worker.sent for it in items_of(msg)]
    counts = dropped(items)
    assert counts[("report", "size")] == 1 and counts[("line", "rate")] > 0 and counts[("report", "rate")] > 0
    # output lines and what the rank sends have a budget each: twice the rank's burst, twice its interval's
    assert sum(item_size(it) for it in items if it["kind"] == "log") <= 2 * SMALL.interval_bytes
    assert sum(item_size(it) for it in items if it["kind"] == "metric") <= 2 * SMALL.burst_bytes
    assert sum(it["kind"] in ("metric", "log") for it in items) + sum(counts.values()) == 300 + 500
    assert [it["kind"] for it in items].count("telemetry") == 1  # never dropped
    assert items_of({"items": b"\xc1 not msgpack"}) == [] and items_of({"items": pack_items([{"a": 1}])}) == [
        {"a": 1}]


# ---- the client: the job's record ---------------------------------------------------------------------------

def metric(rank: int, step: int, **extra) -> dict:
    return {"kind": "metric", "rank": rank, "attempt": 0, "step": step, "time": float(step), "loss": 0.5, **extra}


def test_the_record_thins_old_reports_and_drops_old_lines_to_stay_within_its_bytes():
    record = JobRecord("r-0a1b2c3d", max_rows=1_000_000, max_lines=1_000_000, max_bytes=400_000)
    for start in range(0, 60_000, 1000):
        record.add([metric(0, s) for s in range(start, start + 1000)]
                   + [{"kind": "log", "rank": 0, "attempt": 0, "time": 0.0, "stream": "stdout", "line": "z" * 100}])
        assert record.sizes["metrics"] <= 200_000 and record.sizes["logs"] <= 100_000
        assert record.sizes["events"] <= 100_000 + 200
    steps = [row["step"] for row in record.metric_rows]
    assert steps == sorted(steps) and steps[-1] == 59_999 and record.thinned > 0
    tail = steps[len(steps) // 2:]
    assert tail == list(range(tail[0], 60_000))  # the newest half whole
    assert steps[0] < 1000  # the oldest rows thinned, not lost wholesale: the start of the run is still there
    assert sum(r["step"] for r in record.metric_rows) and record.n_metrics == 60_000
    assert sum("thinned" in cause for *_, cause in record.history) == 1  # said once
    assert record.sizes["metrics"] == sum(item_size(r) for r in record.metric_rows)


def test_dropped_counts_reach_the_history_once_per_reason_and_a_total_at_the_end():
    record = JobRecord("r-0a1b2c3d")
    drop = {"kind": "dropped", "attempt": 0, "time": 0.0, "what": "report"}
    for _ in range(3):
        record.add([metric(0, 1), dict(drop, rank=0, reason="rate", count=10),
                    dict(drop, rank=1, reason="keys", count=2)])
    assert record.dropped == {0: 30, 1: 6} and len(record.metric_rows) == 3
    notes = [cause for *_, cause in record.history]
    assert len(notes) == 2 and "ddp.events.max-bytes-per-interval" in notes[0] and "max-report-keys" in notes[1]
    assert all(it["kind"] != "dropped" for it in record.events)
    record.settle()
    assert "30 reports (rate)" in record.history[-1][3] and "rank 1: 6" in record.history[-1][3]


def test_the_dashboard_state_counts_drops_per_job_and_rank():
    state = DashboardState()
    items = [metric(1, 4), {"kind": "dropped", "rank": 1, "attempt": 0, "time": 1.0, "what": "line",
                            "reason": "rate", "count": 7}]
    topic = topic_of("fit-0a1b2c3d")
    for _ in range(2):
        assert state.feed(topic, {"run": "fit-0a1b2c3d-0", "rank": 1, "attempt": 0, "seq": 0,
                                  "items": pack_items(items)})
    job = state.jobs["fit-0a1b2c3d"]
    assert job.dropped == 14 and rank_rows(job)["dropped"] == [14] and rank_rows(job)["step"] == [4]
    # a host's hub publishes several ranks' batches as one event (ddp.events.per-host): each counts (before,
    # the page ignored hub events whole: no telemetry, no steps for a job that aggregated per host)
    hub = {"run": "fit-0a1b2c3d", "batches": [
        {"run": "fit-0a1b2c3d-0", "rank": r, "attempt": 0, "seq": 1, "items": pack_items(
            [metric(r, 9), {"kind": "dropped", "rank": r, "attempt": 0, "time": 2.0, "what": "report",
                            "reason": "keys", "count": 1}])} for r in (0, 1)]}
    assert state.feed(topic, hub)
    assert job.dropped == 16 and rank_rows(job)["dropped"] == [1, 15] and rank_rows(job)["step"] == [9, 9]


# ---- a real job, flooded --------------------------------------------------------------------------------------

PAYLOADS = st.lists(st.tuples(
    st.one_of(st.integers(0, 300), st.integers(1000, 3000)),  # keys
    st.one_of(st.integers(1, 64), st.integers(200, 3000)),  # characters a key
    st.sampled_from(["float", "int", "bool", "tensor", "numpy", "huge-int", "text", "none"]),
).filter(lambda shape: shape[0] * shape[1] <= 300_000), min_size=1, max_size=4)


def drawn_payloads(n_examples: int) -> list:
    """Payload shapes drawn by hypothesis (many small examples gathered: one big draw takes it minutes)."""
    out = []

    @settings(max_examples=n_examples, deadline=None, database=None)
    @given(PAYLOADS)
    def gather(shapes):
        out.extend(shapes)

    gather()
    return out


def flood(shapes, seconds):
    """Replays the drawn shapes (and three fixed floods) as fast as the rank can, printing too, for ``seconds``."""
    import numpy as np
    import torch

    values = {"float": 0.5, "int": 7, "bool": True, "tensor": torch.tensor(0.25), "numpy": np.float32(2.0),
              "huge-int": 2**70, "text": "not a number", "none": None}
    # small, many, long keys; and a report within every limit but large (~12.6 KB): the rank then sends more
    # than its budget however slow a loaded machine makes the loop (report() waits: the throttle's note)
    shapes = [*shapes, (3, 4, "float"), (2000, 12, "float"), (20, 20_000, "float"), (60, 200, "float")]
    made = [{f"{i:0{width}d}"[-width:]: values[kind] for i in range(n)} for n, width, kind in shapes]
    outcomes, end = {"ok": 0, "refused": 0}, time.monotonic() + seconds
    while time.monotonic() < end:
        for payload in made:
            try:
                dask_ddp.report(payload)
                outcomes["ok"] += 1
            except (TypeError, ValueError):  # text, None, a huge int: refused at the call, as before
                outcomes["refused"] += 1
        print("x" * 2000)
    return outcomes


def scheduler_held(topic: str, dask_scheduler=None) -> int:
    """Bytes of the job topic's events the scheduler holds (msgpack, as they came)."""
    held = dask_scheduler._broker._topics.get(topic)
    return 0 if held is None else sum(len(msgpack.packb(msg, use_bin_type=True)) for _, msg in held.events)


def dashboard_dropped(run_id: str, dask_scheduler=None) -> int:
    return getattr(dask_scheduler.plugins[NAME].state.jobs.get(run_id), "dropped", 0)


@pytest.mark.slow
def test_a_flood_of_random_reports_leaves_the_scheduler_bounded_and_is_counted_where_people_look(client):
    shapes = drawn_payloads(60)
    rss0 = psutil.Process().memory_info().rss  # this process hosts the scheduler (and the client)
    workers = set(client.scheduler_info(n_workers=-1)["workers"])
    with dask.config.set({"ddp.echo-logs": False}):
        job = run(client, flood, shapes, 8.0)
    outcomes, peak, held = result_watching_the_scheduler(client, job, scheduler_held, rss0)
    limits = EventLimits()
    # the stated bounds: the scheduler holds at most the topic's last 1,000 events of at most max-batch-bytes
    # each (+ header), and the scheduler+client process grows by less than 512 MiB (it grew 1.2 GiB before)
    assert held <= 1000 * (2 * limits.batch_bytes + 200), held
    assert peak < 512 * 2**20, f"the scheduler+client process grew by {peak / 2**20:.0f} MiB"
    assert set(client.scheduler_info(n_workers=-1)["workers"]) == workers, "a worker was lost"
    assert all(o["ok"] > 0 and o["refused"] > 0 for o in outcomes)
    assert set(job.dropped) == {0, 1} and all(n > 0 for n in job.dropped.values())
    causes = " ".join(cause for *_, cause in job.history)
    assert "ddp.events.max-report-keys" in causes and "ddp.events.max-key-length" in causes
    assert "ddp.events.max-bytes-per-interval" in causes and "dropped past the ranks' limits" in causes
    html = job_html(job)
    assert "<th>dropped</th>" in html and f"<td>{job.dropped[0]}</td>" in html
    run_id = job.run_id
    shown = wait_until(lambda: client.run_on_scheduler(dashboard_dropped, run_id), what="the dashboard's count")
    assert shown == sum(job.dropped.values())
    print(f"scheduler+client grew {peak / 2**20:.0f} MiB at most; the topic held {held / 2**20:.1f} MiB at "
          f"most; kept {len(job.metrics)} reports, dropped {job.dropped}")
