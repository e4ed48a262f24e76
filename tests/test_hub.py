"""Per-host event hubs (dask_ddp/worker/hub.py): the plan (pure), and real jobs on a LocalCluster whose workers share one
host (127.0.0.1), watched by a second client subscribed to the job's topic as the scheduler sends it."""

import math
import os
import signal
import time

import dask
import pytest
from _cluster import local_client, run, synthetic_plan, wait_until
from distributed import Client

import dask_ddp
from dask_ddp.client.launch import HUB_COST_PER_RANK, flush_interval_for, hub_plan
from dask_ddp.wire.events import chunked, items_of, unpack
from dask_ddp.wire.task import topic_of


def hub_of(plan, rank: int) -> str:
    """The address of the worker that runs local rank 0 on ``rank``'s host: its hub."""
    node = plan.ranks[rank].node_rank
    return next(r.address for r in plan.ranks if r.node_rank == node and r.local_rank == 0)


def test_hub_plan_sizes_the_interval_by_hosts():
    plan = synthetic_plan(125, 8)  # 1,000 ranks, 8 a host
    hubs = hub_plan(plan, 1.0)
    assert len(hubs) == 1000
    assert {via for via, _ in hubs.values()} == {r.address for r in plan.ranks if r.local_rank == 0}
    for r in plan.ranks:
        via, interval = hubs[r.rank]
        assert via == hub_of(plan, r.rank)
        assert interval == pytest.approx(1.0 if r.node_rank == 0 else 124 / (60 / 1.42 - 1))
    # the job's event rate stays within the bound, each hub event weighted by what it costs the scheduler more
    rate = sum(1 / i for i in {r.node_rank: hubs[r.rank][1] for r in plan.ranks}.values())
    assert rate * (1 + HUB_COST_PER_RANK * 7) == pytest.approx(60)
    assert hubs[999][1] == pytest.approx(3.0, abs=0.01) and flush_interval_for(1000, 1.0) == pytest.approx(16.93,
                                                                                                           abs=0.01)


def test_hub_plan_auto_only_where_it_helps():
    assert hub_plan(synthetic_plan(8, 7), 1.0) is None  # 56 ranks: within the bound, every rank publishes every second
    assert hub_plan(synthetic_plan(1000, 1), 1.0) is None  # one rank a host: a hub would gather nothing
    assert hub_plan(synthetic_plan(10, 8), 1.0) is not None  # 80 ranks on 10 hosts
    assert hub_plan(synthetic_plan(10, 8), 1.0, None) is None  # no bound: nothing to stretch
    assert hub_plan(synthetic_plan(1, 2), 1.0, per_host=True) == {0: ("tcp://10.0.0.1:4000", 1.0),
                                                                1: ("tcp://10.0.0.1:4000", 1.0)}
    assert hub_plan(synthetic_plan(1, 2), 1.0, 1, per_host=True)[1][1] == pytest.approx(1.06)  # the bound, weighted
    assert hub_plan(synthetic_plan(1, 1), 1.0, per_host=True) is None
    assert hub_plan(synthetic_plan(10, 8), 1.0, per_host=False) is None
    with pytest.raises(ValueError, match="per-host='sometimes'"):
        hub_plan(synthetic_plan(1, 2), 1.0, per_host="sometimes")


def test_chunked_keeps_order_and_the_byte_bound():
    """How the Relay splits a rank's items and a hub its batches (ddp.events.max-batch-bytes)."""
    assert list(chunked([5, 5, 5], lambda n: n, 10)) == [[5, 5], [5]]
    assert list(chunked([20, 1, 9, 2], lambda n: n, 10)) == [[20], [1, 9], [2]]  # too large: alone, not dropped
    assert list(chunked([], lambda n: n, 10)) == []


class TopicWatch:
    """A second client subscribed to a job's topic: every event the scheduler sends out, as it comes."""

    def __init__(self, address: str, topic: str):
        self.events: list = []
        self.client = Client(address)
        self.client.subscribe_topic(topic, lambda event: self.events.append(event[1]))

    def close(self):
        self.client.close()


def report_for(seconds: float):
    i, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        dask_ddp.report(i=i)
        i += 1
        time.sleep(0.01)
    return i


def _ranks_in(event) -> set:
    return {b["rank"] for b in unpack(event)}


def watched_report_job(client, seconds: float, timeout: float, **config):
    """A job of :func:`report_for` under ``config`` (``ddp.events.*``), its topic watched by a second client: the
    job, once it has checked that every rank's reports all arrived, in order, and the events the scheduler sent."""
    with dask.config.set({f"ddp.events.{k.replace('_', '-')}": v for k, v in config.items()}):
        job = run(client, report_for, seconds)
    watch = TopicWatch(client.scheduler.address, topic_of(job.run_id))
    try:
        counts = job.result(timeout=timeout)
        time.sleep(0.5)
    finally:
        watch.close()
    metrics = job.metrics
    for rank, n in enumerate(counts):
        assert list(metrics[metrics["rank"] == rank]["i"]) == list(range(n)), rank  # all, in order
    return job, [e for e in watch.events if isinstance(e, dict)]


@pytest.mark.slow
def test_a_job_through_one_hub_sends_one_event_per_interval_and_loses_nothing(client):
    """2 ranks on one host flushing every 0.2 s, a bound of 1 event a second: through the hub the scheduler sends
    about one event a second, each with both ranks' batches, and every report arrives, in order. (Without a hub the
    same bound gives each rank one event every 2 s, never shared.)"""
    _, events = watched_report_job(client, 5.0, 120, per_host=True, flush_interval=0.2, max_batches_per_second=1)
    shared = [e for e in events if _ranks_in(e) == {0, 1}]
    per_rank = {rank: sum(b["rank"] == rank for e in events for b in unpack(e)) for rank in (0, 1)}
    print(f"{len(events)} events from the scheduler, {len(shared)} with both ranks, rank batches {per_rank}")
    assert all("batches" in e for e in events), events  # nothing went around the hub
    # one a second over the span the ranks reported in (5 s on a quiet machine; under load a rank may start a
    # second or two after the other), each rank's final flush, one spare
    times = [it["time"] for e in events for b in unpack(e) for it in items_of(b)]
    span = max(times) - min(times)
    assert len(events) <= math.ceil(span) + 1 + 2 + 2, (len(events), span)
    assert len(shared) >= 3 and min(per_rank.values()) >= 4, (len(shared), per_rank)


@pytest.fixture
def three_workers():
    with local_client(3) as c:
        yield c


def report_until_stopped():
    i = 0
    while True:
        dask_ddp.report(i=i)
        i += 1
        time.sleep(0.01)


@pytest.mark.slow
def test_a_dead_hub_loses_no_batch_it_held(three_workers):
    """The hub's worker (rank 0's) dies while it holds the other ranks' batches of the last seconds (it publishes
    every 4 s): their forwards fail, their workers publish those batches themselves, so ranks 1 and 2 show every
    report up to the last one they sent, without a gap (a hub that answered before publishing would leave one)."""
    client = three_workers
    with dask.config.set({"ddp.events.per-host": True, "ddp.events.flush-interval": 0.2,
                          "ddp.events.max-batches-per-second": 0.25}):
        job = run(client, report_until_stopped, name="deadhub")
    wait_until(lambda: len(job.metrics) > 0, timeout=60, what="the hub's first event")
    hub = job.attempt.plan.ranks[0].address
    time.sleep(1.5)  # mid-interval: the hub holds about 1.5 s of ranks 1 and 2
    os.kill(client.run(os.getpid)[hub], signal.SIGKILL)  # the Dask worker process (its Nanny starts a new one)
    with pytest.raises(dask_ddp.WorkerLostError):
        job.result(timeout=120)
    metrics = job.metrics
    for rank in (1, 2):
        seen = list(metrics[metrics["rank"] == rank]["i"])
        assert seen == list(range(len(seen))), (rank, len(seen), sorted(set(range(max(seen) + 1)) - set(seen))[:5])
        assert len(seen) > 150, (rank, len(seen))  # past the hub's first event (about 100 a rank at 4 s)
    outcomes = job.attempt.outcomes
    assert all(outcomes[r].last_seq >= 0 for r in (1, 2) if r in outcomes), outcomes


def test_a_bad_per_host_setting_is_refused(client):
    with dask.config.set({"ddp.events.per-host": "sometimes"}), \
            pytest.raises(dask_ddp.PlanError, match=r"ddp\.events\.per-host='sometimes'"):
        run(client, report_for, 0.1)


