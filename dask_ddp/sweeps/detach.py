"""Detached sweeps: ``sweep(..., detach=True)`` runs the sweep's driver in the scheduler's process, so that the
sweep outlives the notebook; :func:`dask_ddp.attach_sweep` finds it again from any client (a new kernel).

Runs in: the scheduler's process (the driver's thread and :func:`_start`, :func:`_find`, :func:`_snapshot`,
:func:`_stop`, called through ``client.run_on_scheduler``) and the client (:func:`launch`,
:func:`find`, :class:`RemoteDriver`; :func:`dask_ddp.attach_sweep` is in :mod:`.handle`).

A sweep's state is its driver's: the Optuna study (every trial's parameters, intermediate values and end, in
the study's ``storage``: in memory in the process that holds the driver unless a URL is given), the trials'
records (placement, steps, state, errors) and the decisions (pruned at, stopped at). A sweep started in the
notebook keeps them in the notebook's process and ends with it: a client that dies or closes without detaching
stops every trial (their ranks stop as a job's do when its client goes). A detached sweep keeps them in the
scheduler's process, as a detached job's driver does (:mod:`dask_ddp.client.detach`): the sweep and its trials
run on while no notebook is connected, and a :class:`RemoteDriver` polls the driver every
``ddp.detached.poll-interval`` seconds for the handle (:class:`~.handle.Sweep`), whose
``results()``, ``best``, ``counts()``, ``wait()`` and ``cancel()`` work as for the sweep's own handle.
``sweep.study`` is loaded from ``storage`` when that is a URL (a relative ``sqlite:///sweeps.db`` is made absolute
on the client first, :func:`absolute_storage`: the scheduler's working folder is another), else it is None in an
attached handle. The scheduler keeps the last ``ddp.detached.keep`` ended sweeps. Nothing a trial returns or
raises is unpickled in the scheduler's process (:class:`SchedulerDriver`). dask-ddp (and Optuna) must be
installed where the scheduler runs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from typing import Any

import cloudpickle
import dask

from dask_ddp.client.cluster import check_client
from dask_ddp.client.registry import DriverRegistry
from dask_ddp.sweeps import names as sweep_names
from dask_ddp.sweeps.driver import Driver, SweepSpec
from dask_ddp.sweeps.trial import TrialRecord
from dask_ddp.wire.errors import DaskDDPError

__all__ = ["launch", "find", "RemoteDriver", "SweepNotFound", "SchedulerDriver", "absolute_storage"]

ENDED = ("FINISHED", "FAILED", "CANCELLED")
_SQLITE = "sqlite:///"  # SQLAlchemy's URL of a SQLite file: a relative path after it, an absolute one after four


class SweepNotFound(DaskDDPError, LookupError):
    """No detached sweep of that name is known to the cluster's scheduler."""


# ---- in the scheduler's process --------------------------------------------------------------------------
class SchedulerDriver(Driver):
    """The driver of a detached sweep, in the scheduler's process: its trials' jobs keep their ranks' return values
    and exceptions pickled (``dispatch.start(pickled=True)``; values at most ``ddp.detached.max-result-bytes``, as a
    detached job's), since unpickling one runs whatever its ``__reduce__`` names; a failed trial's exception reaches
    the client that follows the sweep (``TrialRecord.failure``), which unpickles it."""

    pickled_results = True


class _Held:
    """A detached sweep as the scheduler's process holds it: its spec, and its driver once its client is up."""

    def __init__(self, spec: SweepSpec, storage: Any) -> None:
        self.spec, self.storage = spec, storage
        self.driver: Driver | None = None
        self.stop_asked: tuple[str, str] | None = None
        self.error = ""


# name -> its sweep; an ended name's sweep goes only if it has ended (a new sweep of that name may have started)
_SWEEPS: DriverRegistry[_Held] = DriverRegistry(forgettable=lambda held: _state(held) in ENDED)


def _start(blob: bytes, dask_scheduler=None) -> str:
    spec, searched, study_kw = cloudpickle.loads(blob)
    with sweep_names.LOCK:  # the name is the sweep's until its driver ends (below, in _drive)
        refused = sweep_names.take(spec.name, sweep_names.DETACHED, dask_scheduler)
    if refused:
        raise sweep_names.refusal(refused)
    held = _SWEEPS.add(spec.name, _Held(spec, study_kw["storage"]))
    threading.Thread(target=_drive, args=(dask_scheduler.address, held, searched, study_kw,
                                          dask_scheduler.security), name=f"dask-ddp-sweep-{spec.name}",
                     daemon=True).start()
    return spec.name


def _drive(address: str, held: _Held, searched: dict, study_kw: dict, security=None) -> None:
    import optuna
    from distributed import Client

    try:
        with Client(address, security=security, set_as_default=False) as client:
            study = optuna.create_study(load_if_exists=True, **study_kw)
            driver = SchedulerDriver(client, held.spec, study, searched)
            with _SWEEPS.lock:
                held.driver, stop = driver, held.stop_asked
            if stop:
                driver.stop(*stop)
            driver.run()  # in this thread: it returns once every trial has ended
    except Exception as exc:  # noqa: BLE001 - a driver that cannot start is a FAILED sweep
        held.error = f"the detached sweep's driver in the scheduler's process failed: {exc!r}"
    sweep_names.scheduler_release(held.spec.name, sweep_names.DETACHED)
    _SWEEPS.end(held.spec.name)


def _state(held: _Held) -> str:
    if held.driver is not None:
        return held.driver.state
    return "FAILED" if held.error else "RUNNING"


def _find(name: str, dask_scheduler=None) -> tuple[bytes, Any] | None:
    held = _SWEEPS.get(name)
    return None if held is None else (cloudpickle.dumps(held.spec), held.storage)


def _snapshot(name: str, loaded: list[int] | None = None, dask_scheduler=None) -> dict | None:
    """The sweep's state and trials; a failed trial's pickled exception only for a trial not in ``loaded`` (the
    client has it already)."""
    held = _SWEEPS.get(name)
    if held is None:
        return None
    driver = held.driver
    if driver is None:
        return {"state": _state(held), "cause": held.error, "trials": []}
    with driver.cond:
        trials = [copy.copy(r) for r in driver.trials.values()]
        state, cause = driver.state, driver.cause
    known = set(loaded or ())
    for r in trials:
        r.keys = set(r.keys)
        if r.number in known:
            r.failure = None
    return {"state": state, "cause": cause, "trials": cloudpickle.dumps(trials)}


def _stop(name: str, state: str, cause: str, dask_scheduler=None) -> bool:
    with _SWEEPS.lock:
        held = _SWEEPS.drivers.get(name)
        if held is None:
            return False
        if held.driver is None:
            held.stop_asked = (state, cause)
            return True
    held.driver.stop(state, cause)
    return True


def _resume(name: str, number: int, ranks: int | None, params: dict | None, dask_scheduler=None) -> bool:
    held = _SWEEPS.get(name)
    if held is None or held.driver is None or held.driver.state in ENDED:
        return False
    held.driver.resume(number, ranks, params)
    return True


# ---- the client's side ------------------------------------------------------------------------------------
def absolute_storage(storage: Any) -> Any:
    """``storage`` with a relative SQLite path made absolute here, on the client: the detached sweep's driver opens
    it in the scheduler's process, whose working folder is another (``sqlite:///sweep.db`` would be a new, empty
    study there while this client reads its own file). Other storages as they are; the file must be where both
    processes see it at that path (one machine, or a shared file system). Raises nothing."""
    if not isinstance(storage, str) or not storage.startswith(_SQLITE):
        return storage
    path, sep, query = storage[len(_SQLITE):].partition("?")
    if not path or path == ":memory:" or os.path.isabs(path):
        return storage
    return _SQLITE + os.path.abspath(path) + sep + query


def launch(client, spec: SweepSpec, searched: dict, study_kw: dict) -> RemoteDriver:
    """Start ``spec`` with its driver in the scheduler's process; return a driver following it.

    Raises
    ------
    ValueError
        A sweep of that name runs on the cluster already (detached, or from a notebook).
    """
    client.run_on_scheduler(_start, cloudpickle.dumps((spec, searched, study_kw)))
    return RemoteDriver(client, spec.name, study_kw["storage"])


def find(client, name: str, progress: bool | None = None) -> tuple[SweepSpec, RemoteDriver]:
    """The spec of detached sweep ``name`` and a driver following it.

    Raises
    ------
    SweepNotFound
        The scheduler knows no detached sweep of that name.
    ClientClosedError
        The client is not connected.
    """
    check_client(client)
    found = client.run_on_scheduler(_find, name)
    if found is None:
        raise SweepNotFound(f"no detached sweep named {name!r} on this cluster's scheduler: it restarted, or the "
                            "sweep ended long ago (ddp.detached.keep), or it was started without detach=True")
    blob, storage = found
    spec = cloudpickle.loads(blob)
    if progress is not None:
        spec = dataclasses.replace(spec, progress=bool(progress))
    return spec, RemoteDriver(client, name, storage)


class RemoteDriver:
    """What a :class:`~.handle.Sweep` handle reads of a detached sweep: a thread polls the driver
    in the scheduler's process into ``trials``, ``state`` and ``cause`` (under ``cond``)."""

    remote = True

    def __init__(self, client, name: str, storage: Any = None) -> None:
        self.client, self.name, self.storage = client, name, storage
        self.cond = threading.Condition()
        self.trials: dict[int, TrialRecord] = {}
        self.state, self.cause = "RUNNING", ""
        self._errors: dict[int, str] = {}  # trial number -> its error, loaded here from the pickled exception
        self._study = None
        self._thread = threading.Thread(target=self._follow, name=f"dask-ddp-follow-sweep-{name}", daemon=True)

    @property
    def study(self):
        """The Optuna study, loaded from the sweep's storage when that is a URL; else None."""
        if self._study is None and isinstance(self.storage, str):
            import optuna

            self._study = optuna.load_study(study_name=self.name, storage=self.storage)
        return self._study

    def start(self) -> None:
        self._poll()
        self._thread.start()

    def stop(self, state: str, cause: str) -> None:
        """Ask the driver in the scheduler's process to stop the sweep."""
        self.client.run_on_scheduler(_stop, self.name, state, cause)

    def resume(self, number: int, ranks: int | None, params: dict | None) -> None:
        """Ask the driver in the scheduler's process for a trial continuing trial ``number``.

        Raises
        ------
        ValueError
            The sweep has ended (a detached sweep's driver is gone once it ends).
        """
        if not self.client.run_on_scheduler(_resume, self.name, number, ranks, params):
            raise ValueError(f"detached sweep {self.name} has ended: start a new sweep to continue trial {number}")

    def _follow(self) -> None:
        interval = dask.config.get("ddp.detached.poll-interval")
        while self.state not in ENDED:
            time.sleep(interval)
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the scheduler is unreachable for now, or this client closed
                if self.client.status in ("closing", "closed"):
                    return

    def _poll(self) -> None:
        snap = self.client.run_on_scheduler(_snapshot, self.name, list(self._errors))
        trials = cloudpickle.loads(snap["trials"]) if snap and snap["trials"] else None
        for r in trials or ():  # a failed trial's exception: unpickled here, the user's process, once
            if r.failure is not None:
                r.load_failure()
                self._errors[r.number] = r.error
            elif r.number in self._errors:
                r.error = self._errors[r.number]
        with self.cond:
            if snap is None:
                self.state, self.cause = "FAILED", (f"the scheduler no longer knows detached sweep {self.name} "
                                                    "(it restarted, or the sweep ended long ago)")
            else:
                if trials:
                    self.trials = {r.number: r for r in trials}
                self.state, self.cause = snap["state"], snap["cause"]
            self.cond.notify_all()
