"""What the scheduler's process holds for detached jobs and sweeps: never a rank's object unpickled, bounded sizes.

Real parts: a ``dask scheduler`` in a process of its own (started in a folder of its own, with
``ddp.detached.max-result-bytes`` lowered to ``CAP``), two ``dask worker`` processes, gloo, Optuna with SQLite
files. A hostile object is one whose ``__reduce__`` records the process that unpickles it (a marker file of
pids): the scheduler's pid must never be there. Every detached job and sweep is stopped whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid

import cloudpickle
import optuna
import pytest
from _cluster import CliWorkers, detached, no_running_ranks, wait_until
from dask.distributed import Client

import dask_ddp
from dask_ddp.sweeps.detach import absolute_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)
CAP = 1_000_000  # ddp.detached.max-result-bytes of the module's scheduler
# this module's functions and classes ship by value: the scheduler's process cannot import a test module, and it
# unpickles a detached sweep's spec (run() ships a user's module by value itself; a detached sweep does not yet)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- what the ranks run (in the rank processes) -----------------------------------------------------------
def _unpickled_in(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def _value_unpickled_in(path):
    _unpickled_in(path)
    return "a rank's own value, unpickled"


def _error_unpickled_in(path):
    _unpickled_in(path)
    return ValueError("a rank's own error, unpickled")


class Bomb:
    """A return value whose unpickling records the process it ran in."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (_value_unpickled_in, (self.path,))


class BombError(Exception):
    """An exception whose unpickling records the process it ran in (and gives a ValueError)."""

    def __init__(self, path):
        super().__init__(path)
        self.path = path

    def __reduce__(self):
        return (_error_unpickled_in, (self.path,))


class HugeError(Exception):
    """An exception that carries ``n`` bytes in a field."""

    def __init__(self, n):
        super().__init__("huge")
        self.payload = b"x" * n


def trial(mode, marker, n=0):
    """A sweep's trial: one report of the metric, then it returns or raises what ``mode`` says."""
    dask_ddp.report(loss=1.0, step=0)
    if mode == "return":
        return Bomb(marker)
    if mode == "raise":
        raise BombError(marker)
    if mode == "big":
        return b"x" * n
    raise HugeError(n)


def raises(what, marker, n=0):
    """A detached job's rank: rank 1 raises (a hostile exception, or a huge one), rank 0 waits to be stopped."""
    import time

    if dask_ddp.get_context().rank == 1:
        raise BombError(marker) if what == "hostile" else HugeError(n)
    time.sleep(600)


def reports(n):
    for step in range(n):
        dask_ddp.report(step=step, loss=1.0 / (step + 1), acc=0.5, lr=1e-3)
    return dask_ddp.get_context().rank


def quick(lr):
    dask_ddp.report(loss=lr, step=0)


# ---- on the scheduler ------------------------------------------------------------------------------------------
def _trace_start(dask_scheduler=None):
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start(1)


def _held_by_driver(run_id, dask_scheduler=None):
    """Bytes that detached job ``run_id``'s driver keeps (traced memory freed by forgetting it), and the number of
    events it held; tracing stops."""
    import gc
    import tracemalloc

    from dask_ddp.client import detach

    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    with detach._LOCK:
        driver = detach._DRIVERS.pop(run_id)
        with contextlib.suppress(ValueError):
            detach._ENDED.remove(run_id)
    ended = getattr(driver, "ended", None)
    events = ended.n - ended.first if ended is not None else len(driver.record.events)
    del ended
    del driver
    gc.collect()
    freed = before - tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return freed, events


# ---- the cluster -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A ``dask scheduler`` in a process (and folder) of its own, and two ``dask worker`` processes."""
    folder = tmp_path_factory.mktemp("scheduler")
    file = folder / "scheduler.json"
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", "0", "--no-dashboard", "--scheduler-file", str(file)], cwd=folder,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "DASK_DDP__DETACHED__MAX_RESULT_BYTES": str(CAP)})
    workers = None
    try:
        wait_until(file.exists, 60, what="the scheduler's file")
        with Client(scheduler_file=str(file), timeout=60) as client:
            workers = CliWorkers(client.scheduler.address)
            workers.start("w1"), workers.start("w2")
            client.wait_for_workers(2, timeout=120)
            client.scheduler_folder = folder
            yield client
    finally:
        if workers is not None:
            workers.close()
        scheduler.terminate()
        scheduler.wait(30)


@contextlib.contextmanager
def stopped(client, name):
    """Around a detached sweep named ``name``: on the way out it is cancelled (if it is still known) and its ranks
    are gone, whatever happened."""
    try:
        yield
    finally:
        with contextlib.suppress(dask_ddp.SweepNotFound):
            dask_ddp.attach_sweep(client, name, progress=False).cancel(120)
        wait_until(lambda: no_running_ranks(client), 60, what="every trial's ranks stopped")


def _pids(marker) -> set[int]:
    return {int(p) for p in marker.read_text().split()} if marker.exists() else set()


# ---- rank errors and trial values stay bytes in the scheduler ---------------------------------------------
@pytest.mark.slow
def test_a_detached_jobs_rank_error_is_unpickled_only_by_the_client(plain, tmp_path):
    """A rank raises an exception whose unpickling runs code: the job's driver in the scheduler's process keeps it
    pickled, and the client that reads the job gets the rank's own exception (unpickled there), notes kept."""
    marker, scheduler_pid = tmp_path / "unpickled", plain.run_on_scheduler(os.getpid)
    name = f"hostile-{uuid.uuid4().hex[:6]}"
    with detached(plain, name):
        job = dask_ddp.dispatch.run(plain, raises, "hostile", str(marker), name=name, detach=True, progress=False)
        with pytest.raises(ValueError, match="a rank's own error, unpickled") as got:
            job.result(timeout=180)
        assert any("other ranks: rank 0 was stopped" in note for note in got.value.__notes__), got.value.__notes__
        assert scheduler_pid not in _pids(marker), "a rank's exception was unpickled inside the scheduler's process"
        with pytest.raises(ValueError, match="a rank's own error, unpickled"):  # another client attaches: the same
            dask_ddp.attach(plain, name).result(timeout=60)
    assert _pids(marker) == {os.getpid()}, _pids(marker)


@pytest.mark.slow
def test_a_detached_jobs_huge_rank_error_is_refused_with_a_clear_error(plain):
    name = f"huge-{uuid.uuid4().hex[:6]}"
    with detached(plain, name):
        job = dask_ddp.dispatch.run(plain, raises, "huge", "", 2 * CAP, name=name, detach=True, progress=False)
        with pytest.raises(dask_ddp.RankFailedError, match=r"rank 1 on worker .* raised an exception of [\d,]+ bytes "
                           r"pickled, over ddp\.detached\.max-result-bytes \(1,000,000\)"):
            job.result(timeout=180)


@pytest.mark.slow
def test_a_detached_sweeps_trial_values_and_errors_are_unpickled_only_by_its_clients(plain, tmp_path):
    """Trials that return a hostile object, raise a hostile exception, return too much, raise a huge exception:
    the sweep's driver in the scheduler's process unpickles none of them; the over-sized ones fail with a clear
    error; a client that attaches (another one) reads the hostile trial's own error."""
    marker, scheduler_pid = tmp_path / "unpickled", plain.run_on_scheduler(os.getpid)
    name = f"hostile-sweep-{uuid.uuid4().hex[:6]}"
    with stopped(plain, name):
        s = dask_ddp.sweep(plain, trial, {"mode": ["return", "raise", "big", "huge"]}, n_trials=4, metric="loss",
                           sampler="grid", scheduler="none", max_failures=None, name=name, detach=True,
                           progress=False, kwargs={"marker": str(marker), "n": 2 * CAP})
        assert s.wait(300), s.results()
        with Client(plain.scheduler.address) as other:
            df = dask_ddp.attach_sweep(other, name, progress=False).results().set_index("params_mode")
    assert scheduler_pid not in _pids(marker), "a trial's value or exception was unpickled in the scheduler"
    assert _pids(marker) == {os.getpid()}, _pids(marker)  # the hostile error, loaded by the clients that follow
    assert df.loc["return", "state"] == "COMPLETE", df.loc["return", "error"]
    assert df.loc["raise", "state"] == "FAILED"
    assert "ValueError: a rank's own error, unpickled" in df.loc["raise", "error"], df.loc["raise", "error"]
    assert df.loc["raise", "error"].startswith(f"trial {df.loc['raise', 'trial']} (job ")
    assert df.loc["big", "state"] == "FAILED"
    assert "rank 0 returned" in df.loc["big", "error"] and "ddp.detached.max-result-bytes" in df.loc["big", "error"]
    assert df.loc["huge", "state"] == "FAILED"
    assert "raised an exception of" in df.loc["huge", "error"] and "max-result-bytes" in df.loc["huge", "error"]


# ---- a detached sweep's relative SQLite storage -------------------------------------------------------------
def test_a_relative_sqlite_storage_is_made_absolute_on_the_client(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_storage("sqlite:///sweep.db") == f"sqlite:///{tmp_path}/sweep.db"
    assert absolute_storage("sqlite:///runs/s.db?timeout=30") == f"sqlite:///{tmp_path}/runs/s.db?timeout=30"
    for kept in ("sqlite:////abs/s.db", "sqlite:///:memory:", "postgresql://u@h/db", None, 5):
        assert absolute_storage(kept) == kept


@pytest.mark.slow
def test_a_detached_sweeps_relative_sqlite_study_is_the_one_the_client_reads(plain, tmp_path, monkeypatch):
    """``storage="sqlite:///sweep.db"``: the scheduler runs in another folder; the study the sweep fills is the
    file in this client's folder, the one ``sweep.study`` reads, and none is made in the scheduler's."""
    monkeypatch.chdir(tmp_path)
    name = f"sqlite-{uuid.uuid4().hex[:6]}"
    with stopped(plain, name):
        s = dask_ddp.sweep(plain, quick, {"lr": [0.1, 0.2, 0.3]}, n_trials=3, metric="loss", sampler="grid",
                           scheduler="none", name=name, detach=True, progress=False, storage="sqlite:///sweep.db")
        assert s.wait(300), s.results()
    assert s.counts()["COMPLETE"] == 3, s.results()
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/sweep.db")
    assert len(study.trials) == 3 and {t.state.name for t in study.trials} == {"COMPLETE"}
    assert len(s.study.trials) == 3
    assert not (plain.scheduler_folder / "sweep.db").exists()


# ---- what an ended detached job keeps ---------------------------------------------------------------------------
@pytest.mark.slow
def test_an_ended_detached_job_keeps_its_reports_packed(plain):
    """2 ranks x 5,000 reports: the scheduler's driver keeps them for attach() (every one reaches a handle that
    attaches after the end) in a fraction of what they took as the record's dicts (measured with tracemalloc in
    the scheduler's process: about 470 bytes a report before, about 15 after)."""
    name, run_id = f"kept-{uuid.uuid4().hex[:6]}", None
    plain.run_on_scheduler(_trace_start)
    try:
        with detached(plain, name):
            job = dask_ddp.dispatch.run(plain, reports, 5000, name=name, detach=True, progress=False)
            run_id = job.run_id
            assert job.result(timeout=300) == [0, 1]
            again = dask_ddp.attach(plain, name)
            assert again.wait(120)
            columns = ["rank", "step", "loss", "acc", "lr"]
            assert again.metrics[columns].equals(job.metrics[columns]) and len(job.metrics) >= 5000
    finally:
        freed, events = plain.run_on_scheduler(_held_by_driver, run_id) if run_id else (0, 0)
    print(f"an ended detached job of {events} reports keeps {freed / 2**20:.2f} MiB in the scheduler "
          f"({freed / max(events, 1):.0f} bytes a report)")
    assert events == len(job.metrics)
    assert freed < 100 * events + (256 << 10), f"{freed / 2**20:.1f} MiB kept for {events} reports"
