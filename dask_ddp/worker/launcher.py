"""A worker's rank processes for its jobs: forked from its warm zygote, or spawned fresh; the next one kept ready.

Runs in: the Dask worker (held by its :class:`~dask_ddp.worker.plugin.RankHost`; ``take`` is called by each rank's
supervisor task, ``refill`` at a job's start and end, in threads of their own where it waits).

The next job's rank is forked ahead at a job's end, so that a job rarely waits for a fork; with ``ddp.warm-cuda``
(a sweep's trials) it is forked at the job's start instead and starts CUDA while the job runs, and is ended (its
GPU memory back) when no job takes it within :data:`WARM_CUDA_IDLE` seconds or the sweep ends (:meth:`cool`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import dask

from dask_ddp.wire.messages import WarmCuda
from dask_ddp.worker.process import RankProcess
from dask_ddp.worker.zygote import ForkedRank, Zygote

__all__ = ["Launcher", "WARM_CUDA_IDLE", "start_early"]

logger = logging.getLogger("dask_ddp")

# seconds a rank forked ahead that started CUDA (ddp.warm-cuda) waits for a job before it is replaced by one that
# did not: its CUDA context (~0.5 GB of GPU memory) is not kept once the sweep (or loop of jobs) has ended
WARM_CUDA_IDLE = 10.0
GPU_NODES = ("/dev/nvidiactl", "/dev/kfd")  # a GPU driver's device nodes (NVIDIA, AMD ROCm): ddp.warm-cuda's check
_EARLY: list[Zygote] = []  # the zygote start_early started in this worker process, until a Launcher takes it


def start_early() -> None:
    """Start this worker process's zygote now (``ddp.zygote``, the default; else nothing), in the background; the
    worker's first :class:`Launcher` takes it instead of starting one at the first job.

    For a worker's start (:mod:`dask_ddp.worker.early`): ``import torch`` in the zygote (or the zygote host)
    then runs while the cluster finishes starting and the client connects, not after the first job is sent.
    A zygote no job takes ends with the worker process (its socket closes). Raises nothing of its own.
    """
    if Launcher.forks() and not _EARLY:
        _EARLY.append(Zygote())


class Launcher:
    """Hands out this worker's rank processes: forked from its warm zygote (``ddp.zygote``, the default), or
    spawned fresh, with one warm spare kept for the next job (``ddp.warm-spare``).

    With the zygote, the end of a job also forks the next job's rank ahead (``refill(ahead=True)``): it waits for
    its Start as a spare would, and the next job takes it without waiting for a fork (15-20 ms of the start of a
    job, more on a loaded machine, moved into the end of the one before).
    """

    def __init__(self):
        self._lock = threading.Condition()
        self._zygote: Zygote | None = None
        self._spare: RankProcess | None = None
        self._forked: ForkedRank | None = None  # the next job's rank, forked ahead
        self._filling = self._forking = False
        self._closed = False

    @staticmethod
    def forks() -> bool:
        return bool(dask.config.get("ddp.zygote", True))

    def take(self, stopped: Callable[[], bool] = lambda: False, timeout: float = 120.0, cuda_ok: bool = True):
        """A rank process for a job, or None when ``stopped()`` turns true while a zygote warms up.

        A zygote that fails or takes longer than ``timeout`` to warm up is replaced by a spawned rank process.
        ``cuda_ok=False``: the job must start CUDA itself (its ranks share a host and re-list their GPUs first),
        so a rank forked ahead that has started CUDA (``WarmCuda``) is ended and a fresh one forked.
        """
        if not self.forks():
            return self._take_spare()
        forked = self._take_forked(timeout)
        if forked is not None and forked.cuda_warm and not cuda_ok:
            forked.kill()
            forked = None
        if forked is not None:
            return forked
        zygote = self._ensure_zygote()
        deadline = time.monotonic() + timeout
        while not zygote.wait_ready(0.25):
            if stopped():
                return None
            if not zygote.alive() or time.monotonic() > deadline:
                logger.warning("dask-ddp: the zygote of this worker did not start; starting a rank process instead")
                return RankProcess()
        try:
            return zygote.fork()
        except OSError:
            logger.warning("dask-ddp: the zygote of this worker did not fork; starting a rank process instead",
                           exc_info=True)
            return RankProcess()

    def _ensure_zygote(self) -> Zygote:
        with self._lock:
            if self._zygote is None and _EARLY:
                self._zygote = _EARLY.pop()
            if self._zygote is None or not self._zygote.alive():
                if self._zygote is not None:
                    self._zygote.close()
                self._zygote = Zygote()
            return self._zygote

    def _take_forked(self, timeout: float) -> ForkedRank | None:
        """The rank forked ahead (waiting for a fork on its way), or None: none, or it or its zygote has died
        meanwhile (an orphan ends itself within half a second: a job must not start in it)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._forking, timeout=min(timeout, 30.0))
            forked, self._forked = self._forked, None
        if forked is not None and not (forked.alive() and forked.zygote.alive()):
            forked.kill()  # its socket, pipes and pidfd
            return None
        return forked

    def _take_spare(self) -> RankProcess:
        with self._lock:
            self._lock.wait_for(lambda: not self._filling, timeout=10)
            spare, self._spare = self._spare, None
        if spare is not None and spare.alive():
            return spare
        if spare is not None:
            spare.kill()
        return RankProcess()

    @staticmethod
    def gpus_present() -> bool:
        """Whether this host may have a GPU for CUDA: a GPU driver's device node is there (NVIDIA's, or ROCm's for
        AMD). Read without starting CUDA or importing torch in the worker."""
        return any(os.path.exists(node) for node in GPU_NODES)

    def refill(self, force: bool = False, ahead: bool = False, cuda: bool = False) -> None:
        """Warm up for the next job in the background: the zygote, or a spare (``ddp.warm-spare`` or ``force``);
        ``ahead``: with a ready zygote, fork the next job's rank now too (at a job's end); ``cuda``: on a host with
        a GPU (:meth:`gpus_present`), and have it start CUDA while it waits (at a job's start, ``ddp.warm-cuda``);
        without one, nothing is forked early."""
        if self._closed or (cuda and not self.gpus_present()):
            return
        if self.forks():
            if force or dask.config.get("ddp.warm-spare"):
                zygote = self._ensure_zygote()
                if ahead and zygote.wait_ready(0):
                    self._fork_ahead(zygote, cuda)
            return
        if not (force or dask.config.get("ddp.warm-spare")):
            return
        with self._lock:
            if self._spare is not None or self._filling:
                return
            self._filling = True
        threading.Thread(target=self._fill, name="dask-ddp-spare", daemon=True).start()

    def _fork_ahead(self, zygote: Zygote, cuda: bool = False) -> None:
        with self._lock:
            if self._forked is not None or self._forking or self._closed:
                return
            self._forking = True
        threading.Thread(target=self._fork, args=(zygote, cuda), name="dask-ddp-fork-ahead", daemon=True).start()

    def _fork(self, zygote: Zygote, cuda: bool = False) -> None:
        try:
            forked: ForkedRank | None = zygote.fork()
        except OSError:  # the zygote is gone: take() starts what it needs
            forked = None
        if cuda and forked is not None:
            try:
                forked.conn.send(WarmCuda())  # read before its Start: CUDA starts while it waits
                forked.cuda_warm = True
                threading.Timer(WARM_CUDA_IDLE, self._cool, args=(forked, zygote)).start()
            except OSError:  # it died already
                forked.kill()
                forked = None
        with self._lock:
            closed = self._closed
            self._forked, self._forking = (None if closed else forked), False
            self._lock.notify_all()
        if closed and forked is not None:
            forked.kill()

    def cool(self) -> None:
        """End the rank forked ahead now if it started CUDA (the sweep that asked for it has ended: its GPU memory
        back at once, not after :data:`WARM_CUDA_IDLE`) and fork a plain one in its place. Raises nothing."""
        with self._lock:
            forked, zygote = self._forked, self._zygote
        if forked is not None and forked.cuda_warm and zygote is not None:
            self._cool(forked, zygote)

    def _cool(self, forked: ForkedRank, zygote: Zygote) -> None:
        """:data:`WARM_CUDA_IDLE` after ``forked`` was told to start CUDA: if no job took it, end it (its GPU
        memory back) and fork one that does not start CUDA. Under the lock: a job never takes the one ended."""
        with self._lock:
            if self._forked is not forked:  # a job took it (or it was replaced)
                return
            self._forked = None
        forked.kill()
        if not self._closed and zygote.alive():
            self._fork_ahead(zygote)

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
        """Wait until the zygote (or spare) has imported torch; True if it has."""
        if self.forks():
            with self._lock:
                zygote = self._zygote
            return zygote is not None and zygote.wait_ready(timeout)
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
        """The pids of the processes this worker keeps warm: its zygote and the rank it forked ahead, or
        (``ddp.zygote: false``) its spare."""
        with self._lock:
            return [p.pid for p in (self._zygote, self._spare, self._forked)
                    if p is not None and p.alive() and p.pid is not None]

    def zygote_pid(self) -> int | None:
        """The pid of this worker's zygote while it runs (its child, or forked by the zygote host), else None."""
        with self._lock:
            zygote = self._zygote
        return zygote.pid if zygote is not None and zygote.alive() else None

    def close(self) -> None:
        """Stop the zygote and the spare and start none again."""
        with self._lock:
            self._closed = True
            zygote, spare, forked = self._zygote, self._spare, self._forked
            self._zygote = self._spare = self._forked = None
        for proc in (forked, zygote, spare):  # the forked rank first: it dies with its zygote anyway
            if proc is not None:
                proc.close() if isinstance(proc, Zygote) else proc.kill()
