"""A worker that is told to leave gives its ranks the grace period to save first.

Runs in: the Dask worker (:func:`drain`, from :meth:`RankHost.teardown
<dask_ddp.worker.plugin.RankHost.teardown>` when the worker closes: ``retire_workers``,
``adapt()`` and ``cluster.scale(n)`` down, a worker closed directly; and from
:func:`leave_on_sigterm`'s handler: SIGTERM to the worker process itself), the
Nanny (:class:`LeaveGracefully`: SIGTERM to a ``dask worker`` process, whose
Nanny would otherwise stop the worker process within 8 s), and the client
(:func:`register`, :func:`notify`).

Each way ends in :func:`drain`: send every rank running on this worker a
:class:`~dask_ddp.wire.messages.Notice` with the deadline ``now +
ddp.preemption.grace-period``, then hold the close until those ranks have
stopped at the agreed step (their save is committed) or the deadline passes.
The ranks pass the notice to every other rank of the job themselves (see
:mod:`dask_ddp.rank.preemption`).

Why the worker process handles SIGTERM too: a batch system signals every
process of a job, not only its main one (SLURM's ``scancel`` sends SIGTERM to
all of them, then SIGKILL ``KillWait`` s later), and a worker process that a
Nanny runs otherwise dies of it at once, its ranks with it, before its Nanny
can ask it to drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import weakref

from distributed.core import Status, rpc
from distributed.diagnostics.plugin import NannyPlugin
from distributed.protocol import pickle

from dask_ddp.wire.notices import Notice, grace_period

__all__ = ["drain", "leave_on_sigterm", "LeaveGracefully", "register", "notify", "grace_period"]

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


def leave_on_sigterm(host) -> bool:
    """Make SIGTERM to this worker process (one that a Nanny runs) a preemption notice; True if it now is.

    On SIGTERM the worker drains (:func:`drain`: its ranks save at a step they agree on, within
    ``ddp.preemption.grace-period``), then closes as a worker that is told to (its ranks' results reach the
    scheduler first); its Nanny goes on as when the process died of SIGTERM before (it starts a new one
    unless it is closing itself). A worker with no rank running closes at once. Left alone: a worker without
    a Nanny (the ``dask worker --no-nanny`` command closes it on SIGTERM, and :meth:`RankHost.teardown
    <dask_ddp.worker.plugin.RankHost.teardown>` drains), a SIGTERM handler that is someone else's, and any
    call off the main thread or outside the worker's event loop. Raises nothing.
    """
    if getattr(host.worker, "nanny", None) is None or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    try:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, _on_sigterm, host)
    except (RuntimeError, ValueError, NotImplementedError):  # no loop here, or a platform without it
        return False
    return True


_DRAINING: weakref.WeakSet = weakref.WeakSet()  # the rank hosts of this process draining after a SIGTERM


def _on_sigterm(host) -> None:
    if host in _DRAINING:
        return  # a second SIGTERM while draining: the first one's deadline stands
    _DRAINING.add(host)
    asyncio.ensure_future(_leave(host))


async def _leave(host) -> None:
    worker = host.worker
    address = getattr(worker, "address", "?")
    try:
        # Leaving from now on, as a retired worker: the scheduler gives it no new task, and a job that restarts
        # after its ranks saved does not plan a rank here (it did when the save beat the close: one run in 4)
        if getattr(worker, "status", None) == Status.running:
            worker.status = Status.closing_gracefully
        await drain(host, f"worker {address} received SIGTERM (a batch system's notice: SLURM's scancel or "
                          "--signal, a pod stopped)")
    finally:
        # Close, not die: the ranks' task results go to the scheduler before the stream closes. nanny=False:
        # the Nanny decides, as it did when SIGTERM ended the process (it is closing too, or starts a new one).
        await worker.close(nanny=False, reason="signal-15")


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


async def _notice_here(attempt_id: str, deadline: float, cause: str, kind: str = "grow", dask_worker=None) -> int:
    host = dask_worker.plugins.get(RANK_HOST)
    sups = host.running(attempt_id) if host is not None else []
    for sup in sups:
        sup.notice(Notice(deadline, cause, "", kind))
    return len(sups)


def notify(client, attempt_id: str, addresses: list[str], cause: str, grace: float, kind: str = "grow") -> None:
    """From the client: ask every rank of ``attempt_id`` to save and stop at an agreed step (``kind``: ``grow``,
    the job grows; ``stop``, the job ends there)."""
    client.run(_notice_here, attempt_id, time.time() + grace, cause, kind, workers=list(addresses), on_error="ignore")
