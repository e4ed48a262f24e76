"""Nothing an honest rank reports is lost, and the scheduler stays bounded whatever a rank sends (issue 40).

Seen before: issue 26's per-interval byte budget dropped an honest rank's reports. 5,000 ``report()`` calls per
rank in a tight loop kept 4,680 of 10,000 rows (a warning said 2,660 a rank were dropped), and 3,000 reports 0.2
ms apart lost 12 %. And the worker's check counted only metric and log items: other kinds sent straight to the
rank's event pipe passed whole (the scheduler reached 1,075 MiB).

Now a rank's budget is a token bucket (:class:`~dask_ddp.wire.events.Budget`: ``4 x max-bytes-per-interval``
at once, then ``max-bytes-per-interval`` per flush interval): ``report()`` past it waits until it has room
(back-pressure, never a drop), and says how long it waited. The worker (:class:`~dask_ddp.worker.relay.Gate`)
counts every kind: reports and items of any other kind against twice the rank's budget, output lines against
their own, the small items the job relies on (telemetry, drop counts, waits) by size and count per interval,
and anything that is not a flat item of plain values is dropped and counted.

The pure tests pin each part with a fake clock; the cluster tests run the issue's two cases with the default
settings, a CSV sink beside ``job.metrics``, and a rank that floods the scheduler with other kinds while this
process (which hosts the scheduler, as in ``tests/test_limits.py``) measures its memory.
"""

from __future__ import annotations

import csv
import threading
import time

import dask
import msgpack
import psutil
import pytest
from _cluster import result_watching_the_scheduler, run

import dask_ddp
from dask_ddp.client.record import JobRecord
from dask_ddp.rank import reporting
from dask_ddp.wire.events import Budget, EventLimits, clip_line, flat_size, item_size, items_of
from dask_ddp.worker.relay import Gate, Relay

N = 5_000  # reports per rank in the tight loop (2 ranks: 10,000)


# ---- a real job, default settings -------------------------------------------------------------------------------

def tight_loop(n):
    """Report ``n`` times as fast as the rank can (three metrics a report, as a small training loop would)."""
    for i in range(n):
        dask_ddp.report(loss=1.0 / (i + 1), acc=i / n, lr=0.1)
    return n


def paced_loop(n, gap):
    """Report ``n`` times, ``gap`` seconds apart (a busy wait: ``time.sleep`` is coarser than 0.2 ms)."""
    due = time.perf_counter()
    for i in range(n):
        due += gap
        while time.perf_counter() < due:
            pass
        dask_ddp.report(loss=1.0 / (i + 1), acc=i / n, lr=0.1)
    return n


def complete_in_order(rows, n: int) -> None:
    """Each rank's steps are 0..n-1 in arrival order, with the values it reported."""
    for rank in (0, 1):
        mine = [row for row in rows if int(row["rank"]) == rank]
        assert [int(row["step"]) for row in mine] == list(range(n)), f"rank {rank}: {len(mine)} of {n} rows"
        assert all(float(row["loss"]) == 1.0 / (int(row["step"]) + 1) for row in mine)


@pytest.mark.slow
def test_ten_thousand_reports_from_a_tight_loop_arrive_complete_and_in_order(client, tmp_path):
    path = tmp_path / "metrics.csv"
    with dask.config.set({"ddp.echo-logs": False}):
        job = run(client, tight_loop, N, callbacks=[dask_ddp.CSVSink(str(path))])
        assert job.result(timeout=180) == [N, N]
    m = job.metrics
    assert len(m) == 2 * N, f"job.metrics kept {len(m)} of {2 * N} reports; dropped: {job.dropped}"
    complete_in_order(m.to_dict("records"), N)
    assert job.dropped == {}
    with open(path, newline="") as f:
        complete_in_order(list(csv.DictReader(f)), N)
    assert not any("dropped" in cause for *_, cause in job.history)


@pytest.mark.slow
def test_three_thousand_reports_0_2_ms_apart_arrive_complete(client):
    with dask.config.set({"ddp.echo-logs": False}):
        job = run(client, paced_loop, 3_000, 0.0002)
        assert job.result(timeout=180) == [3_000, 3_000]
    assert len(job.metrics) == 6_000 and job.dropped == {}
    complete_in_order(job.metrics.to_dict("records"), 3_000)


def fails_once(n):
    """Report ``n`` times; rank 1 then fails in the first attempt (the job restarts)."""
    for i in range(n):
        dask_ddp.report(loss=1.0 / (i + 1), acc=i / n, lr=0.1)
    ctx = dask_ddp.get_context()
    if ctx.restart_count == 0 and ctx.rank == 1:
        raise RuntimeError("rank 1 fails in the first attempt")
    return n


@pytest.mark.slow
def test_a_restarted_job_keeps_every_report_of_each_attempt_in_order(client):
    with dask.config.set({"ddp.echo-logs": False}):
        job = run(client, fails_once, N, max_restarts=1)
        assert job.result(timeout=180) == [N, N]
    rows = job.metrics.to_dict("records")
    complete_in_order([r for r in rows if r["attempt"] == 1], N)
    first = {rank: [r["step"] for r in rows if r["attempt"] == 0 and r["rank"] == rank] for rank in (0, 1)}
    assert first[1] == list(range(N))  # it reported everything before it failed
    assert first[0] == list(range(len(first[0])))  # stopped by the failure: what it sent, in order
    assert job.dropped == {}


@pytest.mark.slow
def test_a_detached_job_keeps_every_report_in_the_scheduler_for_its_client(client):
    from _cluster import detached

    name = f"complete-{time.time_ns() % 10**8}"
    with detached(client, name), dask.config.set({"ddp.echo-logs": False}):
        job = run(client, tight_loop, N, name=name, detach=True)
        assert job.result(timeout=180) == [N, N]
        complete_in_order(job.metrics.to_dict("records"), N)
        again = dask_ddp.attach(client, name)
        assert again.result(timeout=60) == [N, N]
        complete_in_order(again.metrics.to_dict("records"), N)


# ---- the parts, alone -------------------------------------------------------------------------------------------

class Clock:
    """A clock the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_budget_gives_a_burst_at_once_then_its_rate_and_owes_in_call_order():
    clock = Clock()
    budget = Budget(rate=1000.0, burst=5000, clock=clock)
    assert all(budget.take(1000) for _ in range(5)) and not budget.take(1)  # the burst, then nothing
    clock.now += 0.5
    assert budget.take(500) and not budget.take(1)  # half a second earned 500 bytes
    clock.now += 3600
    assert budget.take(5000) and not budget.take(1)  # an idle hour earns no more than the burst
    assert [budget.reserve(1000) for _ in range(3)] == [1.0, 2.0, 3.0]  # each waits behind the one before
    clock.now += 3.0
    assert budget.reserve(0) == 0.0 and not budget.take(1)  # the debt is paid, nothing spare
    idle = Budget(rate=1000.0, burst=5000, clock=clock)
    clock.now += 100.0
    idle.used += 5000  # the fast path (report()'s) empties the full bucket without a refill...
    assert not idle.take(1)  # ...and the refill after it credits no second burst for the idle time
    unbounded = Budget.per_interval(4096, 0.0, 4096, clock)  # a flush interval of 0: no bound
    assert all(unbounded.take(4096) for _ in range(100)) and unbounded.reserve(10**9) == 0.0
    assert Budget.per_interval(4096, 2.0, 1, clock).rate == 2048


@pytest.fixture
def paced():
    """The rank's buffer with a small budget (8 KiB at once, then 2 KiB every 10 ms) installed as report()'s."""
    limits = EventLimits(interval_bytes=2048)
    buf = reporting.EventBuffer(rank=1, attempt=2, limits=limits, interval=0.01)
    saved, reporting._BUFFER = reporting._BUFFER, buf
    yield buf
    reporting._BUFFER = saved


def test_report_past_the_budget_waits_for_room_keeps_every_report_in_order_and_says_how_long(paced):
    t0 = time.monotonic()
    for i in range(2000):  # ~200 KB: 8 KiB at once, the rest at 200 KiB/s
        dask_ddp.report(loss=float(i), acc=0.5)
    took = time.monotonic() - t0
    items = paced.drain()
    reports = [it for it in items if it["kind"] == "metric"]
    assert [it["step"] for it in reports] == list(range(2000)) and [it["loss"] for it in reports][-1] == 1999.0
    sent = sum(item_size(it) for it in reports)
    rate = paced.limits.interval_bytes / 0.01
    assert took >= 0.9 * (sent - paced.limits.burst_bytes) / rate  # paced: it could not go faster
    assert not [it for it in items if it["kind"] == "dropped"]
    (waited,) = [it for it in items if it["kind"] == "throttled"]
    # how many calls waited depends on the scheduler: a rank descheduled between two calls comes back to a bucket
    # refilled meanwhile (a clean run on a loaded machine: 869 of 2,000); how long they waited in all does not
    assert waited["rank"] == 1 and waited["attempt"] == 2 and 0 < waited["calls"] <= 2000
    assert 0.5 * (sent - paced.limits.burst_bytes) / rate <= waited["seconds"] <= took
    assert paced.drain() == []  # said once


def test_a_rank_under_its_rate_never_waits_however_long_it_reports():
    """The fast path never reads the clock; the flusher refills every tick, so a rank reporting at half its rate
    for five times its burst's worth never finds the bucket short (a bucket refilled only when short would be:
    it cannot credit what it earned while it was full)."""
    limits = EventLimits(interval_bytes=2048)  # 8 KiB at once, then 2 KiB every 50 ms: 40 KB/s
    buf = reporting.EventBuffer(rank=0, attempt=0, limits=limits, interval=0.05)
    sent: list[dict] = []
    flusher = reporting.Flusher(buf, sent.extend, 0.05)
    saved, reporting._BUFFER = reporting._BUFFER, buf
    flusher.start()
    try:
        size = item_size({"kind": "metric", "rank": 0, "attempt": 0, "step": 0, "time": 0.0, "loss": 0.5})
        gap = size / 20_000  # half the rate
        for i in range(int(5 * limits.burst_bytes / size)):
            dask_ddp.report(loss=0.5)
            time.sleep(gap)
    finally:
        flusher.stop()
        reporting._BUFFER = saved
    assert sum(it["kind"] == "metric" for it in sent) == i + 1
    assert [it for it in sent if it["kind"] == "throttled"] == []


def test_reports_from_several_threads_all_arrive_and_log_records_are_dropped_not_waited_for(paced):
    import logging

    def loop(tag):
        for i in range(500):
            dask_ddp.report({f"t{tag}": float(i)})

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items = paced.drain()
    for tag in range(4):
        mine = [it[f"t{tag}"] for it in items if f"t{tag}" in it]
        assert mine == [float(i) for i in range(500)], f"thread {tag}: {len(mine)} of 500"
    handler = reporting._LogHandler(paced)  # a log record never waits: past the budget it is counted
    t0 = time.monotonic()
    for i in range(2000):
        handler.emit(logging.LogRecord("user", logging.INFO, __file__, 1, "line %d " + "x" * 200, (i,), None))
    assert time.monotonic() - t0 < 2.0
    counts = {(it["what"], it["reason"]): it["count"] for it in paced.drain() if it["kind"] == "dropped"}
    assert counts.get(("line", "rate"), 0) > 0


def item(kind, **fields):
    return {"kind": kind, "rank": 0, "attempt": 0, "time": 0.0, **fields}


def test_the_gate_counts_every_kind_and_lets_the_small_necessary_ones_pass_bounded():
    clock = Clock()
    limits = EventLimits(interval_bytes=4096, report_bytes=1024)
    gate = Gate(limits, 1.0, clock)
    # what the rank's code could send around report(): each kind bounded, whatever it is
    big = "z" * 100_000
    assert gate.admit([item("telemetry", blob=big), item("dropped", what=big), item("junk", x=big),
                       item("metric", step=0, k=[0.0] * 10_000), item("metric", step=1, k={"a": 1}),
                       item("log", line=b"bytes"), {"kind": "metric", 7: 1.0}, ["not", "a", "dict"], "text",
                       item("metric", step=2, **{"x" * 2000: 1.0})]) == []
    assert gate.take_dropped() == {("item", "size"): 3, ("report", "shape"): 3, ("line", "shape"): 1,
                                   ("item", "shape"): 2, ("report", "size"): 1}
    # the longest log record a rank makes passes: cut to MAX_LINE characters, then escaped (a lone surrogate
    # becomes 6 characters), counted 4 bytes a character when not ASCII
    for text in ("\udcff" * 20_000, "\udce9é" * 15_000, "é" * 30_000):
        record = item("log", stream="logging", level="WARNING", line=clip_line(text))
        assert Gate(EventLimits(), 1.0, clock).admit([record]) == [record]
    # the pipe: twice the rank's burst at once, then its rate; other kinds count against it as reports do
    small = [item("junk", n=i) for i in range(10_000)]
    passed = sum(map(flat_size, gate.admit(small)))
    assert 2 * limits.burst_bytes - 100 <= passed <= 2 * limits.burst_bytes
    assert gate.take_dropped()[("item", "rate")] > 0
    # telemetry, drop counts and waits pass beside it (the job relies on them), bounded by count and size
    control = [item("telemetry", step_time=0.1), item("dropped", what="report", reason="keys", count=1),
               item("throttled", seconds=0.5, calls=3)]
    assert gate.admit(control) == control
    assert len(gate.admit(control * 20)) == limits.control_items - 3 and gate.take_dropped() == {
        ("item", "count"): 60 - limits.control_items + 3}
    clock.now += 1.0
    assert gate.admit(control) == control  # a new interval
    # output lines have a budget of their own: a rank that prints much costs none of its reports
    line = item("log", stream="stdout", line="y" * 100)
    while gate.line(line):
        pass
    clock.now += 1.0
    earned = gate.admit([item("metric", step=i, loss=1.0) for i in range(30)])
    assert len(earned) == 30 and not gate.take_dropped().get(("report", "rate"))


def test_an_honest_rank_passes_the_gate_whole_while_its_lines_flood():
    """The rank's budget paces what it sends to at most its burst plus its rate; the gate allows twice the burst at
    the same rate, so a rank's paced batches pass whole even when they reach the worker intervals late."""
    clock = Clock()
    limits = EventLimits(interval_bytes=4096, report_bytes=1024)
    rank = Budget.per_interval(limits.interval_bytes, 1.0, limits.burst_bytes, clock)
    gate = Gate(limits, 1.0, clock)
    late, step, passed = [], 0, 0
    for tick in range(600):  # a minute in 0.1 s ticks, reporting as fast as the budget allows
        batch = []
        while rank.take(flat_size(report := item("metric", step=step, loss=0.5))):
            batch.append(report)
            step += 1
        late.append(batch)
        if tick % 37 == 0:  # now and then the worker reads three seconds of batches at once
            for held in late:
                passed += len(gate.admit(held))
            late = []
        gate.line(item("log", stream="stdout", line="y" * 2000))
        clock.now += 0.1
    for held in late:
        passed += len(gate.admit(held))
    assert passed == step and ("report", "rate") not in gate.take_dropped()
    assert step > 2000  # it did report past its burst


def test_the_relay_publishes_at_most_one_batch_a_tick_whatever_the_rank_sends():
    worker = FakeWorker()
    relay = Relay(worker, "t", 0, 0, "run-0", interval=1.0)
    relay.start()
    try:
        t0 = time.monotonic()
        for i in range(2000):  # a batch every 0.5 ms, straight to the relay
            relay.extend([item("metric", step=i, loss=1.0)], now=True)
            time.sleep(0.0005)
        took = time.monotonic() - t0
    finally:
        relay.stop()
    steps = [it["step"] for msg in worker.sent for it in items_of(msg) if it["kind"] == "metric"]
    assert steps == list(range(2000))  # in order, none lost
    assert len(worker.sent) <= took / 0.1 + 3, f"{len(worker.sent)} events in {took:.1f} s"


class FakeWorker:
    def __init__(self):
        self.sent = []

    def log_event(self, topic, msg):
        self.sent.append(msg)


def test_the_record_says_once_that_reports_waited_and_adds_it_up_at_the_end():
    record = JobRecord("r-0a1b2c3d")
    with pytest.warns(dask_ddp.DaskDDPWarning, match="report\\(\\) waits for room"):
        for rank in (0, 1, 0):
            record.add([{"kind": "metric", "rank": rank, "attempt": 0, "step": 0, "time": 0.0, "loss": 1.0},
                        item("throttled", rank=rank, seconds=0.25, calls=10)])
    assert record.throttled == {0: 0.5, 1: 0.25} and len(record.metric_rows) == 3
    assert all(it["kind"] == "metric" for it in record.events)
    assert sum("waits for room" in cause for *_, cause in record.history) == 1
    record.settle()
    assert "0.8 s in all (rank 0: 0.5 s, rank 1: 0.2 s); no report was lost" in record.history[-1][3]


# ---- a real job whose rank floods the scheduler with other kinds --------------------------------------------------

def flood_other_kinds(seconds):
    """Send what report() never makes straight to the rank's event pipe, as fast as the rank can, for ``seconds``:
    big telemetry, drop counts and items of made-up kinds, nested values whose size item_size does not see, and
    thousands of tiny batches (each its own message to the worker)."""
    import threading
    import time

    from dask_ddp.rank import reporting

    flusher = next(t for t in threading.enumerate() if isinstance(t, reporting.Flusher))
    rank = dask_ddp.get_context().rank
    blob = "b" * 200_000
    big = [{"kind": kind, "rank": rank, "attempt": 0, "time": 0.0, "blob": blob}
           for kind in ("telemetry", "dropped", "throttled", "junk")]
    nested = {"kind": "metric", "rank": rank, "attempt": 0, "step": 0, "time": 0.0, "k": [0.5] * 30_000}
    small = [{"kind": "telemetry", "rank": rank, "attempt": 0, "time": 0.0, "step_time": 0.1}] * 40
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        flusher.send(big + [nested] + small)  # straight to the pipe
        reporting._BUFFER.items.extend(big)  # around report()'s budget: the flusher ships them
        for i in range(50):
            flusher.send([{"kind": "junk", "rank": rank, "attempt": 0, "time": 0.0, "n": i, "pad": "j" * 1000}])
        sent += 1
    return sent


def topic_bytes(topic: str, dask_scheduler=None) -> int:
    """Bytes of the job topic's events the scheduler holds (msgpack, as they came)."""
    held = dask_scheduler._broker._topics.get(topic)
    return 0 if held is None else sum(len(msgpack.packb(msg, use_bin_type=True)) for _, msg in held.events)


@pytest.mark.slow
def test_a_rank_flooding_other_kinds_leaves_the_scheduler_flat(client):
    rss0 = psutil.Process().memory_info().rss  # this process hosts the scheduler (and the client)
    workers = set(client.scheduler_info(n_workers=-1)["workers"])
    t0 = time.monotonic()
    with dask.config.set({"ddp.echo-logs": False}):
        job = run(client, flood_other_kinds, 8.0)
    sent, peak, held = result_watching_the_scheduler(client, job, topic_bytes, rss0)
    took = time.monotonic() - t0
    limits = EventLimits()
    # per rank: the gate's burst (2 MiB), then its rate (256 KiB/s) and the small items' (32 of 2 KiB a second),
    # for as long as the job ran (a batch of drop counts a tick on top)
    bound = 2 * (2 * limits.burst_bytes + took * (limits.interval_bytes + limits.control_items * limits.control_bytes
                                                  + 10 * 2048))
    print(f"{sent} rounds a rank in {took:.1f} s; the topic held {held / 2**20:.1f} MiB at most (bound "
          f"{bound / 2**20:.1f} MiB), the scheduler+client process grew {peak / 2**20:.0f} MiB; dropped "
          f"{job.dropped}")
    assert held <= bound, f"the scheduler held {held / 2**20:.0f} MiB of the job's topic"
    assert peak < 128 * 2**20, f"the scheduler+client process grew by {peak / 2**20:.0f} MiB"
    assert set(client.scheduler_info(n_workers=-1)["workers"]) == workers, "a worker was lost"
    assert all(n > 100 for n in sent) and set(job.dropped) == {0, 1}
    causes = " ".join(cause for *_, cause in job.history)
    for reason in ("size", "shape", "count", "rate"):  # each named where people look
        assert limits.why(reason) in causes, reason


def test_the_record_takes_drop_counts_a_rank_forged_without_failing_the_job():
    record = JobRecord("r-0a1b2c3d")
    with pytest.warns(dask_ddp.DaskDDPWarning):
        record.add([item("dropped", what="report", reason="{boom}", count="many"),
                    item("dropped", what="line", reason="rate", count=-5), item("throttled", seconds="long")])
    assert record.dropped == {0: 0} and record.throttled == {0: 0.0}
    assert any("{boom}" in cause for *_, cause in record.history)
