"""Detached jobs: ``run(..., detach=True)`` keeps a job running without its client; :func:`attach` finds it again.

Runs in: the scheduler's process (the driver: :func:`_start`, :func:`_find`, :func:`_spec`,
:func:`_snapshot`, :func:`_cancel`, called through ``client.run_on_scheduler``) and the client
(:func:`launch`, :func:`attach`, :class:`RemoteControl`).

A job's controller normally runs in the client and the job ends with it (see
:mod:`dask_ddp.worker.supervisor`: a rank whose task its client released stops). A
detached job's controller runs in a thread of the scheduler's process instead,
with a Dask client of its own: the scheduler outlives notebooks, and the job
lives as long as the scheduler. Any client (a new kernel) can then attach by
name or run id and read the job through a :class:`~dask_ddp.client.job.Job` of its own, the
same handle as a local job's, with the job's own :class:`~dask_ddp.wire.spec.LaunchSpec`
(``checkpoint_dir``, ``name``, ...): live metrics and logs (from the job's first held event on),
state, history, ``result()`` and ``cancel()``. Its :class:`RemoteControl` polls the driver every
``ddp.detached.poll-interval`` seconds and never talks to a worker.

The scheduler keeps the last ``ddp.detached.keep`` ended jobs for later attaching, each trimmed to what
:func:`attach` reads (:class:`_Ended`: its state, history and plan, the reports and lines its record held,
packed, and its outcome still pickled); a rank's return value or exception is never unpickled there (an
exception's ``__reduce__`` could run code in the scheduler's process). Detached jobs
take no callbacks: they would run in the scheduler; a follower's ``stream()``
gives the same events. dask-ddp must be installed where the scheduler runs
(the image of ``docker/`` has it).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import zlib
from typing import TYPE_CHECKING

import cloudpickle
import dask

from dask_ddp.client.cluster import check_client
from dask_ddp.client.control import LocalControl, new_record
from dask_ddp.client.job import Job
from dask_ddp.client.record import ENDED, JobRecord, format_log
from dask_ddp.client.registry import DriverRegistry
from dask_ddp.wire.errors import DaskDDPError, PickledRankError
from dask_ddp.wire.events import items_of, pack_items
from dask_ddp.wire.spec import LaunchSpec

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["launch", "attach", "RemoteControl", "DetachedJobNotFound"]

_BATCH = 5000  # events per poll at most


class DetachedJobNotFound(DaskDDPError, LookupError):
    """No detached job of that name or run id is known to the scheduler (or several match a name)."""


# ---- the driver, in the scheduler's process -------------------------------------------------------------------
def _summary(record: JobRecord, plan) -> dict:
    """What a poll of the job reads besides its events (call under ``record.cond``)."""
    return {"state": record.state, "history": list(record.history), "plan": plan, "telemetry": dict(record.telemetry),
            "stragglers": dict(record.stragglers), "created": record.created, "dropped": dict(record.dropped),
            "drop_reasons": dict(record.drop_reasons), "goodput": copy.deepcopy(record.goodput)}


def _outcome(record: JobRecord) -> bytes:
    """The job's error and values pickled for the client: the values and a rank's error are still pickled inside
    (bytes, and a :class:`~dask_ddp.wire.errors.PickledRankError`); the driver's own error as it is, or its text
    when it does not pickle."""
    try:
        return cloudpickle.dumps((record.error, record.values))
    except Exception as exc:  # noqa: BLE001 - a driver's error that does not pickle: the client gets its text
        error = DaskDDPError(f"{record.error!r} (it could not be pickled for the client: {exc!r})")
        return cloudpickle.dumps((error, record.values))


class _Ended:
    """An ended detached job as the scheduler keeps it for :func:`attach`: what a poll reads (:func:`_summary`),
    its outcome still pickled, and its events (the reports and lines its record held, at most
    ``ddp.events.max-record-bytes`` / 4 packed) in chunks of ``_BATCH``, msgpack-packed and compressed: measured
    with tracemalloc in the scheduler's process, 2 ranks' 40,000 reports of 4 keys took 18 MiB as the record held
    them, 0.5 MiB here. Its Job handle, controller and attempt, the driver's client and the job's pickled function
    go."""

    def __init__(self, record: JobRecord, plan) -> None:
        with record.cond:
            self.summary, events = _summary(record, plan), list(record.events)
            self.n, self.state = record.n_events, record.state
            self.outcome = _outcome(record)
        self.first = self.n - len(events)
        self.chunks = [zlib.compress(pack_items(events[i:i + _BATCH]), 1) for i in range(0, len(events), _BATCH)]

    def snapshot(self, n: int) -> dict:
        """Up to ``_BATCH`` events from number ``n`` on (those dropped before the job ended are skipped)."""
        start = max(n, self.first) - self.first
        chunk, skip = divmod(start, _BATCH)
        events: list[dict] = []
        while chunk < len(self.chunks) and len(events) < _BATCH:
            events += items_of({"items": zlib.decompress(self.chunks[chunk])})[skip:]
            chunk, skip = chunk + 1, 0
        events = events[:_BATCH]
        after = self.first + start + len(events)
        settled = after == self.n
        return {**self.summary, "events": events, "n": after, "settled": settled,
                **({"outcome": self.outcome} if settled else {})}


@dataclasses.dataclass
class _Driver:
    """One detached job as the scheduler's process holds it: its spec and record from the start (a driver that
    cannot start is a FAILED record), its handle once the driver's client is connected; once it has ended, only
    ``ended`` (the record and the handle go, and so does the spec's pickled function)."""

    spec: LaunchSpec
    record: JobRecord | None
    job: Job | None = None
    cancel_asked: bool = False  # cancel() came before the handle: the driver cancels the job once started
    ended: _Ended | None = None

    @property
    def state(self) -> str:
        """The job's state: its record's while it runs, what it kept once it has ended."""
        if self.ended is not None:
            return self.ended.state
        return self.record.state if self.record is not None else "PENDING"


_JOBS: DriverRegistry[_Driver] = DriverRegistry()  # run id -> its driver; its lock also guards a driver's fields
_DRIVERS, _ENDED, _LOCK = _JOBS.drivers, _JOBS.ended, _JOBS.lock  # its parts, as tests reach them


def _start(blob: bytes, dask_scheduler=None) -> str:
    spec: LaunchSpec = cloudpickle.loads(blob)
    record = new_record(spec.run_id, spec.event_limits)
    driver = _JOBS.add(spec.run_id, _Driver(spec, record))
    # the driver's client speaks to the scheduler as its workers do: with its security (TLS) settings
    threading.Thread(target=_drive, args=(dask_scheduler.address, driver, record, dask_scheduler.security),
                     name=f"dask-ddp-driver-{spec.run_id}", daemon=True).start()
    return spec.run_id


def _drive(address: str, driver: _Driver, record: JobRecord, security=None) -> None:
    from distributed import Client

    spec = driver.spec
    try:
        with Client(address, security=security, set_as_default=False) as client:
            job = Job(client, spec, LocalControl(client, spec, record, raw_results=True))._start()
            with _JOBS.lock:
                driver.job, cancel = job, driver.cancel_asked
            if cancel:
                job.cancel()
            job.wait(progress=False)
    except Exception as exc:  # noqa: BLE001 - a driver that cannot start is a FAILED job, never a PENDING one
        if not record.settled:
            record.error = exc
            record.transition("FAILED", f"the driver in the scheduler's process could not run the job: {exc!r}")
            record.settle()
    ended = _Ended(record, driver.job.plan if driver.job else None)
    with _JOBS.ending(spec.run_id):  # keep what attach() reads; the handle, its client and the record's dicts go
        driver.ended, driver.record, driver.job = ended, None, None
        driver.spec = dataclasses.replace(spec, call=b"")


def _find(name: str, dask_scheduler=None) -> list[dict]:
    drivers = _JOBS.values()
    return [{"run_id": d.spec.run_id, "name": d.spec.name or d.spec.fn_name, "state": d.state}
            for d in drivers if name in (d.spec.run_id, d.spec.name or d.spec.fn_name)]


def _spec(run_id: str, dask_scheduler=None) -> LaunchSpec | None:
    driver = _JOBS.get(run_id)
    return None if driver is None else driver.spec


def _snapshot(run_id: str, n: int, dask_scheduler=None) -> dict | None:
    with _JOBS.lock:
        driver = _JOBS.drivers.get(run_id)
        if driver is None:
            return None
        record, job, ended = driver.record, driver.job, driver.ended
    if ended is not None:
        return ended.snapshot(n)
    if record is None:  # never: a driver holds its record until it has ended
        return None
    with record.cond:
        events, after = record.events_since(n, _BATCH)
        out = {**_summary(record, job.plan if job else None), "events": events, "n": after,
               "settled": record.settled and after == record.n_events}
        if out["settled"]:
            out["outcome"] = _outcome(record)
    return out


def _cancel(run_id: str, dask_scheduler=None) -> bool:
    with _JOBS.lock:
        driver = _JOBS.drivers.get(run_id)
        if driver is None:
            return False
        job = driver.job
        if driver.ended is not None:  # nothing left to cancel
            return True
        if job is None:  # its driver is still connecting
            driver.cancel_asked = True
            return True
    threading.Thread(target=job.cancel, name=f"dask-ddp-cancel-{run_id}", daemon=True).start()  # not on the loop
    return True


# ---- the client's side ----------------------------------------------------------------------------------------
def launch(client, spec: LaunchSpec) -> Job:
    """Start ``spec`` with its controller in the scheduler's process; return a :class:`Job` following it.

    ``spec`` has no callbacks (``run`` refuses them with ``detach=True``: they would run in the scheduler).
    Raises nothing of its own.
    """
    driven = dataclasses.replace(spec, echo_logs=False)  # the scheduler's output is nobody's to read
    client.run_on_scheduler(_start, cloudpickle.dumps(driven))
    return Job(client, spec, RemoteControl(client, spec))._start()


def attach(client: Client, name: str, *, progress: bool | None = None) -> Job:
    """Follow a detached job (``run(..., detach=True)``) by its name or run id, from any client of its cluster.

    The handle is a :class:`~dask_ddp.client.job.Job` with the job's own spec: ``checkpoint_dir``,
    ``metrics``, ``logs``, ``stream()``, ``state``, ``history``, ``result()``, ``wait()`` and ``cancel()``
    work as for the job's own handle; its metrics start from the oldest report the scheduler still holds
    (``ddp.events.max-rows``). ``progress`` defaults to the job's own setting.

    Raises
    ------
    DetachedJobNotFound
        No detached job of that name or run id is known to this cluster's scheduler (it has restarted, or
        the job ended more than ``ddp.detached.keep`` jobs ago), or several running jobs share the name.
    ClientClosedError
        The client is not connected.
    TypeError
        An asynchronous client called from its event loop (call attach in a thread).
    """
    check_client(client)
    found = client.run_on_scheduler(_find, name)
    if len(found) > 1:
        running = [f for f in found if f["state"] not in ENDED]
        found = running if len(running) == 1 else found
    if len(found) != 1:
        known = ", ".join(f"{f['run_id']} ({f['state']})" for f in found) or "none"
        raise DetachedJobNotFound(f"{'several' if found else 'no'} detached jobs named {name!r} on this cluster's "
                                  f"scheduler (matching: {known}); attach by run id")
    run_id = found[0]["run_id"]
    spec = client.run_on_scheduler(_spec, run_id)
    if spec is None:  # it ended and was forgotten between the two questions
        raise DetachedJobNotFound(f"the scheduler no longer knows detached job {run_id} (it ended more than "
                                  "ddp.detached.keep jobs ago)")
    spec = dataclasses.replace(spec, echo_logs=dask.config.get("ddp.echo-logs"),
                               progress=spec.progress if progress is None else progress)
    return Job(client, spec, RemoteControl(client, spec))._start()


class RemoteControl:
    """The control of a :class:`~dask_ddp.client.job.Job` whose driver runs in the scheduler's process.

    A thread polls the driver into ``record`` (and ``plan``); ``cancel`` asks the driver. There is no
    ``attempt`` (its futures live with the driver) and no callback runs here; Ctrl-C leaves the job running.
    """

    attempt = None

    def __init__(self, client, spec: LaunchSpec):
        self.client, self.run_id, self.echo = client, spec.run_id, spec.echo_logs
        self.record = new_record(spec.run_id, spec.event_limits)
        self.plan = None
        self._thread = threading.Thread(target=self._follow, name=f"dask-ddp-follow-{self.run_id}", daemon=True)

    def bind(self, job) -> None:
        """Nothing to bind: a detached job has no callbacks."""

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self.client.run_on_scheduler(_cancel, self.run_id)

    def stop(self, cause: str, grace: float) -> None:
        """A detached job is cancelled (its driver takes no stop request)."""
        self.cancel()

    def in_driver_thread(self) -> bool:
        return False  # the driver's thread is in the scheduler's process; this one's polling runs no callback

    def interrupted(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C while waiting on a detached job: it keeps running (it is meant to outlive the notebook)."""
        exc.add_note(f"[dask-ddp] interrupted: detached job {self.run_id} keeps running; "
                     f"dask_ddp.attach(client, {self.run_id!r}).cancel() stops it")

    def _follow(self) -> None:
        n, interval = 0, dask.config.get("ddp.detached.poll-interval")
        while True:
            try:
                snap = self.client.run_on_scheduler(_snapshot, self.run_id, n)
            except Exception:  # noqa: BLE001 - the scheduler is unreachable for now, or this client closed
                if self.client.status in ("closing", "closed"):
                    return
                time.sleep(interval)
                continue
            if snap is None:
                self.record.error = DetachedJobNotFound(f"the scheduler no longer knows detached job {self.run_id} "
                                                        "(it restarted, or the job ended long ago)")
                self.record.transition("FAILED", str(self.record.error))
                self.record.settle()
                return
            n = self._take(snap)
            if snap["settled"]:
                return
            if len(snap["events"]) < _BATCH:  # a full batch: more are waiting, ask again at once
                time.sleep(interval)

    def _take(self, snap: dict) -> int:
        record, self.plan = self.record, snap.get("plan")
        if snap["events"]:
            record.add(snap["events"])
            if self.echo:
                from dask_ddp.observe.progress import Progress

                for item in snap["events"]:
                    if item.get("kind") == "log":
                        Progress.write(format_log(item), item.get("stream") == "stderr")
        with record.cond:
            record.state, record.history = snap["state"], snap["history"]
            record.telemetry, record.stragglers = snap.get("telemetry", {}), snap.get("stragglers", {})
            record.created = snap.get("created", record.created)
            record.dropped, record.drop_reasons = snap.get("dropped", {}), snap.get("drop_reasons", {})
            record.goodput = snap.get("goodput", record.goodput)
            if snap["settled"]:
                error, values = cloudpickle.loads(snap["outcome"])  # the values and a rank's error still pickled
                record.error = error.load() if isinstance(error, PickledRankError) else error
                record.values = None if values is None else [cloudpickle.loads(v) for v in values]
                record.settled = True
            record.cond.notify_all()
        return snap["n"]
