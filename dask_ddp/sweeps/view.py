"""What a sweep shows outside the notebook: the DDP dashboard page and Prometheus, and MLflow.

Runs in: the client (the sweep's driver thread; for a detached sweep, the scheduler's process).

The driver publishes ``{"kind": "sweep", "sweep", "state", "time", "n_trials", "trials": {state: count},
"busy", "room", "occupancy"}`` on ``dask-ddp-jobs`` (:mod:`dask_ddp.dashboard.jobs`) whenever the counts
change and at least every :data:`EVERY` seconds while it runs: the scheduler's DDP page lists the sweeps and
``/metrics`` exports ``dask_ddp_sweep_trials{sweep,state}``, ``dask_ddp_sweep_busy_workers``,
``dask_ddp_sweep_workers`` and ``dask_ddp_sweep_occupancy_ratio``. ``occupancy`` is busy worker-seconds (each
trial's ranks from its job's start to its end) over the workers the sweep may use times the time since the
sweep started. With ``mlflow=`` the sweep has a parent MLflow run and each trial a child run
(:mod:`.mlflow_runs`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from dask_ddp.dashboard import jobs as dashboard_jobs
from dask_ddp.sweeps import names as sweep_names
from dask_ddp.sweeps.mlflow_runs import SweepRuns
from dask_ddp.sweeps.trial import SweepSpec, TrialRecord

__all__ = ["SweepView", "Shown", "occupancy", "EVERY"]

EVERY = 2.0  # seconds between messages while nothing changes


class Shown(Protocol):
    """What the view reads of the sweep's driver (:class:`~.driver.Driver`)."""

    client: Any
    spec: SweepSpec
    searched: dict
    trials: dict[int, TrialRecord]
    cond: threading.Condition


def occupancy(trials: list[TrialRecord], room: int, since: float, now: float) -> float | None:
    """Busy worker-seconds of ``trials`` since ``since`` over ``room`` workers times the time elapsed."""
    span = now - since
    if room < 1 or span <= 0:
        return None
    busy = sum(r.ranks * ((r.ended or now) - max(r.started, since)) for r in trials if r.started is not None)
    return min(1.0, busy / (room * span))


class SweepView:
    """The driver's outward view: dashboard messages and the MLflow runs (``spec.mlflow``)."""

    def __init__(self, driver: Shown) -> None:
        self.driver, self.started = driver, time.time()
        self.room = 0  # workers the sweep may use, as the driver last looked
        self.claimed = False  # the sweep's name is claimed on the scheduler for its client (a notebook's sweep)
        self._last: Any = None
        self._sent = 0.0
        sink = getattr(driver.spec, "mlflow", None)
        self.mlflow = SweepRuns(sink, driver.spec.name) if sink is not None else None

    def begin(self) -> None:
        spec = self.driver.spec
        if self.mlflow is not None:
            self.mlflow.start({"metric": spec.metric, "mode": "min" if spec.minimize else "max",
                               "n_trials": spec.n_trials, **{f"space.{k}": v for k, v in self.driver.searched.items()},
                               **{f"fixed.{k}": v for k, v in spec.fixed.items()}})

    def callbacks(self, number: int, params: dict) -> list:
        """The callbacks a trial's job gets from the view (its MLflow child run's sink)."""
        sink = self.mlflow.trial_sink(number, params) if self.mlflow is not None else None
        return [] if sink is None else [sink]

    def ended(self, rec: TrialRecord) -> None:
        if self.mlflow is not None:
            best = [r.value for r in self.driver.trials.values() if r.state == "COMPLETE" and r.value is not None]
            pick = min if self.driver.spec.minimize else max
            self.mlflow.trial_ended(rec.number, rec.state, rec.value, pick(best) if best else None)

    def tick(self, state: str = "RUNNING", force: bool = False) -> None:
        """Publish the sweep's message when its counts changed, or every :data:`EVERY` seconds."""
        d, now = self.driver, time.time()
        with d.cond:
            trials = list(d.trials.values())
        counts = {s: 0 for s in ("QUEUED", "RUNNING", "COMPLETE", "PRUNED", "FAILED", "CANCELLED")}
        for r in trials:
            counts[r.state] = counts.get(r.state, 0) + 1
        key = (state, tuple(counts.values()))
        if not force and key == self._last and now - self._sent < EVERY:
            return
        self._last, self._sent = key, now
        busy = sum(r.ranks for r in trials if r.state == "RUNNING")
        room = max(self.room, busy)
        msg = {"kind": "sweep", "sweep": d.spec.name, "state": state, "time": now, "n_trials": d.spec.n_trials,
               "trials": counts, "busy": busy, "room": room,
               "occupancy": occupancy(trials, room, self.started, now)}
        dashboard_jobs.publish(d.client, msg)

    def finish(self, state: str) -> None:
        self.tick(state, force=True)
        if self.claimed:  # the name is free for the next sweep before wait() returns
            sweep_names.release(self.driver.client, self.driver.spec.name)
        if self.mlflow is not None:
            self.mlflow.finish(state)
