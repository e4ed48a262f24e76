"""The rank's telemetry sampler on its own (no cluster): the window arithmetic over known counter values."""

from __future__ import annotations

import time

import pytest

from dask_ddp.rank.telemetry import Counters, Sampler, _batch_size, timed


def steps(c: Counters, n: int, at: float, wait: float = 0.0, input_wait: float = 0.0, batch: int = 0):
    c.ddp_steps += n
    c.last_ddp_step = at
    c.coll_wait += wait
    c.input_wait += input_wait
    if batch:
        c.batches += n
        c.samples += n * batch
        c.samples_known = True
        c.last_batch = at
    c.samples_at_ddp_step = c.samples  # as DDP's timing hook does at each sync (its batches came before it)
    c.input_wait_at_ddp_step = c.input_wait


def test_ddp_windows():
    c = Counters()
    c.ddp_timed = True
    s = Sampler(rank=1, attempt=2, counters=c)
    steps(c, 3, at=10.0, batch=16)
    first = s.sample()
    assert first["steps"] == 3 and first["step_time"] is None  # no earlier boundary to time from
    steps(c, 10, at=12.0, wait=0.5, input_wait=1.0, batch=16)  # 10 steps in 2 s
    item = s.sample()
    assert (item["rank"], item["attempt"], item["steps"]) == (1, 2, 10)
    assert item["step_time"] == pytest.approx(0.2)
    assert item["collective_wait"] == pytest.approx(0.25) and item["input_wait"] == pytest.approx(0.5)
    assert item["samples_per_s"] == pytest.approx(80.0)
    assert item["step"] == 13 and item["last_report_age"] is None
    assert item["rss_bytes"] > 0 and item["gpu_mem_bytes"] is None
    quiet = s.sample()  # a step longer than the window: no steps, its waits wait for the step's end
    assert quiet["steps"] == 0 and quiet["step_time"] is None and quiet["input_wait"] is None
    c.input_wait += 0.9
    assert s.sample()["steps"] == 0
    steps(c, 1, at=13.0, input_wait=0.05)
    assert s.sample()["input_wait"] == pytest.approx(0.95)  # both parts of the long step, over its 1 s


def test_a_job_shorter_than_a_window_still_gets_a_step_time():
    """The rank's last sample (at its end) times its first steps from the sampler's start: a 150-step job that
    ended within a second showed no step time at all in the notebook's table."""
    c = Counters()
    c.ddp_timed = True
    s = Sampler(rank=0, attempt=0, counters=c)
    steps(c, 150, at=s._start + 0.3, wait=0.1)
    final = s.observe([], force=True)[-1]
    assert final["steps"] == 150 and final["step_time"] == pytest.approx(0.002)
    assert final["collective_wait"] == pytest.approx(1 / 3)


def test_reports_delimit_steps_without_ddp():
    c = Counters()
    s = Sampler(rank=0, attempt=0, counters=c)
    now = time.time()
    items = [{"kind": "metric", "rank": 0, "attempt": 0, "step": i, "time": now} for i in range(5)]
    items.append({"kind": "metric", "rank": 0, "attempt": 0, "step": 4, "time": now})  # two reports, one step
    out = s.observe(items, force=True)
    assert out[-1]["kind"] == "telemetry" and out[-1]["steps"] == 5 and out[-1]["step"] == 4
    assert out[-1]["collective_wait"] is None and out[-1]["input_wait"] is None  # no DDP model, no loader
    assert out[-1]["last_report_age"] < 1.0
    assert s.observe([], force=False) == []  # not due yet: nothing added


def test_timed_counts_waits_and_samples():
    import torch

    c = Counters()
    import dask_ddp.rank.telemetry as telemetry

    saved, telemetry.COUNTERS = telemetry.COUNTERS, c
    try:
        def slow():
            for _ in range(3):
                time.sleep(0.05)
                yield torch.zeros(4, 2), torch.zeros(4)
        assert len(list(timed(slow()))) == 3
    finally:
        telemetry.COUNTERS = saved
    assert c.batches == 3 and c.samples == 12 and 0.14 < c.input_wait < 1.0


@pytest.mark.parametrize("batch, size", [((list(range(3)),), None), ({"x": __import__("torch").zeros(5, 1)}, 5),
                                         ([__import__("torch").zeros(7)], 7), ("text", None)])
def test_batch_size(batch, size):
    assert _batch_size(batch) == size


def test_samples_per_s_counts_the_samples_of_the_window_steps_not_of_the_batches_fetched_in_it():
    """A step's batch is fetched before its sync, so a window's fetches run one batch ahead of its steps. Counted
    at fetch, a short window (the last of a job) held the wrong number of batches: a 40-step test's last window
    showed 36.6 samples/s for 74.8 (CI, 1 run in 4)."""
    c = Counters()
    c.ddp_timed = True
    s = Sampler(rank=0, attempt=0, counters=c)
    steps(c, 4, at=10.0, batch=8)
    s.sample()
    for at in (10.1, 10.2):  # two steps in 0.2 s: fetch a batch of 8, then sync (DDP's hook marks the step)
        steps(c, 1, at=at, batch=8)
    c.batches, c.samples = c.batches + 1, c.samples + 8  # the next step's batch, fetched before the sample
    assert s.sample()["samples_per_s"] == pytest.approx(16 / 0.2)
