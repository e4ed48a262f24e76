"""The stall clock: when each rank of the running attempt last made progress.

Runs in: the client (the job's controller feeds it every report and telemetry item of the attempt).

Progress is a ``report()`` (a metric item), or a change of the ``step`` a rank's telemetry carries (its latest
reported step, else the latest step a live group committed, else the DDP steps or batches counted: see
:mod:`dask_ddp.rank.telemetry`), so a loop that never reports is watched too. A rank's clock starts at its first
progress, so a slow start is never a stall. :meth:`StallClock.stalled` says when a rank is past the limit, with
the error that blames one (:mod:`dask_ddp.client.policy`'s rule); the controller aborts the attempt with it.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

from dask_ddp.client import policy
from dask_ddp.client.attempt import Attempt
from dask_ddp.wire.errors import StallError

__all__ = ["StallClock"]

_NONE = object()  # no step seen yet


class StallClock:
    """Each rank's latest progress in the running attempt (clock() seconds), and whether any rank reported."""

    def __init__(self) -> None:
        self.last: dict[int, float] = {}  # rank -> clock() of its latest progress
        self.steps: dict[int, Any] = {}  # rank -> the step its telemetry carried last
        self.reported = False  # a metric arrived this attempt (a job grows only once it trains)

    def reset(self) -> None:
        """A new attempt: every rank's clock starts again at its first progress."""
        self.last.clear()
        self.steps.clear()
        self.reported = False

    def report(self, rank: int, now: float) -> None:
        """Rank ``rank`` reported a metric at ``now``."""
        self.last[rank] = now
        self.reported = True

    def telemetry(self, rank: int, step: Any, now: float) -> None:
        """Rank ``rank``'s telemetry carried ``step`` at ``now``: progress when it changed (None is no step)."""
        if step is not None and self.steps.get(rank, _NONE) != step:
            self.steps[rank] = step
            self.last[rank] = now

    def ages(self, now: float, ended: Collection[int]) -> dict[int, float]:
        """Seconds since each rank's latest progress, the ranks of ``ended`` (with an outcome) left out."""
        return {rk: now - t for rk, t in self.last.items() if rk not in ended}

    def stalled(self, now: float, limit: float, att: Attempt, stacks: Callable[[str, Any], Mapping[int, str]],
                run_id: str) -> StallError | None:
        """The :class:`~dask_ddp.wire.errors.StallError` of attempt ``att`` when a rank still running made no
        progress for more than ``limit`` s at ``now`` (``stacks(attempt id, addresses)``: every rank's stack dump,
        asked only then), else None."""
        ages = self.ages(now, att.outcomes)
        if not any(age > limit for age in ages.values()):
            return None
        dumps = stacks(att.tasks[0].attempt_id, att.plan.addresses)
        blame = policy.blame_stall(ages, [r.rank for r in att.plan.ranks if r.rank not in att.outcomes], dumps)
        return policy.stall_error(run_id, blame, limit, dumps, att.plan.ranks[blame.rank].address)
