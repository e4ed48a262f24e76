"""Live recovery on the client: which lost ranks a ``recovery="live"`` job goes on without, and telling the rest.

Runs in: the client (the controller's thread; for a detached job, the driver in the scheduler's process). The
rank side, where the survivors re-form their group, is :mod:`dask_ddp.rank.live`.

A rank is recovered live when its process died or its worker was lost (a failure of the code is not: it is
raised, or restarts the job, as ever), it is not rank 0 (whose process hosts the job's store: its loss restarts
the job), and at least ``min`` ranks still run (``workers=(min, max)``, else 1). The survivors then get a
:class:`~dask_ddp.wire.messages.PeerLost` through their supervisors, and the attempt goes on; its result is the
values of the ranks that finished it.
"""

from __future__ import annotations

from dask_ddp.client.attempt import Attempt
from dask_ddp.wire import plan as planning
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.spec import LaunchSpec

__all__ = ["RECOVERY", "recoverable", "settled"]

RECOVERY = ("restart", "live")


def recoverable(spec: LaunchSpec, att: Attempt, outcome: RankOutcome) -> bool:
    """Whether a ``recovery="live"`` job goes on without the rank of ``outcome`` (see the module docstring)."""
    if spec.recovery != "live" or outcome.status not in (Status.DIED, Status.LOST) or outcome.rank == 0:
        return False
    bounds = planning.elastic_bounds(spec.workers)
    left = [r.rank for r in att.plan.ranks if r.rank not in att.outcomes and r.rank != outcome.rank]
    return len(left) >= (bounds[0] if bounds else 1)


def tell(cluster, att: Attempt, outcome: RankOutcome) -> str:
    """Count ``outcome``'s rank recovered, tell the ranks still running, and return ``job.history``'s line."""
    att.recovered.add(outcome.rank)
    left = [r for r in att.plan.ranks if r.rank not in att.outcomes]
    why = f"rank {outcome.rank} on {outcome.worker} {'was lost' if outcome.status == Status.LOST else 'died'}"
    cluster.peer_lost(att.tasks[0], [r.address for r in left], sorted(att.recovered), why)
    return (f"{why}: live recovery, {len(left)} ranks go on in their processes "
            f"(ranks {', '.join(str(r.rank) for r in left)})")


def settled(att: Attempt) -> dict[int, RankOutcome]:
    """The outcomes that decide the attempt: those of the ranks it did not go on without."""
    return {rk: o for rk, o in att.outcomes.items() if rk not in att.recovered}
