"""Launching an attempt: every rank's task, and the event-rate policy the tasks carry.

Runs in: the client (the controller calls :func:`rank_tasks` once per attempt).

The policy bounds what a job costs the shared scheduler: each event batch costs
it about the same CPU whatever its size, so a job's batch rate is bounded
(``ddp.events.max-batches-per-second``) by stretching the ranks' flush interval
(:func:`flush_interval_for`) or by publishing through one hub per host
(:func:`hub_plan`, :mod:`dask_ddp.worker.hub`).
"""

from __future__ import annotations

import secrets

from dask_ddp.wire.plan import RankPlan
from dask_ddp.wire.spec import LaunchSpec
from dask_ddp.wire.task import RankTask

__all__ = ["rank_tasks", "flush_interval_for", "hub_plan", "HUB_COST_PER_RANK"]


def flush_interval_for(world_size: int, interval: float, max_batches_per_second: float | None = 60,
                       rank: int | None = None) -> float:
    """Seconds between rank ``rank``'s event batches in a job of ``world_size`` ranks: ``interval``, or longer when
    the job would otherwise send the scheduler more than ``max_batches_per_second`` batches in all.

    Each batch costs the scheduler about the same CPU whatever its size (benchmarks/RESULTS_events_scale.md
    measures it: 1.0-1.3 ms of a scheduler core on the 2-core development box), so bounding the job's batch
    rate bounds its share of the scheduler at any world size: the default, 60 a second, keeps a job at 6-8 %
    of one scheduler core. Up to 60 ranks every rank flushes every ``interval`` (1 s). Past that, rank 0 keeps
    ``interval`` (its reports drive the notebook's progress bar and live metrics, so they stay about a second
    old at any size) and the other ranks share what is left of the budget: at 1,000 ranks each flushes every
    999 / 59 = 16.9 s. ``rank=None`` gives a rank other than 0. ``max_batches_per_second`` None or 0: no bound.
    When the bound is below rank 0's own rate, every rank gets ``world_size / max_batches_per_second``.

    Raises
    ------
    ValueError
        If ``world_size`` < 1, ``interval`` <= 0 or ``max_batches_per_second`` < 0.
    """
    if world_size < 1 or not interval > 0 or (max_batches_per_second or 0) < 0:
        raise ValueError(f"flush_interval_for({world_size!r}, {interval!r}, {max_batches_per_second!r}): expected "
                         "world_size >= 1, interval > 0 and max_batches_per_second >= 0 (ddp.events)")
    interval = float(interval)
    if not max_batches_per_second:
        return interval
    uniform = max(interval, world_size / max_batches_per_second)
    rest = max_batches_per_second - 1 / interval  # what rank 0 leaves to the others
    if uniform == interval or world_size == 1 or rest <= 0:
        return uniform
    return interval if rank == 0 else max(interval, (world_size - 1) / rest)


HUB_COST_PER_RANK = 0.06  # a hub event's scheduler CPU over one batch's, per rank past the first (measured: 0.05)


def hub_plan(plan: RankPlan, interval: float, max_batches_per_second: float | None = 60,
             per_host: bool | str = "auto") -> dict[int, tuple[str, float]] | None:
    """Whether the job's ranks publish their event batches through a hub per host (:mod:`dask_ddp.worker.hub`): None if
    not (each rank publishes its own, every :func:`flush_interval_for` its world size), else ``{rank: (hub
    worker, hub interval)}``.

    A host's hub is the worker of its local rank 0; it publishes every :func:`flush_interval_for` the number of
    hosts (the host of rank 0 every ``interval``), so the job's bound holds with hosts in place of ranks. A hub's
    event costs the scheduler more than one rank's batch, by ``HUB_COST_PER_RANK`` for each rank past the first
    (benchmarks/RESULTS_events_scale.md), so the bound is divided by that weight: 1,000 ranks on 125 hosts of 8
    (weight 1.42) publish every 124 / (60 / 1.42 - 1) = 3.0 s, the host of rank 0 every second (16.9 s without
    hubs). ``per_host`` (``ddp.events.per-host``): ``"auto"`` uses hubs when the bound would stretch a rank's
    interval and some host runs several ranks; True whenever the job has more than one rank; False never.

    Raises
    ------
    ValueError
        If ``per_host`` is none of those, or as :func:`flush_interval_for`.
    """
    if per_host not in ("auto", True, False):
        raise ValueError(f"ddp.events.per-host={per_host!r}: expected auto, true or false")
    hosts = plan.ranks[0].num_nodes if plan.ranks else 1
    if per_host == "auto":
        stretched = flush_interval_for(plan.world_size, interval, max_batches_per_second, rank=None) > interval
        per_host = stretched and hosts < plan.world_size
    if not per_host or plan.world_size < 2:
        return None
    leaders = {r.node_rank: r.address for r in plan.ranks if r.local_rank == 0}
    weight = 1 + HUB_COST_PER_RANK * (max(r.local_world_size for r in plan.ranks) - 1)
    bound = max_batches_per_second / weight if max_batches_per_second else max_batches_per_second
    return {r.rank: (leaders[r.node_rank], flush_interval_for(hosts, interval, bound, r.node_rank))
            for r in plan.ranks}


def rank_tasks(spec: LaunchSpec, run_id: str, attempt: int, plan: RankPlan) -> list[RankTask]:
    """The tasks of every rank of ``plan`` for attempt ``attempt`` (0 first), in rank order."""
    hubs = hub_plan(plan, spec.flush_interval, spec.max_batches_per_second, spec.events_per_host)

    def events(rank: int) -> dict:
        if hubs is None:
            return {"flush_interval": flush_interval_for(plan.world_size, spec.flush_interval,
                                                         spec.max_batches_per_second, rank)}
        via, hub_interval = hubs[rank]
        return {"flush_interval": spec.flush_interval, "via": via, "hub_interval": hub_interval}

    secret = secrets.token_hex(16)  # the attempt's store keys: see RankTask.secret
    key = secrets.token_bytes(32)  # the attempt's HMAC key for what its ranks trust in the store: RankTask.signing_key
    return [RankTask(run_id=run_id, attempt=attempt, secret=secret, signing_key=key, rank=r,
                     master_addr=plan.master_addr,
                     backend=spec.backend,
                     call=spec.call, timeout=spec.timeout, rendezvous_timeout=spec.rendezvous_timeout,
                     spawn_timeout=spec.spawn_timeout, poll_interval=spec.poll_interval, **events(r.rank),
                     limits=spec.event_limits,
                     telemetry_interval=spec.telemetry_interval, max_restarts=spec.max_restarts,
                     checkpoint_dir=spec.checkpoint_dir, checkpoint_options=spec.checkpoint_options,
                     spare_early=attempt < spec.max_restarts, warm_cuda=spec.warm_cuda, recovery=spec.recovery,
                     extra_env=spec.env)
            for r in plan.ranks]
