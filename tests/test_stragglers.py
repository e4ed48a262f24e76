"""The straggler decision (pure) and its window, without a cluster: which rank the others wait for, and why."""

from __future__ import annotations

import pytest

from dask_ddp.client.stragglers import StragglerWatch, find_straggler


def item(rank, wait, input_wait=0.0, step_time=0.2, t=100.0, steps=5):
    return {"kind": "telemetry", "rank": rank, "attempt": 0, "time": t, "steps": steps, "step_time": step_time,
            "collective_wait": wait, "input_wait": input_wait}


@pytest.mark.parametrize("latest, rank, cause", [
    ({0: item(0, 0.7), 1: item(1, 0.02, input_wait=0.75)}, 1, "input"),
    ({0: item(0, 0.7), 1: item(1, 0.02, input_wait=0.05)}, 1, "compute"),
    ({0: item(0, 0.01), 1: item(1, 0.6), 2: item(2, 0.65), 3: item(3, 0.62)}, 0, "compute"),
    ({0: item(0, 0.5, input_wait=0.3), 1: item(1, 0.0, input_wait=0.3)}, 1, "compute"),  # both read slowly
])
def test_the_rank_that_waits_least_is_named(latest, rank, cause):
    found = find_straggler(latest)
    assert found is not None and (found.rank, found.cause) == (rank, cause)
    assert f"rank {rank} on worker w" in found.message("w", "h")


@pytest.mark.parametrize("latest", [
    {0: item(0, 0.05), 1: item(1, 0.03)},  # uniformly slow (or fast): nobody waits
    {0: item(0, 0.7), 1: item(1, 0.02), 2: item(2, 0.03)},  # two ranks wait little: not one rank's fault
    {0: item(0, 0.7), 1: item(1, None)},  # no collective timing on a rank
    {0: item(0, 0.7), 1: item(1, 0.0, t=80.0)},  # a stale item
    {0: item(0, 0.7)},  # one rank
])
def test_nobody_is_named(latest):
    assert find_straggler(latest) is None


def feed(watch, now, wait0, wait1):
    """Both ranks' telemetry at ``now`` (as every rank sends it each second); what the watch says after it."""
    first = watch.update(item(0, wait0, t=now), now)
    return watch.update(item(1, wait1, t=now), now) or first


def test_watch_names_once_after_the_window():
    watch = StragglerWatch(window=30)
    for now in range(0, 30):
        assert feed(watch, now, 0.7, 0.01) is None
    found = feed(watch, 31, 0.7, 0.01)
    assert found is not None and found.rank == 1
    assert feed(watch, 40, 0.7, 0.01) is None  # once
    watch.reset()  # a new attempt: named again after a new window
    assert all(feed(watch, now, 0.7, 0.01) is None for now in range(50, 80))
    assert feed(watch, 81, 0.7, 0.01).rank == 1


def test_watch_restarts_its_window_when_the_suspect_changes():
    watch = StragglerWatch(window=10)
    feed(watch, 0, 0.7, 0.01)
    feed(watch, 5, 0.6, 0.6)  # rank 1 caught up: nobody
    feed(watch, 7, 0.7, 0.01)  # slow again from t=7
    assert feed(watch, 12, 0.7, 0.01) is None
    assert feed(watch, 17, 0.7, 0.01).rank == 1


def test_windows_without_steps_keep_the_last_judgement():
    watch = StragglerWatch(window=5)
    feed(watch, 0, 0.7, 0.01)
    assert watch.update(item(0, None, steps=0, step_time=None, t=6), 6).rank == 1
