"""Live recovery on the client: which lost ranks a ``recovery="live"`` job goes on without, and telling the rest.

Runs in: the client (the controller's thread; for a detached job, the driver in the scheduler's process). The
rank side, where the survivors re-form their group, is :mod:`dask_ddp.rank.live`.

A rank is recovered live when its process died or its worker was lost (a failure of the code is not: it is
raised, or restarts the job, as ever), it is not rank 0 with its worker lost (rank 0's store is held by a keeper
process on its host, :mod:`dask_ddp.rank.keeper`: it outlives rank 0's process, not its worker or host; that
loss restarts the job), and at least ``min`` ranks still run (``workers=(min, max)``, else 1). A free worker
(one the job does not use, else the lost rank's own when only its process died) gets a replacement rank at
once, started into the running attempt (``RankTask.joined``; ``ddp.live.replace``, at most
``ddp.live.max-replacements`` an attempt). The survivors get a :class:`~dask_ddp.wire.messages.PeerLost`
through their supervisors, wait for the replacement and heal it from their memory; with no free worker they go
on without it, and take a replacement in at a step boundary once a worker is free (:func:`regrow`, from the
controller's notice desk). The attempt's result is the values of the ranks that finished it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import dask

from dask_ddp.client.attempt import Attempt
from dask_ddp.wire import plan as planning
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.spec import LaunchSpec

__all__ = ["RECOVERY", "handled", "why_not", "tell", "regrow", "settled"]

RECOVERY = ("restart", "live")


def handled(spec: LaunchSpec, cluster, att: Attempt, outcome: RankOutcome, usable: Callable[[], Mapping[str, dict]],
            note: Callable[[str], None]) -> bool:
    """For the failed rank of ``outcome``: True when a ``recovery="live"`` job goes on without it (the ranks
    left are told, a replacement started if ``usable()`` has a free worker, ``note`` given ``job.history``'s
    line); False when the attempt must end (``note`` given why live recovery could not go on, for a live job)."""
    why = why_not(spec, att, outcome)
    if why is None:
        note(tell(cluster, att, outcome, usable()))
    elif spec.recovery == "live" and outcome.status in (Status.DIED, Status.LOST):
        note(f"rank {outcome.rank} on {outcome.worker} {outcome.status}: no live recovery ({why}): the attempt ends")
    return why is None


def why_not(spec: LaunchSpec, att: Attempt, outcome: RankOutcome) -> str | None:
    """Why a job does not go on without the rank of ``outcome`` (see the module docstring), or None: it does."""
    if spec.recovery != "live":
        return "recovery is not live"
    if outcome.status not in (Status.DIED, Status.LOST):
        return "the rank's own failure"
    if outcome.rank == 0 and outcome.status == Status.LOST:  # the keeper lives on the worker's host
        return "rank 0's worker was lost, and the job's store with it (its keeper runs on that host)"
    bounds = planning.elastic_bounds(spec.workers)
    left = [r.rank for r in att.plan.ranks if r.rank not in att.outcomes and r.rank != outcome.rank]
    need = bounds[0] if bounds else 1
    return None if len(left) >= need else f"{len(left)} ranks left, fewer than the {need} the job needs"


def tell(cluster, att: Attempt, outcome: RankOutcome, usable: Mapping[str, dict]) -> str:
    """Count ``outcome``'s rank recovered, start its replacement on a free worker of ``usable`` (the workers a
    plan may use) if there is one, tell the ranks still running, and return ``job.history``'s line."""
    att.recovered.add(outcome.rank)
    left = [r for r in att.plan.ranks if r.rank not in att.outcomes]
    why = f"rank {outcome.rank} on {outcome.worker} {'was lost' if outcome.status == Status.LOST else 'died'}"
    cfg, joined = dask.config.get("ddp.live"), att.tasks[outcome.rank].joined  # which process of the rank
    spare = _spare(att, outcome, usable) if cfg["replace"] and att.joins < cfg["max-replacements"] else None
    replaced = [(outcome.rank, _replace(cluster, att, outcome.rank, spare, usable[spare]))] if spare else []
    cluster.peer_lost(att.tasks[0], [r.address for r in att.plan.ranks if r.rank not in att.outcomes],
                      [outcome.rank], why, replaced, [joined])
    then = (f"its replacement starts on {spare} and heals from their memory" if spare else
            f"{len(left)} ranks go on (ranks {', '.join(str(r.rank) for r in left)})")
    return f"{why}: live recovery, the survivors keep their processes; {then}"


def _spare(att: Attempt, outcome: RankOutcome, usable: Mapping[str, dict]) -> str | None:
    """A worker to start the replacement on: one the job does not use, else the lost rank's own (its process
    died, its worker lives); None: none is free."""
    busy = {r.address for r in att.plan.ranks if r.rank not in att.outcomes}
    free = [a for a in usable if a not in busy]
    outside = [a for a in free if a not in att.plan.addresses]
    mine = [a for a in free if a == outcome.worker]
    return outside[0] if outside else mine[0] if mine else None


def _replace(cluster, att: Attempt, rank: int, address: str, info: Mapping) -> int:
    """Start rank ``rank`` again on ``address`` in the running attempt (``RankTask.joined``: the n-th so started);
    its task, future and place in the plan replace the lost one's. Returns n."""
    att.joins += 1
    old = att.tasks[rank]
    spec = replace(old.rank, address=address, host=info.get("host") or planning.parse_address(address)[0],
                   name=str(info.get("name", address)))
    task = replace(old, rank=spec, joined=att.joins, via=None)  # no hub: the lost worker may have been it
    att.tasks[rank], att.futures[rank] = task, cluster.submit([task])[0]
    att.plan = replace(att.plan, ranks=tuple(spec if r.rank == rank else r for r in att.plan.ranks))
    att.outcomes.pop(rank, None)
    att.recovered.discard(rank)
    return att.joins


def regrow(cluster, att: Attempt, usable: Mapping[str, dict]) -> str | None:
    """A live job that went on smaller: start a replacement for its lowest lost rank on a free worker of
    ``usable`` (within ``ddp.live.max-replacements``) and tell the ranks, which take it in at their next step
    boundary. Returns ``job.history``'s line, or None (nothing lost, or no worker free)."""
    cfg = dask.config.get("ddp.live")
    if not att.recovered or not cfg["replace"] or att.joins >= cfg["max-replacements"]:
        return None
    rank = min(att.recovered)
    spare = _spare(att, att.outcomes[rank], usable)
    if spare is None:
        return None
    n = _replace(cluster, att, rank, spare, usable[spare])
    cluster.peer_lost(att.tasks[0], [r.address for r in att.plan.ranks if r.rank not in att.outcomes], [],
                      f"rank {rank} starts again on {spare}", [(rank, n)], [])
    return (f"worker {spare} is free: rank {rank} starts again there and the live group takes it in at its next "
            "step, healed from the others' memory")


def settled(att: Attempt) -> dict[int, RankOutcome]:
    """The outcomes that decide the attempt: those of the ranks it did not go on without."""
    return {rk: o for rk, o in att.outcomes.items() if rk not in att.recovered}
