"""Preemption and growth on the client: what an attempt that stopped for a preemption means, and when to grow.

Runs in: the client (the controller calls these). Pure functions of plain
data, unit-tested without a cluster (``tests/test_preemption.py``), except
:func:`last_checkpoint_step`, which lists the job's checkpoint folder.

An attempt stopped for a preemption when a notice reached its ranks (a worker
left, or the job grew): its ranks' outcomes carry the notice
(``RankOutcome.preempt``). If they stopped at the agreed step
(``Status.PREEMPTED``, saved and committed), the job restarts from that step
and loses nothing; if the save did not fit in the grace period, it restarts
from the last checkpoint the job had saved on its own. Either way the restart
does not count against ``max_restarts`` (nothing failed), and ``job.history``
says what happened.
"""

from __future__ import annotations

from typing import Sequence

from dask_ddp.wire.errors import DaskDDPError
from dask_ddp.wire.notices import Stopped
from dask_ddp.wire.outcome import RankOutcome, Status

__all__ = ["preemption", "reason", "grow_by", "last_checkpoint_step", "over_cap"]


def preemption(outcomes: Sequence[RankOutcome]) -> Stopped | None:
    """The preemption an ended attempt went through (its ranks' best record, heard when the first rank heard),
    or None when no notice reached any of its ranks."""
    stopped = [o.preempt for o in outcomes if o.status == Status.PREEMPTED and o.preempt is not None]
    if stopped:
        best = max(stopped, key=lambda p: (p.safe, -p.heard))
        return best.heard_first(min(p.heard for p in stopped))
    notes = [o.preempt for o in outcomes if o.preempt is not None]
    return notes[0] if notes else None


def reason(p: Stopped, top_step: int, fallback_step: int | None, grace: float) -> str:
    """The cause ``job.history`` keeps for a restart after preemption ``p``.

    ``top_step``: the highest step the ranks reported; ``fallback_step``: the newest complete checkpoint's step
    (None: there is none), what the job resumes from when the save did not fit.
    """
    what = "grew" if p.notice.kind == "grow" else "preempted"
    head = f"{what}: {p.notice.cause or 'a notice'}"
    if p.safe:
        lost = max(0, top_step - (p.step or 0))  # a safe save has its step
        took = p.commit_time - p.heard
        return (f"{head}; saved step {p.step} (the save took {p.save_took:.2f} s, notice to commit "
                f"{took:.2f} s); {lost} steps lost")
    if fallback_step is None:
        lost = top_step + 1
        where = "no checkpoint was saved before: it restarts from the start"
    else:
        lost = max(0, top_step - fallback_step)
        where = f"resuming from the last periodic checkpoint (step {fallback_step})"
    why = ("the ranks did not stop at an agreed step" if p.step is None else
           f"the save at step {p.step} was not committed")
    return (f"{head}; {why} within the {grace:g} s grace period (ddp.preemption.grace-period): {where}; "
            f"{lost} steps lost")


def over_cap(preemptions: int, cap: int, run_id: str) -> DaskDDPError | None:
    """The error that ends a job preempted ``preemptions`` times already when ``cap``
    (``ddp.preemption.max-restarts``) allows no more, else None: notices restart a job without counting against
    ``max_restarts``, so a source of endless notices must not keep it restarting for ever."""
    if preemptions < cap:
        return None
    return DaskDDPError(f"job {run_id} was preempted {preemptions} times, the most ddp.preemption.max-restarts "
                        f"({cap}) allows: it was stopped instead of restarting again. Find what keeps retiring its "
                        "workers (autoscaler, spot reclaims) or raise the setting")


def grow_by(bounds: tuple[int, int | None], world_size: int, idle_workers: int) -> int:
    """How many more ranks an elastic job of ``world_size`` ranks within ``bounds`` could have now."""
    hi = bounds[1]
    room = idle_workers if hi is None else min(idle_workers, hi - world_size)
    return max(0, room)


def last_checkpoint_step(checkpoint_dir: str | None, run_id: str, options: dict) -> int | None:
    """The step of the newest complete checkpoint of the job's folder (None: none, or it cannot be listed)."""
    if checkpoint_dir is None:
        return None
    from dask_ddp.checkpoint.folder import job_folder
    from dask_ddp.checkpoint.whole import list_checkpoints

    try:
        found = list_checkpoints(job_folder(checkpoint_dir, run_id), storage_options=options)
    except Exception:  # noqa: BLE001 - the client may not reach the storage: the history then says less
        return None
    return found[-1].step if found else None
