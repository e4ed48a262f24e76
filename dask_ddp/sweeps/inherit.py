"""Resumable trials: a trial continues from another trial's last checkpoint (resume, promotion, PBT exploit).

Runs in: the client (the sweep's driver thread: :func:`take`, :func:`exploit`; :func:`check` in the thread that
calls :meth:`Sweep.resume <dask_ddp.sweeps.handle.Sweep.resume>`).

Each trial is a job; with ``run_options={"checkpoint_dir": url}`` each trial's job saves in a folder of its own,
``<url>/<run_id>`` (the ``checkpoint`` column of ``results()``), with :func:`dask_ddp.save_checkpoint` or
:func:`dask_ddp.save_sharded`, and a pruned trial saves at the step its ranks agreed to stop at when its code
registered :func:`dask_ddp.on_preemption`. A ``train_fn`` that takes a keyword ``resume_from`` gets the folder
a trial starts from (None for a fresh one) and loads it (``load_checkpoint(resume_from)``, or
``load_sharded(state, directory=resume_from)``, which reshards onto any number of ranks). A trial starts from
another's checkpoint in two ways:

- :meth:`Sweep.resume(n, ranks=k, params={...}) <dask_ddp.sweeps.handle.Sweep.resume>`: a new trial with trial
  ``n``'s parameters (updated by ``params``: a PBT-style perturbation), on ``k`` ranks (default ``n``'s),
  from ``n``'s checkpoint: a paused (pruned) trial resumed, or a promising one promoted to more steps or
  ranks. It is asked from Optuna as an enqueued trial (Optuna sees a new trial; ``resumed_from`` says whose
  state it continued), goes to the head of the line, and does not count against ``n_trials``;
- ``sweep(..., exploit=True)``: every new trial starts from the checkpoint of the best trial so far (best
  reported metric among the ended trials that have a checkpoint folder) with the sampler's new parameters:
  PBT's exploit (copy the better state) and explore (new hyperparameters).
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable, Protocol

from dask_ddp.sweeps.trial import SweepSpec, TrialRecord

__all__ = ["takes_resume", "check", "take", "exploit", "Resuming"]

logger = logging.getLogger("dask_ddp")
ARG = "resume_from"


class Resuming(Protocol):
    """What :func:`take` and :func:`exploit` use of the sweep's driver
    (:class:`~.driver.Driver`)."""

    spec: SweepSpec
    searched: dict
    trials: dict[int, TrialRecord]
    cond: threading.Condition

    def ask(self, counted: bool = True, params: dict | None = None, first: bool = False) -> TrialRecord:
        """Ask Optuna for a trial with ``params`` enqueued and put it in line (``first``: at its head)."""

    def look_now(self) -> None:
        """Look at the cluster for free workers at the next step."""


def takes_resume(fn: Callable) -> bool:
    """Whether ``fn`` takes the keyword ``resume_from`` (by name: ``**kwargs`` does not count)."""
    try:
        return ARG in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check(spec, trials: dict[int, TrialRecord], number: int, ranks: int | None, params: dict | None) -> None:
    """Refuse a resume request that cannot work, before it reaches the driver.

    Raises
    ------
    ValueError
        No trial ``number``, or it has not ended; the sweep has no ``checkpoint_dir``; a ``params`` key is not a
        parameter of the space.
    TypeError
        ``train_fn`` takes no ``resume_from``; ``ranks`` is not a positive int; ``params`` not a dict.
    """
    if not spec.resume_arg:
        raise TypeError(f"sweep {spec.name}: train_fn takes no keyword {ARG!r}, so a resumed trial could not know "
                        "which checkpoint to load: add resume_from=None to its parameters")
    if not spec.run_options.get("checkpoint_dir"):
        raise ValueError(f"sweep {spec.name}: its trials save no checkpoints: pass run_options={{'checkpoint_dir': "
                         "url}} to sweep()")
    rec = trials.get(number)
    if rec is None or rec.run_id is None or rec.ended is None:
        raise ValueError(f"sweep {spec.name}: trial {number!r} " + ("does not exist" if rec is None else
                         "has not ended yet") + ": resume an ended trial (results() lists them)")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
        raise TypeError(f"ranks={ranks!r}: expected a positive int or None")
    if params is not None and not isinstance(params, dict):
        raise TypeError(f"params={params!r}: expected a dict {{parameter: value}}")
    unknown = sorted(set(params or {}) - set(rec.params))
    if unknown:
        raise ValueError(f"params: {', '.join(unknown)} is not a parameter of the sweep's space "
                         f"({', '.join(sorted(rec.params))})")


def take(driver: Resuming, number: int, ranks: int | None, params: dict | None) -> None:
    """In the driver: ask a trial that continues trial ``number`` from its checkpoint, at the head of the line
    (not counted against ``n_trials``). Raises what ``study.ask`` raises."""
    src = driver.trials[number]
    merged = {**src.params, **(params or {})}
    rec = driver.ask(counted=False, params=merged, first=True)
    with driver.cond:
        rec.resumed_from, rec.resume_from = number, src.checkpoint
        rec.params.update({k: v for k, v in merged.items() if k not in driver.searched})
        if ranks is not None:
            rec.ranks = ranks
    driver.look_now()
    logger.info("sweep %s: trial %d continues trial %d from %s", driver.spec.name, rec.number, number,
                src.checkpoint)


def exploit(driver: Resuming, rec: TrialRecord) -> None:
    """With ``exploit=True``: point a new trial at the checkpoint of the best ended trial that has one. Raises
    nothing."""
    if not (driver.spec.exploit and driver.spec.resume_arg):
        return
    done = [r for r in driver.trials.values() if r.ended is not None and r.checkpoint and r.best is not None
            and r.state in ("COMPLETE", "PRUNED")]
    if done:
        pick: Any = min if driver.spec.minimize else max
        best = pick(done, key=lambda r: r.best)
        rec.resumed_from, rec.resume_from = best.number, best.checkpoint
