"""The worker-side owner of dask-ddp's state: a Dask ``WorkerPlugin`` holding the zygote and the running ranks.

Runs in: the Dask worker (the plugin), and the client (:func:`register`,
called by ``run`` and ``warm_up`` before anything is submitted).

Each worker keeps a warm process for the next job (a zygote that forks ranks,
or a spare rank process; torch imported in either), and an index of the rank
supervisors running on it, for stack dumps and for tests. ``setup`` happens when the plugin reaches the worker (Dask
sends it to every worker, and to every worker that joins later);
``teardown`` when the worker closes: it stops the worker's ranks and its
zygote, so a closing worker never leaves a rank process behind.

The probes at the bottom run through ``client.run`` (they take the
``dask_worker`` argument Dask passes).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import signal
import threading
import time
from typing import Protocol

import dask
from distributed import WorkerPlugin
from distributed.core import Status

from dask_ddp.wire.notices import Notice
from dask_ddp.wire.task import RankTask
from dask_ddp.worker.hub import HANDLER, Hubs
from dask_ddp.worker.launcher import Launcher
from dask_ddp.worker.leaving import RANK_HOST, drain, leave_on_sigterm
from dask_ddp.worker.leaving import register as leave_gracefully
from dask_ddp.worker.tmpdirs import sweep_tmp_roots, worker_tmp_root


class Supervisor(Protocol):
    """What the host needs of a rank supervisor (:class:`dask_ddp.worker.supervisor.Supervisor`, which imports
    this module: a Protocol, not an import, keeps the two apart)."""

    task: RankTask
    rank: int
    ended: threading.Event
    saving: bool

    def stop(self, reason: str) -> None: ...

    def kill(self) -> None: ...

    def stacks(self, timeout: float) -> str: ...

    def notice(self, notice: Notice) -> None: ...

__all__ = ["RankHost", "register", "ignore_interrupts", "rank_process_pids", "dump_stacks", "warm_spare",
           "queued_tasks", "cool_spares", "stop_warm_cuda"]

logger = logging.getLogger("dask_ddp")

NAME = RANK_HOST  # "dask-ddp"
_CLOSING = (Status.closing, Status.closed, Status.failed)
STOP_WAIT = 3.0  # seconds a closing worker waits for its ranks' supervisors to relay what the ranks hold (1 s each)
class RankHost(WorkerPlugin):
    """dask-ddp's state on one Dask worker: its launcher (zygote or spare) and its running rank supervisors.

    Register it with :func:`register` (``run`` does); inside a task,
    :meth:`of` finds it. It pickles empty: the state is made in ``setup``.
    """

    name = NAME
    idempotent = True  # a second client (a second notebook) must not replace the one a running job uses

    def setup(self, worker) -> None:
        self.worker = worker
        self.launcher = Launcher()
        self.active: dict[tuple[str, int], Supervisor] = {}  # (attempt id, rank) -> supervisor
        self._lock = threading.Lock()
        self.hubs = Hubs(worker, dask.config.get("ddp.events.max-batch-bytes"))
        worker.handlers[HANDLER] = self.hubs.receive  # the ranks of this host may send their event batches here
        sweep_tmp_roots()  # what a killed worker's ranks left in the temp folder
        ignore_interrupts(worker)
        leave_on_sigterm(self)  # a batch system's SIGTERM to every process of the job: the ranks save first

    async def teardown(self, worker) -> None:
        """Stop the zygote or spare; when the worker is closing, let its ranks save for a preemption (up to
        ``ddp.preemption.grace-period``, see :mod:`dask_ddp.worker.leaving`), then stop them (nothing outlives it)."""
        closing = getattr(worker, "status", None) in _CLOSING
        if closing:  # before the zygote goes: its forked ranks die with it
            await drain(self, f"worker {getattr(worker, 'address', '?')} is closing (retire_workers, a scale-down "
                              "or close)")
            await self.stop_ranks("its Dask worker is closing")
        self.launcher.close()
        self.hubs.close()
        if closing:
            shutil.rmtree(worker_tmp_root(), ignore_errors=True)  # its ranks' TMPDIRs, whatever is left

    async def stop_ranks(self, reason: str, wait: float = STOP_WAIT) -> None:
        """Stop every rank on this worker: each supervisor relays what its rank holds, then kills it (see
        :meth:`Supervisor.stop <dask_ddp.worker.supervisor.Supervisor.stop>`); after ``wait`` s the rest are killed.
        Nothing outlives the worker, and what the ranks reported reaches the scheduler before its stream closes."""
        sups = self.running()
        for sup in sups:
            sup.stop(reason)
        deadline = time.monotonic() + wait
        while not all(s.ended.is_set() for s in sups) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # side by side, off the event loop: each may wait out its rank's grace (SIGTERM, then SIGKILL)
        await asyncio.gather(*(asyncio.to_thread(sup.kill) for sup in sups))

    def __getstate__(self) -> dict:
        return {}

    @classmethod
    def of(cls, worker) -> "RankHost":
        """The worker's RankHost; installed here if no client registered one (it then lives with the worker)."""
        host = worker.plugins.get(NAME)
        if host is None:
            host = cls()
            host.setup(worker)
            worker.plugins[NAME] = host
        return host

    def add(self, sup: "Supervisor") -> None:
        with self._lock:
            self.active[(sup.task.attempt_id, sup.rank)] = sup

    def remove(self, sup: "Supervisor") -> None:
        with self._lock:
            self.active.pop((sup.task.attempt_id, sup.rank), None)

    def running(self, attempt_id: str | None = None) -> list["Supervisor"]:
        """The supervisors running on this worker (of one attempt, if given)."""
        with self._lock:
            return [s for (aid, _), s in self.active.items() if attempt_id is None or aid == attempt_id]


def ignore_interrupts(worker) -> bool:
    """Make a worker process that a Nanny runs ignore SIGINT; True if it now does.

    Jupyter's "interrupt kernel" sends SIGINT to the kernel's whole process group, and the worker processes of
    a ``LocalCluster`` (or ``LocalCUDACluster``) started in the notebook are in that group: each died of the
    KeyboardInterrupt (dask/distributed#1925), taking the job's ranks with it, and a terminal's Ctrl-C did the
    same to the workers of a ``dask worker`` command. The Nanny owns its worker's life (it stops it on close,
    SIGTERM or its own Ctrl-C) and never uses SIGINT for it. Left alone: a worker without a Nanny (its process
    may be the one that must stop on Ctrl-C, or the notebook's own), one whose SIGINT handler is someone's own
    (neither Python's default nor that of the ``asyncio.run`` the worker process runs in, which turns SIGINT
    into a KeyboardInterrupt), and any call off the main thread. Rank processes restore the default
    (:func:`dask_ddp.rank.main.serve`).
    """
    if getattr(worker, "nanny", None) is None or threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.SIG_IGN:
        return True
    asyncio_run = isinstance(handler, functools.partial) and getattr(handler.func, "__name__", "") == "_on_sigint"
    if handler is not signal.default_int_handler and not asyncio_run:
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True


def register(client) -> None:
    """Make sure every worker of ``client``'s cluster, and every worker that joins later, has a RankHost.

    One round trip to the scheduler, a no-op when any client registered it before.
    """
    client.register_plugin(RankHost(), name=NAME)
    leave_gracefully(client)  # on every Nanny: SIGTERM gives the ranks the grace period to save


def rank_process_pids(dask_worker) -> dict:
    """Pids of this worker's rank processes: ``{"spare": [...], "running": [...], "zygote": pid or None}`` (for
    tests and tools; the zygote is among the spares too)."""
    host = RankHost.of(dask_worker)
    return {"spare": host.launcher.pids(), "running": [s.child.pid for s in host.running() if s.child],
            "zygote": host.launcher.zygote_pid()}


async def cool_spares(dask_worker=None) -> None:
    """End this worker's rank forked ahead if it started CUDA (``ddp.warm-cuda``; :meth:`Launcher.cool`): a sweep
    that ended gives the GPU memory back at once; run through ``client.run`` (a coroutine: ``wait=False``)."""
    await asyncio.to_thread(RankHost.of(dask_worker).launcher.cool)


def stop_warm_cuda(client) -> None:
    """From the client: :func:`cool_spares` on every worker, not waiting for them; never raises (a sweep's end)."""
    try:
        client.run(cool_spares, wait=False)
    except Exception:  # noqa: BLE001 - the client is closing: its workers' spares cool after WARM_CUDA_IDLE
        logger.debug("dask-ddp: the workers' CUDA-started ranks were not ended", exc_info=True)


async def warm_spare(timeout: float = 120.0, dask_worker=None) -> bool:
    """Start this worker's zygote (or spare) now and wait until torch is imported; run through ``client.run``."""
    host = RankHost.of(dask_worker)
    host.launcher.refill(force=True)
    return await asyncio.to_thread(host.launcher.wait_ready, timeout)


async def dump_stacks(attempt_id: str, timeout: float = 5.0, dask_worker=None) -> dict:
    """Ask this worker's ranks of ``attempt_id`` for a Python stack dump; run through ``client.run``."""
    sups = RankHost.of(dask_worker).running(attempt_id)
    results = await asyncio.gather(*(asyncio.to_thread(s.stacks, timeout) for s in sups))
    return {s.rank: text for s, text in zip(sups, results)}


def queued_tasks(keys: list[str], dask_worker=None) -> dict:
    """Which of ``keys`` this worker holds without running them (no free thread), and what its threads run.

    Returns ``{"queued": [key, ...], "running": [key, ...] (the first 5), "more": n, "threads": nthreads}``;
    run through ``client.run``.
    """
    state = dask_worker.state
    queued = [k for k in keys if getattr(state.tasks.get(k), "state", None) in ("ready", "constrained")]
    running = sorted(str(ts.key) for ts in state.executing)
    return {"queued": queued, "running": running[:5], "more": max(0, len(running) - 5), "threads": state.nthreads}
