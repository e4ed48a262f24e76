"""Detached jobs: ``run(..., detach=True)`` keeps a job running without its client; :func:`attach` finds it again.

Runs in: the scheduler's process (the driver: :func:`_start`, :func:`_find`, :func:`_snapshot`,
:func:`_cancel`, called through ``client.run_on_scheduler``) and the client (:func:`launch`,
:func:`attach`, :class:`Follower`).

A job's controller normally runs in the client and the job ends with it (see
:mod:`dask_ddp.worker.supervisor`: a rank whose task its client released stops). A
detached job's controller runs in a thread of the scheduler's process instead,
with a Dask client of its own: the scheduler outlives notebooks, and the job
lives as long as the scheduler. Any client (a new kernel) can then attach by
name or run id and read the job as its own :class:`~dask_ddp.client.job.Job`: live
metrics and logs (from the job's first held event on), state, history,
``result()`` and ``cancel()``; the follower polls the driver every
``ddp.detached.poll-interval`` seconds and never talks to a worker.

The scheduler keeps the last ``ddp.detached.keep`` ended jobs (and up to
``ddp.events.max-rows`` reports of each) for later attaching. Detached jobs
take no callbacks: they would run in the scheduler; a follower's ``stream()``
gives the same events. dask-ddp must be installed where the scheduler runs
(the image of ``docker/`` has it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from types import SimpleNamespace

import cloudpickle
import dask

from dask_ddp.client.cluster import check_client
from dask_ddp.client.job import Job
from dask_ddp.client.record import JobRecord, format_log
from dask_ddp.wire.errors import DaskDDPError
from dask_ddp.wire.spec import LaunchSpec

__all__ = ["launch", "attach", "Follower", "DetachedJobNotFound"]

_BATCH = 5000  # events per poll at most

# ---- the driver, in the scheduler's process -------------------------------------------------------------------
_DRIVERS: dict[str, Job | None] = {}  # run id -> its Job (None while it starts)
_ENDED: deque[str] = deque()
_LOCK = threading.Lock()


class DetachedJobNotFound(DaskDDPError, LookupError):
    """No detached job of that name or run id is known to the scheduler (or several match a name)."""


def _start(blob: bytes, dask_scheduler=None) -> str:
    spec: LaunchSpec = cloudpickle.loads(blob)
    with _LOCK:
        _DRIVERS[spec.run_id] = None
    threading.Thread(target=_drive, args=(dask_scheduler.address, spec), name=f"dask-ddp-driver-{spec.run_id}",
                     daemon=True).start()
    return spec.run_id


def _drive(address: str, spec: LaunchSpec) -> None:
    from distributed import Client

    try:
        with Client(address, set_as_default=False) as client:
            job = Job(client, spec)
            with _LOCK:
                _DRIVERS[spec.run_id] = job
            job._start()
            job.wait(progress=False)
    except Exception as exc:  # noqa: BLE001 - a driver that cannot start is a FAILED job, never a PENDING one
        record = JobRecord(spec.run_id)
        record.error = exc
        record.transition("FAILED", f"the driver in the scheduler's process could not run the job: {exc!r}")
        record.settle()
        with _LOCK:
            _DRIVERS[spec.run_id] = SimpleNamespace(name=spec.name or spec.fn_name, state="FAILED", spec=spec,
                                                    _record=record, plan=None, cancel=lambda: None)
    with _LOCK:
        _ENDED.append(spec.run_id)
        while len(_ENDED) > dask.config.get("ddp.detached.keep"):
            _DRIVERS.pop(_ENDED.popleft(), None)


def _find(name: str, dask_scheduler=None) -> list[dict]:
    with _LOCK:
        jobs = list(_DRIVERS.items())
    return [{"run_id": run_id, "name": job.name if job else run_id, "state": job.state if job else "PENDING",
             "progress": job.spec.progress if job else True, "total": job.spec.total if job else None}
            for run_id, job in jobs if name in (run_id, job.name if job else None)]


def _snapshot(run_id: str, n: int, dask_scheduler=None) -> dict | None:
    with _LOCK:
        if run_id not in _DRIVERS:
            return None
        job = _DRIVERS[run_id]
    if job is None:
        return {"state": "PENDING", "history": [], "events": [], "n": n, "settled": False}
    record = job._record
    with record.cond:
        events, after = record.events_since(n, _BATCH)
        out = {"state": record.state, "history": list(record.history), "events": events, "n": after,
               "settled": record.settled and after == record.n_events, "plan": job.plan,
               "telemetry": dict(record.telemetry), "stragglers": dict(record.stragglers), "created": record.created}
        if out["settled"]:
            out["outcome"] = cloudpickle.dumps((record.error, record.values))
    return out


def _cancel(run_id: str, dask_scheduler=None) -> bool:
    with _LOCK:
        job = _DRIVERS.get(run_id)
    if job is None:
        return False
    threading.Thread(target=job.cancel, name=f"dask-ddp-cancel-{run_id}", daemon=True).start()  # not on the loop
    return True


# ---- the client's side ----------------------------------------------------------------------------------------
def launch(client, spec: LaunchSpec) -> Follower:
    """Start ``spec`` with its controller in the scheduler's process; return a :class:`Follower` of it.

    ``spec`` has no callbacks (``run`` refuses them with ``detach=True``: they would run in the scheduler).
    Raises nothing of its own.
    """
    driven = dataclasses.replace(spec, echo_logs=False)  # the scheduler's output is nobody's to read
    client.run_on_scheduler(_start, cloudpickle.dumps(driven))
    return Follower(client, spec.run_id, spec.name or spec.fn_name, spec.progress, spec.total)


def attach(client, name: str, *, progress: bool | None = None) -> Follower:
    """Follow a detached job (``run(..., detach=True)``) by its name or run id, from any client of its cluster.

    The handle is a :class:`~dask_ddp.client.job.Job`: ``metrics``, ``logs``, ``stream()``, ``state``,
    ``history``, ``result()``, ``wait()`` and ``cancel()`` work as for the job's own handle; its
    metrics start from the oldest report the scheduler still holds (``ddp.events.max-rows``).

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
        running = [f for f in found if f["state"] not in ("FINISHED", "FAILED", "CANCELLED")]
        found = running if len(running) == 1 else found
    if len(found) != 1:
        known = ", ".join(f"{f['run_id']} ({f['state']})" for f in found) or "none"
        raise DetachedJobNotFound(f"{'several' if found else 'no'} detached jobs named {name!r} on this cluster's "
                                  f"scheduler (matching: {known}); attach by run id")
    f = found[0]
    return Follower(client, f["run_id"], f["name"], f["progress"] if progress is None else progress, f["total"])


class _Remote:
    """What a follower asks of the driver: only ``cancel`` (and ``attempt``, which it does not know)."""

    attempt = None

    def __init__(self, client, run_id: str):
        self.client, self.run_id = client, run_id

    def cancel(self) -> None:
        self.client.run_on_scheduler(_cancel, self.run_id)


class Follower(Job):
    """A :class:`~dask_ddp.client.job.Job` whose controller runs in the scheduler's process (a detached job).

    Its record is filled by a thread that polls the driver; ``futures`` is empty and ``attempt`` None
    (they live with the driver); ``plan`` is the driver's current plan.
    """

    def __init__(self, client, run_id: str, name: str, progress: bool, total: int | None):
        events = dask.config.get("ddp.events")
        self.client, self.run_id, self.name = client, run_id, name
        self.spec = SimpleNamespace(progress=progress, total=total, name=name)
        self._record = JobRecord(run_id, events["max-rows"], events["max-lines"])
        self._ctl = _Remote(client, run_id)
        self._plan = None
        self._echo = dask.config.get("ddp.echo-logs")
        self._thread = threading.Thread(target=self._follow, name=f"dask-ddp-follow-{run_id}", daemon=True)
        self._thread.start()

    @property
    def plan(self):
        return self._plan

    def _interrupted(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C while waiting on a detached job: it keeps running (it is meant to outlive the notebook)."""
        if not self.done():
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
                self._record.error = DetachedJobNotFound(f"the scheduler no longer knows detached job {self.run_id} "
                                                         "(it restarted, or the job ended long ago)")
                self._record.transition("FAILED", str(self._record.error))
                self._record.settle()
                return
            n = self._take(snap)
            if snap["settled"]:
                return
            if len(snap["events"]) < _BATCH:  # a full batch: more are waiting, ask again at once
                time.sleep(interval)

    def _take(self, snap: dict) -> int:
        record, self._plan = self._record, snap.get("plan")
        if snap["events"]:
            record.add(snap["events"])
            if self._echo:
                from dask_ddp.observe.progress import Progress

                for item in snap["events"]:
                    if item.get("kind") == "log":
                        Progress.write(format_log(item), item.get("stream") == "stderr")
        with record.cond:
            record.state, record.history = snap["state"], snap["history"]
            record.telemetry, record.stragglers = snap.get("telemetry", {}), snap.get("stragglers", {})
            record.created = snap.get("created", record.created)
            if snap["settled"]:
                record.error, record.values = cloudpickle.loads(snap["outcome"])
                record.settled = True
            record.cond.notify_all()
        return snap["n"]
