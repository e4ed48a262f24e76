"""What a :class:`~dask_ddp.client.job.Job` handle acts through: its control, local or remote.

Runs in: the client (and, for a detached job, the driver in the scheduler's process).

A handle reads a :class:`~dask_ddp.client.record.JobRecord` and acts through a control that fills it:

- :class:`LocalControl` (here): the job's :class:`~dask_ddp.client.controller.Controller`, driven by a
  watcher thread of this process. What ``run()`` returns, and what a detached job's driver runs.
- :class:`~dask_ddp.client.detach.RemoteControl`: the driver of a detached job, in the scheduler's
  process, polled into a record of this process. What ``run(..., detach=True)`` and ``attach`` return.

:class:`Control` states what both offer, so the handle never asks which kind it has. What a remote control
cannot give has a plain answer: no ``attempt`` (its futures live with the driver), no callbacks (``run``
refuses them with ``detach=True``), and Ctrl-C leaves the job running.
"""

from __future__ import annotations

import threading
from typing import Protocol

import dask

from dask_ddp.client.attempt import Attempt
from dask_ddp.client.cluster import DaskCluster
from dask_ddp.client.controller import Controller
from dask_ddp.client.record import JobRecord
from dask_ddp.wire.events import EventLimits
from dask_ddp.wire.plan import RankPlan
from dask_ddp.wire.spec import LaunchSpec
from dask_ddp.wire.task import topic_of

__all__ = ["Control", "LocalControl", "new_record"]


def new_record(run_id: str, limits: EventLimits | None = None) -> JobRecord:
    """An empty record for job ``run_id``, bounded by ``ddp.events.max-rows``, ``max-lines`` and
    ``max-record-bytes``; ``limits``: what its ranks may send (named when something is dropped)."""
    events = dask.config.get("ddp.events")
    return JobRecord(run_id, events["max-rows"], events["max-lines"], events["max-record-bytes"], limits)


class Control(Protocol):
    """What a job handle acts through; ``record`` is what it reads."""

    record: JobRecord

    @property
    def attempt(self) -> Attempt | None:
        """The current attempt; None before the first, and always for a remote job."""

    @property
    def plan(self) -> RankPlan | None:
        """The plan of the current attempt (None before the first)."""

    def bind(self, job) -> None:
        """The handle that callbacks receive as the job."""

    def start(self) -> None:
        """Start driving (local) or following (remote) the job."""

    def cancel(self) -> None:
        """Ask the job to stop, without waiting."""

    def stop(self, cause: str, grace: float) -> None:
        """Ask the ranks to stop at one agreed step (or be cancelled after ``grace`` s), without waiting."""

    def in_driver_thread(self) -> bool:
        """True in the thread that drives the job and runs its callbacks (waiting there would wait forever)."""

    def interrupted(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C while the user waits on an unended job: act on it, and say what happened in a note on ``exc``."""


class LocalControl:
    """The job's controller and the watcher thread that runs it, in this process.

    ``record`` is the record the controller writes (a new one by default; a detached job's driver passes the
    one the scheduler already shows).
    """

    def __init__(self, client, spec: LaunchSpec, record: JobRecord | None = None, raw_results: bool = False):
        self.record = new_record(spec.run_id, spec.event_limits) if record is None else record
        self.controller = Controller(spec, spec.run_id, DaskCluster(client, topic_of(spec.run_id)), self.record,
                                     raw_results=raw_results)
        self._thread = threading.Thread(target=self.controller.run, name=f"dask-ddp-job-{spec.run_id}", daemon=True)

    @property
    def attempt(self) -> Attempt | None:
        return self.controller.attempt

    @property
    def plan(self) -> RankPlan | None:
        attempt = self.controller.attempt
        return attempt.plan if attempt else None

    def bind(self, job) -> None:
        self.controller.owner = job

    def start(self) -> None:
        self.controller.start()
        self._thread.start()

    def cancel(self) -> None:
        self.controller.cancel()

    def stop(self, cause: str, grace: float) -> None:
        self.controller.stop(cause, grace)

    def in_driver_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def interrupted(self, exc: KeyboardInterrupt) -> None:
        """A job the user stops watching must not go on holding its workers (and GPUs) unseen, as ``dask-ddp
        run`` and torchrun stop theirs. Cancels without waiting (a second Ctrl-C must not be needed)."""
        self.controller.cancel()
        exc.add_note(f"[dask-ddp] interrupted: job {self.record.run_id} was cancelled, its ranks stop within a "
                     "second (job.state turns CANCELLED). To keep a job running while the notebook does other "
                     "work, do not wait on it: run() returns at once; run(..., detach=True) outlives the notebook.")
