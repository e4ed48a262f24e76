"""The scheduler's registry of detached drivers (:class:`dask_ddp.client.registry.DriverRegistry`), no cluster.

The registry on its own: drivers by key, the last ``ddp.detached.keep`` ended ones kept, a key taken again by a
running driver kept past its old turn, the end counted under the lock with what the caller keeps. Then its two
users, driven as the scheduler's process drives them (their functions called in this process, the driver's client
pointed at a port that refuses connections, so each driver fails at once and ends): a detached job's registry
forgets the oldest ended job past ``keep``; a detached sweep's keeps a new sweep that took an ended sweep's name.
"""

from __future__ import annotations

import socket
import threading
import types
import uuid

import cloudpickle
import dask
import pytest
from _cluster import wait_until

from dask_ddp.client import detach
from dask_ddp.client.registry import DriverRegistry
from dask_ddp.sweeps import detach as sweep_detach
from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info
from dask_ddp.wire.spec import LaunchSpec


class _Driver:
    def __init__(self, state: str = "RUNNING") -> None:
        self.state = state


def _ended(driver: _Driver) -> bool:
    return driver.state != "RUNNING"


# ---- the registry on its own ----------------------------------------------------------------------------------
def test_drivers_are_held_by_key_and_read_back():
    reg: DriverRegistry[_Driver] = DriverRegistry()
    a, b = _Driver(), _Driver()
    assert reg.add("a", a) is a and reg.add("b", b) is b
    assert reg.get("a") is a and reg.get("b") is b and reg.get("c") is None
    assert reg.values() == [a, b]
    c = reg.add("a", _Driver())  # a key taken again: the new driver replaces the old
    assert reg.get("a") is c and reg.values() == [c, b]


def test_the_last_keep_ended_drivers_are_kept_and_running_ones_always():
    reg: DriverRegistry[_Driver] = DriverRegistry()
    for key in "abcdef":
        reg.add(key, _Driver())
    with dask.config.set({"ddp.detached.keep": 2}):
        for key in "abcd":  # e and f never end
            reg.end(key)
    assert sorted(reg.drivers) == ["c", "d", "e", "f"] and list(reg.ended) == ["c", "d"]
    with dask.config.set({"ddp.detached.keep": 0}):
        reg.end("e")
    assert sorted(reg.drivers) == ["f"] and not reg.ended


def test_the_keep_is_read_at_each_end():
    reg: DriverRegistry[_Driver] = DriverRegistry()
    with dask.config.set({"ddp.detached.keep": 5}):
        for key in "abc":
            reg.end(reg.add(key, _Driver()) and key)
    assert sorted(reg.drivers) == ["a", "b", "c"]
    with dask.config.set({"ddp.detached.keep": 1}):
        reg.end(reg.add("d", _Driver()) and "d")
    assert sorted(reg.drivers) == ["d"] and list(reg.ended) == ["d"]


def test_a_key_taken_again_by_a_running_driver_outlives_its_old_turn():
    """A sweep's name can be taken by a new sweep once the old one ended: when the old one's turn to be forgotten
    comes, the new one (running) stays; it goes at its own turn, once it has ended."""
    reg: DriverRegistry[_Driver] = DriverRegistry(forgettable=_ended)
    old = reg.add("name", _Driver())
    old.state = "FINISHED"
    reg.end("name")
    new = reg.add("name", _Driver())  # RUNNING
    with dask.config.set({"ddp.detached.keep": 0}):
        reg.end("other")  # the old "name" turn comes: its key now holds a running driver
    assert reg.get("name") is new and not reg.ended
    new.state = "FAILED"
    with dask.config.set({"ddp.detached.keep": 0}):
        reg.end("name")
    assert reg.get("name") is None


def test_without_forgettable_an_ended_turn_forgets_whatever_holds_the_key():
    """A detached job's run id is never reused: its registry forgets at each turn, whatever the driver's state."""
    reg: DriverRegistry[_Driver] = DriverRegistry()
    reg.add("job", _Driver())
    with dask.config.set({"ddp.detached.keep": 0}):
        reg.end("job")
    assert reg.get("job") is None


def test_ending_runs_the_body_under_the_lock_then_counts_the_key():
    reg: DriverRegistry[_Driver] = DriverRegistry()
    driver = reg.add("a", _Driver())
    with reg.ending("a"):
        assert reg.lock.locked() and "a" not in reg.ended  # another thread sees the change and the count together
        driver.state = "FINISHED"
    assert not reg.lock.locked() and list(reg.ended) == ["a"] and reg.get("a") is driver


def test_a_body_that_raises_leaves_the_key_uncounted_and_the_lock_free():
    reg: DriverRegistry[_Driver] = DriverRegistry()
    reg.add("a", _Driver())
    with pytest.raises(RuntimeError, match="body"), reg.ending("a"):
        raise RuntimeError("body")
    assert not reg.lock.locked() and not reg.ended and reg.get("a") is not None


def test_many_threads_adding_and_ending_at_once_leave_exactly_keep_ended():
    reg: DriverRegistry[_Driver] = DriverRegistry(forgettable=_ended)
    go = threading.Barrier(8)

    def worker(t: int) -> None:
        go.wait()
        for i in range(200):
            key = f"{t}-{i}"
            driver = reg.add(key, _Driver())
            with reg.ending(key):
                driver.state = "FINISHED"

    with dask.config.set({"ddp.detached.keep": 7}):
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    assert not any(th.is_alive() for th in threads)
    assert len(reg.ended) == 7 and sorted(reg.drivers) == sorted(reg.ended)


# ---- its users, driven in this process as the scheduler's would -------------------------------------------------
@pytest.fixture
def refused_scheduler():
    """A stand-in for the scheduler handed to a driver: its address is bound, never listening (a driver's client
    is refused and gives up after 1 s)."""
    with socket.socket() as held, dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        held.bind(("127.0.0.1", 0))
        yield type("S", (), {"address": f"tcp://127.0.0.1:{held.getsockname()[1]}", "security": None})()


def _spec(run_id: str) -> LaunchSpec:
    plan = make_plan(workers_from_scheduler_info({"workers": {"tcp://127.0.0.1:1": {"host": "127.0.0.1",
                                                                                    "name": "w0"}}}))
    return LaunchSpec(call=b"", fn_name="train", run_id=run_id, first_plan=plan, name=run_id)


def test_detached_jobs_past_keep_are_forgotten_oldest_first(refused_scheduler):
    first, second = (f"registry-{uuid.uuid4().hex[:8]}" for _ in range(2))
    assert detach._DRIVERS is detach._JOBS.drivers and detach._ENDED is detach._JOBS.ended
    assert detach._LOCK is detach._JOBS.lock  # the parts tests reach (test_scheduler_trust, test_job_handle)
    try:
        with dask.config.set({"ddp.detached.keep": 1}):
            detach._start(cloudpickle.dumps(_spec(first)), dask_scheduler=refused_scheduler)
            wait_until(lambda: [f["state"] for f in detach._find(first)] == ["FAILED"], 30, what="the first's end")
            detach._start(cloudpickle.dumps(_spec(second)), dask_scheduler=refused_scheduler)
            wait_until(lambda: detach._find(first) == [], 30, what="the first job forgotten")
        assert [f["state"] for f in detach._find(second)] == ["FAILED"]
        assert detach._spec(second).call == b""  # an ended job's spec keeps no pickled function
    finally:
        with detach._JOBS.lock:
            for run_id in (first, second):
                detach._JOBS.drivers.pop(run_id, None)
                if run_id in detach._JOBS.ended:
                    detach._JOBS.ended.remove(run_id)


def test_a_detached_sweep_that_took_an_ended_sweeps_name_is_kept(refused_scheduler):
    name = f"registry-{uuid.uuid4().hex[:8]}"
    spec = types.SimpleNamespace(name=name)  # what the driver reads of a spec before its client is up
    try:
        old = sweep_detach._SWEEPS.add(name, sweep_detach._Held(spec, None))
        new = sweep_detach._SWEEPS.add(name, sweep_detach._Held(spec, None))  # the name taken again, still starting
        with dask.config.set({"ddp.detached.keep": 0}):
            sweep_detach._drive(refused_scheduler.address, old, {}, {"storage": None, "study_name": name})
            assert "failed" in old.error and sweep_detach._SWEEPS.get(name) is new  # its turn passed; new stays
            sweep_detach._drive(refused_scheduler.address, new, {}, {"storage": None, "study_name": name})
        assert sweep_detach._find(name) is None  # the new one ended (FAILED): forgotten at its turn
    finally:
        with sweep_detach._SWEEPS.lock:
            sweep_detach._SWEEPS.drivers.pop(name, None)
            while name in sweep_detach._SWEEPS.ended:
                sweep_detach._SWEEPS.ended.remove(name)
