"""What one rank's Dask task carries: :class:`RankTask`, built in one place (:func:`dask_ddp.client.launch.rank_tasks`).

Runs in: the client builds it; the rank supervisor (Dask worker) and the rank
process read it. It is pickled once per rank per attempt; ``call`` (the
pickled training function and its arguments) is the only large field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dask_ddp.wire.events import EventLimits
from dask_ddp.wire.plan import RankSpec, torchrun_env

__all__ = ["RankTask", "topic_of", "TOKEN_VARIABLE", "PRELOAD_VARIABLE"]


def topic_of(run_id: str) -> str:
    """The Dask event topic of a job: one topic per run."""
    return f"dask-ddp-{run_id}"


TOKEN_VARIABLE = "DASK_DDP_RANK_TOKEN"
PRELOAD_VARIABLE = "DASK_DDP_PRELOAD"  # ddp.zygote-preload, comma-separated, for the warm process (rank.warm)


@dataclass(frozen=True)
class RankTask:
    """One rank of one attempt: where it runs, what it runs, and the job's settings it needs."""

    run_id: str
    attempt: int
    rank: RankSpec
    master_addr: str
    backend: str
    call: bytes = field(repr=False)
    timeout: float = 1800
    rendezvous_timeout: float = 300
    spawn_timeout: float = 120
    poll_interval: float = 0.25
    flush_interval: float = 1.0
    via: str | None = None  # the worker whose hub publishes this rank's event batches with its host's (hub_plan)
    hub_interval: float = 1.0  # seconds between that hub's events
    limits: EventLimits = field(default_factory=EventLimits)  # what this rank may send (the rank and relay check)
    telemetry_interval: float | None = 1.0  # seconds between a rank's telemetry samples; None: off
    max_restarts: int = 0
    checkpoint_dir: str | None = field(default=None, repr=False)  # its URL may carry credentials (userinfo)
    checkpoint_options: dict = field(default_factory=dict, repr=False)  # may hold credentials
    # a job that may restart keeps its workers' next spares warm while it runs: a restart then starts at once
    # (a job that cannot restart starts them when it ends, so that they never compete with training)
    spare_early: bool = False
    # the next job's rank is forked as this one starts and starts CUDA meanwhile (ddp.warm-cuda; sweeps' trials)
    warm_cuda: bool = False
    # "live": a lost rank's peers go on without it in their processes (dask_ddp.rank.live); "restart": every fault
    # restarts the job (the default)
    recovery: str = "restart"
    extra_env: dict = field(default_factory=dict)  # the job's own variables (run(accelerate_config=...))
    # 0: a rank started with its attempt; n: the n-th rank a live job started into its running attempt, in the
    # place of a lost one: it joins the survivors' group (dask_ddp.rank.live) instead of the first rendezvous
    joined: int = 0
    # the attempt's store keys live under dask_ddp/<secret>/ (see :attr:`store_prefix`): it keeps attempts and
    # other users of a store apart, but it is no secret from whoever reaches the store (TCPStore.list_keys()
    # lists every key); what keeps a preemption notice from being forged is signing_key
    secret: str = field(default="", repr=False)
    # the attempt's random HMAC key (wire.notices.Seal): every value of the preemption protocol in the store is
    # signed with it and checked on read. It travels only inside this task (over TLS where the cluster uses it)
    # and to the rank process over its private socket, never to the store; empty: the rank draws its own (alone)
    signing_key: bytes = field(default=b"", repr=False)

    @property
    def attempt_id(self) -> str:
        """``<run_id>-<attempt>``: names everything of this attempt on the cluster."""
        return f"{self.run_id}-{self.attempt}"

    @property
    def topic(self) -> str:
        return topic_of(self.run_id)

    @property
    def abort_event(self) -> str:
        """Name of the Dask ``Event`` that stops every rank of the attempt."""
        return f"dask-ddp-abort-{self.attempt_id}"

    @property
    def cancel_event(self) -> str:
        """Name of the Dask ``Event`` set (with :attr:`abort_event`) by ``cancel()``: it wins over a notice."""
        return f"dask-ddp-cancel-{self.attempt_id}"

    @property
    def store_prefix(self) -> str:
        """The prefix of every rendezvous-store key of dask-ddp's own (joins, devices, preemption notices)."""
        return f"dask_ddp/{self.secret}/"

    @property
    def port_variable(self) -> str:
        """Name of the Dask ``Variable`` holding rank 0's store port (and, + ``-ready``, the Event set with it)."""
        return f"dask-ddp-port-{self.attempt_id}"

    @property
    def key(self) -> str:
        """The Dask key of the rank's task."""
        return f"dask-ddp-{self.attempt_id}-rank{self.rank.rank}" + (f"-j{self.joined}" if self.joined else "")

    @property
    def token(self) -> str:
        """Marks every process of this rank (``DASK_DDP_RANK_TOKEN`` in its environment, inherited by
        whatever it starts): how the supervisor finds the helpers that left the rank's session."""
        return f"{self.attempt_id}/{self.rank.rank}" + (f"/j{self.joined}" if self.joined else "")

    @property
    def env(self) -> dict[str, str]:
        """torchrun's environment for the rank (all but MASTER_PORT, known once rank 0 has bound it), over the
        job's own variables (:attr:`extra_env`)."""
        return self.extra_env | torchrun_env(self.rank, self.master_addr, self.run_id, self.attempt,
                                             self.max_restarts) | {TOKEN_VARIABLE: self.token}
