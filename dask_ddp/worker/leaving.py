"""A worker that is told to leave gives its ranks the grace period to save first.

Runs in: the Dask worker (:func:`drain`, from :meth:`RankHost.teardown
<dask_ddp.worker.plugin.RankHost.teardown>` when the worker closes: ``retire_workers``,
``adapt()`` and ``cluster.scale(n)`` down, a worker closed directly), the
Nanny (:class:`LeaveGracefully`: SIGTERM to a ``dask worker`` process, whose
Nanny would otherwise stop the worker process within 8 s), and the client
(:func:`register`, :func:`notify`).

Each way ends in :func:`drain`: send every rank running on this worker a
:class:`~dask_ddp.wire.messages.Notice` with the deadline ``now +
ddp.preemption.grace-period``, then hold the close until those ranks have
stopped at the agreed step (their save is committed) or the deadline passes.
The ranks pass the notice to every other rank of the job themselves (see
:mod:`dask_ddp.rank.preemption`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from distributed.core import Status, rpc
from distributed.diagnostics.plugin import NannyPlugin
from distributed.protocol import pickle

from dask_ddp.wire.notices import Notice, grace_period

__all__ = ["drain", "LeaveGracefully", "register", "notify", "grace_period"]

logger = logging.getLogger("dask_ddp")

NAME = "dask-ddp-leave"
CONNECT_TIMEOUT = 5.0  # seconds for a Nanny to reach its own worker (same machine): more means it is dead
RANK_HOST = "dask-ddp"  # the name of the workers' RankHost plugin (dask_ddp.worker.plugin, which imports this module)
_registered: "weakref.WeakSet" = weakref.WeakSet()


async def drain(host, cause: str, grace: float | None = None) -> int:
    """Notice every rank running on ``host``'s worker, then wait until they have ended or the grace period
    has passed; return how many ranks were told."""
    sups = host.running()
    if not sups:
        return 0
    grace = grace_period() if grace is None else grace
    deadline = time.time() + grace
    address = getattr(host.worker, "address", "")
    for sup in sups:
        sup.notice(Notice(deadline, cause, address))
    logger.info("dask-ddp: %s; %d rank(s) here save before it goes (up to %.0f s)", cause, len(sups), grace)
    while any(s in host.running() and s.saving for s in sups) and time.time() < deadline:
        await asyncio.sleep(0.02)
    return len(sups)


async def drain_on_worker(cause: str, dask_worker=None) -> int:
    """:func:`drain` on this worker; the Nanny runs it through the worker's ``run`` handler."""
    host = dask_worker.plugins.get(RANK_HOST)
    if host is None:
        return 0
    told = await drain(host, cause)
    if told:
        await asyncio.sleep(0.5)  # let the ranks' task results reach the scheduler before the process stops
    return told


class LeaveGracefully(NannyPlugin):
    """On a Nanny: when it closes (SIGTERM to ``dask worker``, a cluster scaling down), it first lets the ranks
    of its worker save (:func:`drain`), then stops the worker process as usual."""

    name = NAME
    idempotent = True

    def setup(self, nanny) -> None:
        self.nanny = nanny

    async def teardown(self, nanny) -> None:
        process = getattr(nanny, "process", None)
        address = getattr(process, "worker_address", None)
        if not address or getattr(process, "status", None) != Status.running:
            return  # no worker, or one still starting: its address is the one before a restart, its ranks are gone
        try:
            # The worker runs beside its Nanny: it takes a connection at once, or it has died (killed, not yet
            # noticed). distributed retries a refused connection for distributed.comm.timeouts.connect (30 s),
            # which every close of a cluster with a crashed worker would then wait.
            async with rpc(address, timeout=CONNECT_TIMEOUT, connection_args=nanny.connection_args) as worker:
                await asyncio.wait_for(worker.run(
                    function=pickle.dumps(drain_on_worker),
                    kwargs=pickle.dumps({"cause": f"worker {address} is closing (its Nanny was stopped: SIGTERM "
                                                  "or a scale-down)"})), grace_period() + 5)
        except Exception:  # noqa: BLE001 - the worker is gone already: nothing left to save
            logger.debug("dask-ddp: could not ask worker %s to drain", address, exc_info=True)


def register(client) -> None:
    """Install :class:`LeaveGracefully` on every Nanny of ``client``'s cluster (once per client)."""
    if client in _registered:
        return
    client.register_plugin(LeaveGracefully(), name=NAME)
    _registered.add(client)


async def _notice_here(attempt_id: str, deadline: float, cause: str, dask_worker=None) -> int:
    host = dask_worker.plugins.get(RANK_HOST)
    sups = host.running(attempt_id) if host is not None else []
    for sup in sups:
        sup.notice(Notice(deadline, cause, "", "grow"))
    return len(sups)


def notify(client, attempt_id: str, addresses: list[str], cause: str, grace: float) -> None:
    """From the client: ask every rank of ``attempt_id`` to save and stop (the job grows)."""
    client.run(_notice_here, attempt_id, time.time() + grace, cause, workers=list(addresses), on_error="ignore")
