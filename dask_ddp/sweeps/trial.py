"""One trial of a sweep as the notebook knows it: parameters, placement, metric trace summary, end.

Runs in: the client. What a sweep was started with (:class:`SweepSpec`), the callbacks of a trial's job
(:class:`TrialHooks`); the sweep's driver thread writes a :class:`TrialRecord`; the
:class:`~.handle.Sweep` handle reads it (under the sweep's lock). A trial's states::

    QUEUED -> RUNNING -> COMPLETE    (the job finished; its value is the last report of the metric)
                      -> PRUNED      (the pruner stopped it at ``pruned_at``: every rank stopped at ``stopped_step``)
                      -> FAILED      (a rank raised, a worker left, a stall, the metric never reported)
           -> CANCELLED              (sweep.cancel(), the failure limit, or the client closed, before it ended)
"""

from __future__ import annotations

import math
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import cloudpickle

from dask_ddp.wire.errors import PickledRankError

__all__ = ["SweepSpec", "TrialHooks", "TrialRecord", "TRIAL_STATES", "TRIAL_ENDED", "COLUMNS", "job_error",
           "failed_text"]

TRIAL_STATES = ("QUEUED", "RUNNING", "COMPLETE", "PRUNED", "FAILED", "CANCELLED")
TRIAL_ENDED = ("COMPLETE", "PRUNED", "FAILED", "CANCELLED")
#: The columns of ``Sweep.results()`` but the parameters' (``params_<name>``, after ``state``)
COLUMNS = ("trial", "state", "value", "last", "best", "steps", "last_step", "pruned_at", "stopped_step",
           "ranks", "workers", "run_id", "resumed_from", "checkpoint", "queued", "started", "first_report",
           "stopped", "ended", "duration", "error")


@dataclass
class TrialRecord:
    """A trial: its Optuna number and parameters, where it ran and what it reported (rank 0's reports)."""

    number: int
    params: dict[str, Any]
    ranks: int
    state: str = "QUEUED"
    workers: tuple[str, ...] = ()
    run_id: str | None = None
    steps: int = 0  # rank 0's reports of the metric that count (those after a prune step do not)
    last_step: int | None = None
    last: float | None = None
    best: float | None = None
    value: float | None = None  # what Optuna was told (COMPLETE) or kept (PRUNED: the last intermediate)
    pruned_at: int | None = None
    stopped_step: int | None = None  # the step every rank stopped at (a pruned trial's agreed step)
    resumed_from: int | None = None  # the trial whose checkpoint it continued from (resume, exploit)
    resume_from: str | None = None  # that trial's checkpoint folder (train_fn's ``resume_from``)
    checkpoint: str | None = None  # its own checkpoint folder (run_options' checkpoint_dir / its run id)
    keys: set[str] = field(default_factory=set)  # every key any rank reported
    error: str | None = None  # the failure, with its traceback
    failure: bytes | None = None  # a detached sweep's trial: its PickledRankError, pickled (a client loads it)
    queued: float = field(default_factory=time.time)
    started: float | None = None  # its job was started
    first_report: float | None = None  # rank 0's first report of the metric (the rank's clock)
    stopped: float | None = None  # the pruner's decision: the job was cancelled
    ended: float | None = None  # its job ended: every rank had stopped

    def add(self, step: int, value: float, minimize: bool, at: float | None = None) -> None:
        """Count one report of the metric at ``step``, made at ``at`` (``time.time()`` of the rank)."""
        if self.first_report is None:
            self.first_report = at
        self.steps += 1
        self.last_step, self.last = step, value
        if not math.isnan(value) and (self.best is None or (value < self.best if minimize else value > self.best)):
            self.best = value

    def end(self, state: str, error: str | None = None) -> None:
        self.state, self.ended = state, time.time()
        if error is not None:
            self.error = error

    def load_failure(self) -> None:
        """In the client, for a trial of a detached sweep: ``error`` from the rank's own exception (``failure``),
        which the driver in the scheduler's process kept pickled. Raises nothing: an error that cannot be loaded
        here keeps the driver's text."""
        if self.failure is None:
            return
        try:
            err = cloudpickle.loads(self.failure).load()
            self.error = failed_text(self.number, self.run_id, "".join(traceback.format_exception(err)))
        except Exception:  # noqa: BLE001 - not a PickledRankError: the driver's text stays
            pass
        self.failure = None

    def row(self) -> dict[str, Any]:
        """The trial's row of ``Sweep.results()``."""
        duration = None if self.started is None or self.ended is None else self.ended - self.started
        return {"trial": self.number, "state": self.state, **{f"params_{k}": v for k, v in self.params.items()},
                "value": self.value, "last": self.last, "best": self.best, "steps": self.steps,
                "last_step": self.last_step, "pruned_at": self.pruned_at,
                "stopped_step": self.stopped_step, "ranks": self.ranks,
                "workers": ",".join(self.workers), "run_id": self.run_id,
                "resumed_from": self.resumed_from, "checkpoint": self.checkpoint, "queued": self.queued,
                "started": self.started, "first_report": self.first_report, "stopped": self.stopped,
                "ended": self.ended, "duration": duration, "error": self.error}


@dataclass(frozen=True)
class SweepSpec:
    """What a sweep was started with (validated by :func:`.handle.sweep`)."""

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    fixed: dict
    ranks: Callable[[dict], int]
    metric: str
    minimize: bool
    n_trials: int
    max_concurrent: int | None
    max_workers: int | None
    workers: tuple[str, ...] | None
    max_failures: int | None
    run_options: dict
    progress: bool = True
    resume_arg: bool = False  # train_fn takes ``resume_from``: a trial's checkpoint folder to continue from
    exploit: bool = False  # a new trial starts from the best trial's checkpoint (PBT-style exploit)
    mlflow: Any = None  # an MLflowSink: its store and experiment get the sweep's parent run and a child per trial
    warm_cuda: bool = False  # ddp.sweep.warm-cuda when it started: each worker's next rank starts CUDA early


class TrialHooks:
    """The callbacks of one trial's job: post every metric report and the job's end to the driver's inbox."""

    def __init__(self, inbox: queue.Queue, number: int):
        self.inbox, self.number = inbox, number

    def on_metrics(self, item: dict) -> None:
        self.inbox.put(("metric", self.number, item))

    def on_finish(self, job) -> None:
        self.inbox.put(("end", self.number, job))


def failed_text(number: int, run_id: str | None, error: str | None) -> str:
    """A failed trial's ``error``: which trial and job, and the job's error with its traceback. Raises nothing."""
    return f"trial {number} (job {run_id}) failed:\n{error}"


def job_error(job) -> tuple[str | None, bytes | None]:
    """The job's error with its traceback (None when it finished), and a rank's exception that its driver kept
    pickled (a detached sweep's trial, in the scheduler's process: see :mod:`.detach`).
    Waits up to 60 s for the job's end; raises nothing."""
    try:
        job.result(timeout=60, progress=False)
    except BaseException as exc:  # noqa: BLE001 - the rank's own exception, JobCancelledError, ...
        return "".join(traceback.format_exception(exc)), (cloudpickle.dumps(exc) if isinstance(exc, PickledRankError)
                                                           else None)
    return None, None
