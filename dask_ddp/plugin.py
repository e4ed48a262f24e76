"""The worker-side owner of dask-ddp's state: a Dask ``WorkerPlugin`` holding the warm spare and the running ranks.

Runs in: the Dask worker (the plugin), and the client (:func:`register`,
called by ``run`` and ``warm_up`` before anything is submitted).

Each worker keeps at most one warm spare rank process (torch imported) for the
next job, and an index of the rank supervisors running on it, for stack dumps
and for tests. ``setup`` happens when the plugin reaches the worker (Dask
sends it to every worker, and to every worker that joins later);
``teardown`` when the worker closes: it stops the worker's ranks and its
spare, so a closing worker never leaves a rank process behind.

The probes at the bottom run through ``client.run`` (they take the
``dask_worker`` argument Dask passes).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING

import dask
from distributed import WorkerPlugin
from distributed.core import Status

from .process import RankProcess

if TYPE_CHECKING:
    from .supervisor import Supervisor

__all__ = ["RankHost", "register", "rank_process_pids", "dump_stacks", "warm_spare"]

NAME = "dask-ddp"
_CLOSING = (Status.closing, Status.closed, Status.failed)


class Spares:
    """At most one warm, unused rank process per Dask worker process."""

    def __init__(self):
        self._lock = threading.Condition()
        self._spare: RankProcess | None = None
        self._filling = False
        self._closed = False

    def take(self) -> RankProcess:
        """The warm spare if there is one (waiting for one being started), else a new rank process."""
        with self._lock:
            self._lock.wait_for(lambda: not self._filling, timeout=10)
            spare, self._spare = self._spare, None
        if spare is not None and spare.alive():
            return spare
        if spare is not None:
            spare.kill()
        return RankProcess()

    def refill(self, force: bool = False) -> None:
        """Start a spare in the background for the next job (``ddp.warm-spare``, or ``force``)."""
        if not (force or dask.config.get("ddp.warm-spare")):
            return
        with self._lock:
            if self._spare is not None or self._filling or self._closed:
                return
            self._filling = True
        threading.Thread(target=self._fill, name="dask-ddp-spare", daemon=True).start()

    def _fill(self) -> None:
        try:
            proc = RankProcess()
        except Exception:  # noqa: BLE001 - no spare then; take() starts one when needed
            proc = None
        with self._lock:
            if self._closed and proc is not None:
                proc.kill()
                proc = None
            self._spare, self._filling = proc, False
            self._lock.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the spare has imported torch (its Ready is waiting to be read); True if it has."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.wait_for(lambda: not self._filling, timeout=timeout)
            spare = self._spare
        if spare is None or not spare.alive():
            return False
        while time.monotonic() < deadline:  # poll: take() may hand the spare to a job meanwhile
            try:
                if spare.conn.poll(0.1):
                    return True
            except OSError:  # closed: a job took it and has finished with it
                return False
            if not spare.alive():
                return False
        return False

    def pids(self) -> list[int]:
        """The spare's pid, if there is one."""
        with self._lock:
            return [self._spare.pid] if self._spare is not None else []

    def close(self) -> None:
        """Kill the spare and start no other."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()


class RankHost(WorkerPlugin):
    """dask-ddp's state on one Dask worker: its warm spare and its running rank supervisors.

    Register it with :func:`register` (``run`` does); inside a task,
    :meth:`of` finds it. It pickles empty: the state is made in ``setup``.
    """

    name = NAME
    idempotent = True  # a second client (a second notebook) must not replace the one a running job uses

    def setup(self, worker) -> None:
        self.worker = worker
        self.spares = Spares()
        self.active: dict[tuple[str, int], Supervisor] = {}  # (attempt id, rank) -> supervisor
        self._lock = threading.Lock()

    def teardown(self, worker) -> None:
        """Kill the spare; when the worker is closing, stop every running rank too (nothing outlives it)."""
        self.spares.close()
        if getattr(worker, "status", None) in _CLOSING:
            for sup in self.running():
                sup.stop("its Dask worker is closing")

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


def register(client) -> None:
    """Make sure every worker of ``client``'s cluster, and every worker that joins later, has a RankHost.

    One round trip to the scheduler, a no-op when any client registered it before.
    """
    client.register_plugin(RankHost(), name=NAME)


def rank_process_pids(dask_worker) -> dict:
    """Pids of this worker's rank processes: ``{"spare": [...], "running": [...]}`` (for tests and tools)."""
    host = RankHost.of(dask_worker)
    return {"spare": host.spares.pids(), "running": [s.child.pid for s in host.running() if s.child]}


async def warm_spare(timeout: float = 120.0, dask_worker=None) -> bool:
    """Start this worker's spare rank process now and wait until torch is imported; run through ``client.run``."""
    host = RankHost.of(dask_worker)
    host.spares.refill(force=True)
    return await asyncio.to_thread(host.spares.wait_ready, timeout)


async def dump_stacks(attempt_id: str, timeout: float = 5.0, dask_worker=None) -> dict:
    """Ask this worker's ranks of ``attempt_id`` for a Python stack dump; run through ``client.run``."""
    sups = RankHost.of(dask_worker).running(attempt_id)
    results = await asyncio.gather(*(asyncio.to_thread(s.stacks, timeout) for s in sups))
    return {s.rank: text for s, text in zip(sups, results)}
