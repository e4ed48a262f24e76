"""The frozen launch spec of a job: everything ``run()`` validated, nothing live.

Runs in: the client. :func:`dask_ddp.dispatch.run` builds it once; the
controller reads it for every attempt; :func:`dask_ddp.client.launch.rank_tasks` turns
it into the per-rank tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dask_ddp.wire.events import EventLimits
from dask_ddp.wire.plan import RankPlan

__all__ = ["LaunchSpec"]


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs, validated and frozen on the client (see ``run``'s parameters)."""

    call: bytes = field(repr=False)  # cloudpickle of (fn, args, kwargs)
    fn_name: str
    run_id: str  # unique per job: names its topic, tasks, store keys, Dask objects and checkpoint folder
    first_plan: RankPlan
    workers: Any = None  # the selection as given: None, n, [addresses/names] or (min, max)
    backend: str = "auto"
    master_addr: str | None = None
    name: str | None = None
    timeout: float = 1800
    rendezvous_timeout: float = 300
    spawn_timeout: float = 120
    poll_interval: float = 0.25
    flush_interval: float = 1.0
    max_batches_per_second: float | None = 60  # the job's event batches, all ranks (client.launch.flush_interval_for)
    events_per_host: bool | str = "auto"  # publish through a hub per host (client.launch.hub_plan, ddp.events.per-host)
    event_limits: EventLimits = field(default_factory=EventLimits)  # what one rank may send (ddp.events.max-*)
    telemetry_interval: float | None = 1.0  # None: no telemetry (ddp.telemetry.enabled: false)
    straggler_window: float | None = 30.0  # seconds one rank must be the cause before it is named; None: off
    stall_timeout: float | None = None
    worker_timeout: float | None = 6
    max_restarts: int = 0
    recovery: str = "restart"  # or "live": survivors of a lost rank go on in their processes (dask_ddp.rank.live)
    restart_wait: float = 60
    checkpoint_dir: str | None = field(default=None, repr=False)  # its URL may carry credentials (userinfo)
    checkpoint_options: dict = field(default_factory=dict, repr=False)  # may hold credentials
    progress: bool = True
    total: int | None = None
    echo_logs: bool = True
    callbacks: tuple = ()
    warm_cuda: bool = False  # the next rank of each worker starts CUDA while this job runs (ddp.warm-cuda; sweeps)
    env: dict = field(default_factory=dict)  # more variables for every rank (run(accelerate_config=...))
