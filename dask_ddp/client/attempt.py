"""One attempt of a job as its controller sees it: plan, tasks, futures, and what has happened to its ranks.

Runs in: the client, in the job's watcher thread (owned by :class:`~dask_ddp.client.controller.Controller`).
"""

from __future__ import annotations

from dask_ddp.wire import plan as planning
from dask_ddp.wire.errors import StallError
from dask_ddp.wire.outcome import RankOutcome
from dask_ddp.wire.task import RankTask

__all__ = ["Attempt"]


class Attempt:
    """Live state of one attempt: its plan, tasks, futures and the outcomes seen so far."""

    def __init__(self, index: int, plan: planning.RankPlan, tasks: list[RankTask], futures: list, launched: float):
        self.index, self.plan, self.tasks, self.futures = index, plan, tasks, futures
        self.launched = launched  # the controller's clock() at launch
        self.outcomes: dict[int, RankOutcome] = {}
        self.lost: dict[str, float] = {}  # worker address -> time it was found gone
        self.leaving: dict[str, float] = {}  # worker address -> clock() it was retired: its ranks may be saving
        self.stalled: StallError | None = None
        self.queue_checked = False
        self.recovered: set[int] = set()  # ranks a live-recovered job went on without (client.live)
        self.joins = 0  # ranks a live-recovered job started into this attempt in the place of lost ones

    def ended(self) -> bool:
        return len(self.outcomes) == len(self.tasks)

    def left_for_good(self, address: str, now: float, grace: float) -> bool:
        """A retired worker's rank is lost once every other rank has ended (saved, or failed) or the grace
        period has passed (``now``: the controller's clock): until then it may be saving, and the others must
        not be stopped."""
        if address not in self.leaving:
            return False
        others = [r.rank for r in self.plan.ranks if r.address not in self.leaving]
        return bool(others) and all(rk in self.outcomes for rk in others) or now > self.leaving[address] + grace + 5
