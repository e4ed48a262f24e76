"""The notices a job's controller sends its ranks: save and stop at one agreed step, to grow or to end.

Runs in: the client (the controller's thread; for a detached job, the driver in the scheduler's process). Both
go through the preemption protocol of :mod:`dask_ddp.rank.preemption`: every rank stops at the same report,
saving what its code registered (``on_preemption``). A growth restarts the job on more workers; a stop
(:meth:`Controller.stop <dask_ddp.client.controller.Controller.stop>`, what a sweep's pruned trial gets) ends it
there, and the controller cancels it (every rank killed together) if the ranks have not stopped in time.

:class:`NoticeDesk` keeps what these decisions need from one step to the next (the growth bounds, when idle
workers are next looked for, the stop asked for, the attempt a notice went to). The controller owns one and
hands it, each step of a running attempt, the attempt, the time, whether a rank has reported and how to list
the workers a plan may use; the desk sends the notice through the cluster port (the :class:`Notifier` shape) and says
when a stop is overdue, which the controller answers by cancelling the job.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

import dask

from dask_ddp.client import elastic, live
from dask_ddp.client.attempt import Attempt
from dask_ddp.wire import plan as planning
from dask_ddp.wire.spec import LaunchSpec
from dask_ddp.wire.task import RankTask

__all__ = ["GROW_EVERY", "NoticeDesk", "Notifier", "growth_bounds"]

GROW_EVERY = 1.0  # seconds between two looks for idle workers an elastic job could grow on


class Notifier(Protocol):
    """What the notices need of the cluster port (:class:`~dask_ddp.client.cluster.DaskCluster`, or a test's)."""

    def notify(self, task: RankTask, addresses: list[str], cause: str, grace: float, kind: str = "grow") -> None:
        """Ask every rank of ``task``'s attempt (on ``addresses``) to save at an agreed step and stop."""


def growth_bounds(spec: LaunchSpec) -> tuple[int, int | None] | None:
    """The ``(min, max)`` ranks a job may grow within: an elastic ``workers=(min, max)`` job with a
    ``checkpoint_dir`` (what it restarts from) while ``ddp.preemption.grow`` is on; else None (it never grows by
    a restart; a ``recovery="live"`` job regrows in place instead).

    Raises
    ------
    PlanError
        If ``spec.workers`` is a pair of counts that are not ``1 <= min <= max``.
    """
    bounds = planning.elastic_bounds(spec.workers)
    if spec.recovery == "live":  # it grows in place (client.live.regrow), with no save and restart
        return None
    return bounds if bounds and spec.checkpoint_dir and dask.config.get("ddp.preemption.grow", True) else None


class NoticeDesk:
    """One job's growth and stop notices, at most one an attempt (a growth's or a stop's).

    ``cluster``: where notices go; ``grow``: the bounds of :func:`growth_bounds` (None: the job never grows);
    ``grace``: the seconds a growth's ranks have to save (``ddp.preemption.grace-period``).
    """

    def __init__(self, cluster: Notifier, grow: tuple[int, int | None] | None, grace: float,
                 live: Callable[[str], None] | None = None):
        self.cluster, self.grow, self.grace = cluster, grow, grace
        self.live = live  # a live job's history (recovery="live"): it regrows in place (client.live.regrow)
        self.next_grow = 0.0  # the time (the controller's clock) idle workers are next looked for
        self.stop_asked: tuple[str, float] | None = None  # stop(): the cause, and the time by which to cancel instead
        self.noticed: int | None = None  # the index of the attempt a notice went to

    @property
    def active(self) -> bool:
        """Whether the desk has anything to check: the job may grow, or a stop was asked for."""
        return bool(self.grow or self.stop_asked or self.live)

    def stop(self, cause: str, deadline: float) -> None:
        """Ask for a ``stop`` notice with ``cause``; past ``deadline`` (the controller's clock) the job is to be
        cancelled instead. Only the first call counts. Raises nothing."""
        self.stop_asked = self.stop_asked or (cause, deadline)

    def check(self, att: Attempt, now: float, reported: bool, workers: Callable[[], Mapping[str, dict]]) -> bool:
        """One step of a running attempt ``att`` at time ``now``: after :meth:`stop`, send the ranks the ``stop``
        notice once; else, for a live job that went on smaller, start a lost rank again on a free worker (it
        regrows in place: :func:`~dask_ddp.client.live.regrow`); else, for a job that may grow, send a ``grow``
        notice once idle workers have joined.

        ``reported``: whether any rank has reported a metric this attempt (a job grows only once it trains);
        ``workers()``: the workers a plan may use (running, neither silent nor departed), ``{address: info}``,
        asked at most every :data:`GROW_EVERY` s; those ``att`` does not use are the idle ones it could grow on.

        Returns True when the stop's deadline has passed after its notice (the ranks did not reach a report in
        time: the caller cancels the job), else False. Raises nothing of its own: the cluster port logs a notice
        it could not deliver.
        """
        if self.stop_asked:
            return self._check_stop(att, now, *self.stop_asked)
        if self.live and att.recovered and now >= self.next_grow:  # went on smaller: a free worker takes a rank
            self.next_grow = now + GROW_EVERY
            said = live.regrow(self.cluster, att, workers())
            if said:
                self.live(said)
        elif self.grow:
            self._check_growth(att, now, reported, workers, self.grow)
        return False

    def _check_growth(self, att: Attempt, now: float, reported: bool, workers: Callable[[], Mapping[str, dict]],
                      bounds: tuple[int, int | None]) -> None:
        """An elastic job below its maximum saves and restarts on more workers once idle ones have joined."""
        if self.noticed == att.index or now < self.next_grow or not reported:
            return
        self.next_grow = now + GROW_EVERY
        joined = [a for a in workers() if a not in att.plan.addresses]
        more = elastic.grow_by(bounds, att.plan.world_size, len(joined))
        if more:
            self.noticed = att.index
            self.cluster.notify(att.tasks[0], list(att.plan.addresses), f"{len(joined)} worker(s) joined "
                                f"({', '.join(sorted(joined))}): the job grows to {att.plan.world_size + more} ranks",
                                self.grace)

    def _check_stop(self, att: Attempt, now: float, cause: str, deadline: float) -> bool:
        """Send the ranks the ``stop`` notice once; True once its deadline has passed."""
        if self.noticed != att.index:  # one notice an attempt, a growth's or a stop's
            self.noticed = att.index
            self.cluster.notify(att.tasks[0], list(att.plan.addresses), cause, max(deadline - now, 0.5), "stop")
            return False
        return now > deadline
