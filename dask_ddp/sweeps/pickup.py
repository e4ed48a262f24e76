"""Continuing a sweep whose notebook died: its Optuna study, kept in a storage, taken up by a new ``sweep()``.

Runs in: the client (``sweep(..., load_if_exists=True)``, before its driver thread starts; :func:`remember` in
that thread).

A sweep started without ``detach=True`` stops every trial when its client dies, but a study kept in a storage
(``storage="sqlite:///sweep.db"``) keeps what was decided. ``sweep(client, train_fn, space, storage=url,
name=name, load_if_exists=True, n_trials=n)`` from a new kernel loads that study: its ended trials
(COMPLETE, PRUNED, FAIL) count against ``n_trials`` and appear in ``results()`` with what Optuna kept
(parameters, value, the metric's trace, times; the ranks, run id and checkpoint folder that the driver stored
in each trial's user attributes). A trial the dead notebook left RUNNING is told FAIL (``error``:
interrupted) and asked again with its parameters (first in line), from its own checkpoint folder when it had
started and ``train_fn`` takes ``resume_from``; the new trial takes its place in the count.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from dask_ddp.sweeps.queue import TrialQueue
from dask_ddp.sweeps.trial import SweepSpec, TrialRecord

__all__ = ["adopt", "remember", "Continuing"]

logger = logging.getLogger("dask_ddp")
ATTR = "dask_ddp"  # the user attribute holding {"ranks", "run_id", "checkpoint"} of a trial's job
STATES = {"COMPLETE": "COMPLETE", "PRUNED": "PRUNED", "FAIL": "FAILED"}


class Continuing(Protocol):
    """What :func:`adopt` uses of the sweep's driver (:class:`~.driver.Driver`)."""

    spec: SweepSpec
    study: Any
    searched: dict
    trials: dict[int, TrialRecord]
    cond: threading.Condition
    queue: TrialQueue

    def ask(self, counted: bool = True, params: dict | None = None, first: bool = False) -> TrialRecord:
        """Ask Optuna for a trial with ``params`` enqueued and put it in line."""


def remember(trial: Any, rec: TrialRecord) -> None:
    """Store where the trial ran in its Optuna trial (a continued sweep reads it back); raises nothing."""
    try:
        trial.set_user_attr(ATTR, {"ranks": rec.ranks, "run_id": rec.run_id, "checkpoint": rec.checkpoint})
    except Exception:  # noqa: BLE001 - a storage hiccup must not fail the trial; only a continued sweep needs it
        logger.warning("dask-ddp could not store trial %d's run id in its Optuna study", rec.number, exc_info=True)


def adopt(driver: Continuing) -> int:
    """Take up ``driver.study``'s earlier trials: records for the ended ones (counted against ``n_trials``),
    interrupted ones told FAIL and asked again (first in line). Returns how many earlier trials there were.
    Raises what the study's storage raises."""
    import optuna

    state = optuna.trial.TrialState
    earlier = [t for t in driver.study.get_trials(deepcopy=False) if t.state != state.WAITING]
    again = []
    for t in earlier:
        rec = _record(t, driver)
        if t.state == state.RUNNING:
            driver.queue.tell(t.number, state=state.FAIL)
            params = t.params if set(driver.searched) <= set(t.params) else _grid_point(driver.study.sampler, t)
            if params is not None:  # None: killed inside study.ask(), before any parameter was decided
                again.append((t, params))
            rec.state, rec.error = "FAILED", ("interrupted: the sweep's client died while it ran (its ranks "
                                              "stopped with it); " + ("asked again as a new trial" if params
                                                                      is not None else "it had no parameters yet"))
        else:
            driver.queue.count()
        with driver.cond:
            driver.trials[t.number] = rec
    for t, params in again:
        new = driver.ask(params=params)
        checkpoint = (t.user_attrs.get(ATTR) or {}).get("checkpoint")
        if checkpoint and driver.spec.resume_arg:
            with driver.cond:
                new.resumed_from, new.resume_from = t.number, checkpoint
    if earlier:
        logger.info("sweep %s continues its study: %d earlier trials, %d interrupted ones asked again",
                    driver.spec.name, len(earlier), len(again))
    return len(earlier)


def _grid_point(sampler: Any, t: Any) -> dict | None:
    """The grid point GridSampler gave a trial killed inside ``study.ask()`` before its parameters were set
    (its point counts as visited: asked again here, else the grid would miss it); None for other samplers."""
    grid_id = t.system_attrs.get("grid_id")
    names, grids = getattr(sampler, "_param_names", None), getattr(sampler, "_all_grids", None)
    if grid_id is None or names is None or grids is None or not 0 <= int(grid_id) < len(grids):
        return None
    return dict(zip(names, grids[int(grid_id)]))


def _record(t: Any, driver: Continuing) -> TrialRecord:
    attrs = t.user_attrs.get(ATTR) or {}
    rec = TrialRecord(t.number, {**t.params, **driver.spec.fixed}, int(attrs.get("ranks") or 0))
    rec.state, rec.value = STATES.get(t.state.name, t.state.name), t.value
    rec.run_id, rec.checkpoint = attrs.get("run_id"), attrs.get("checkpoint")
    trace = dict(t.intermediate_values)
    if trace:
        rec.steps, rec.last_step = len(trace), max(trace)
        rec.last = trace[rec.last_step]
        rec.best = (min if driver.spec.minimize else max)(trace.values())
    rec.started = t.datetime_start.timestamp() if t.datetime_start else None
    rec.ended = t.datetime_complete.timestamp() if t.datetime_complete else None
    return rec
