"""Rank processes as their Dask worker sees them: start one, talk to it, kill it.

Runs in: the Dask worker. Two ways to get a rank process, one interface
(``pid``, ``conn``, ``stdout``, ``stderr``, :meth:`alive`, :meth:`send`,
:meth:`wait`, :meth:`kill`):

- :class:`~dask_ddp.worker.zygote.ForkedRank`, forked by the worker's zygote
  (:mod:`dask_ddp.worker.zygote`): tens of milliseconds once the zygote is warm;
- :class:`RankProcess`, a fresh ``python -m dask_ddp.rank.main`` (``ddp.zygote:
  false``, or when the zygote cannot start): seconds, for ``import torch``.

Either runs in a process group of its own, so that ending the group also
ends the DataLoader workers it started: SIGTERM, a grace, then SIGKILL
(:meth:`RankBase.kill`), signalled through a pidfd (:mod:`dask_ddp.worker.groups`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import dask

from dask_ddp.wire.task import PRELOAD_VARIABLE, TOKEN_VARIABLE
from dask_ddp.worker.groups import ProcessGroup, open_pidfd
from dask_ddp.worker.tmpdirs import sweep_tmp_roots, worker_tmp_root  # their first home: here

__all__ = ["RankBase", "RankProcess", "rank_environment", "stop_marked", "worker_tmp_root", "sweep_tmp_roots",
           "STOP_GRACE"]

STOP_GRACE = 3.0  # seconds a rank process has, after SIGTERM, before SIGKILL (see RankBase.kill)
TRACKER_WAIT = 1.0  # seconds the rank's resource tracker has, after the rank's SIGKILL, to remove what it leaked


def rank_environment() -> dict[str, str]:
    """The environment of a worker's zygote and rank processes: the worker's, less the Nanny's malloc setting, plus
    ``ddp.zygote-preload`` (the modules the warm process imports, in :data:`PRELOAD_VARIABLE`). Raises nothing."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a print of text with lone surrogates (os.listdir of non-UTF-8 names) is shown escaped, not raised
    env.setdefault("PYTHONIOENCODING", "utf-8:backslashreplace")
    # The Nanny sets MALLOC_TRIM_THRESHOLD_=65536 for the worker (distributed.nanny.pre-spawn-environ);
    # in a training process it makes glibc give memory back after every step: a few % slower per step.
    nanny = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    if env.get("MALLOC_TRIM_THRESHOLD_") == str(nanny.get("MALLOC_TRIM_THRESHOLD_", "")):
        env.pop("MALLOC_TRIM_THRESHOLD_")
    preload = dask.config.get("ddp.zygote-preload", None) or []
    if isinstance(preload, str):  # one module, as a string (DASK_DDP__ZYGOTE_PRELOAD=transformers)
        preload = [preload]
    env[PRELOAD_VARIABLE] = ",".join(str(m).strip() for m in preload if str(m).strip())  # the zygote host's key
    return env


def stop_marked(token: str) -> list[int]:
    """SIGKILL every process of this user whose environment holds ``DASK_DDP_RANK_TOKEN=token``; return their pids.

    That finds what a rank started and what left its process group (``start_new_session=True``, a
    daemon), whoever its parent is now. Raises nothing.
    """
    import psutil

    killed = []
    for pid in _marked(f"{TOKEN_VARIABLE}={token}".encode()):
        try:
            proc = psutil.Process(pid)
            if proc.uids().real != os.getuid():
                continue
            proc.kill()
            killed.append(pid)
        except (OSError, psutil.Error):  # gone meanwhile, or not ours
            continue
    return killed


def _marked(mark: bytes) -> list[int]:
    """The pids (but this process's) whose environment holds ``mark``: one read of ``/proc/<pid>/environ`` each
    (0.4 ms for 70 processes, where psutil's iteration with each one's uids took 3.5 ms: at every rank's end)."""
    found: list[int] = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _is_tracker(cmdline: bytes) -> bool:
    """Whether a command line (``/proc/<pid>/cmdline``) is a multiprocessing resource tracker's."""
    return b"multiprocessing.resource_tracker" in cmdline


def _sparing_trackers(group: ProcessGroup, wait: float) -> None:
    """SIGKILL every member of ``group`` but its resource trackers, again until none but trackers is left (a
    member may fork meanwhile), and wait up to ``wait`` s for the trackers to remove what was left registered
    and exit. Where members cannot be told apart safely (no pidfds; see
    :meth:`~dask_ddp.worker.groups.ProcessGroup.signal_members`): SIGKILL to the leader alone, and the wait."""
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        if group.signal_members(signal.SIGKILL, spare=_is_tracker) is None:
            group.signal_leader(signal.SIGKILL)
            group.wait(left)
            return
        if group.wait(min(left, 0.1)):  # every member ended, the trackers too
            return


class RankBase:
    """What both kinds of rank process share: the socket to it and ending its process group."""

    pid: int
    conn: Connection
    stdout: object
    stderr: object
    group: ProcessGroup
    cuda_warm = False  # told to start CUDA before its Start (ddp.warm-cuda): only for a rank alone on its host

    def __init__(self):
        self._send_lock = threading.Lock()
        self._end_lock = threading.Lock()
        self._ended = False
        self.pumped = False  # whether a reader owns stdout/stderr (and closes them at their end)

    def send(self, msg) -> None:
        """Send one message to the rank (thread-safe); raises OSError once the socket is closed."""
        with self._send_lock:
            self.conn.send(msg)

    def kill(self, grace: float = STOP_GRACE) -> None:
        """End the rank's whole process group (DataLoader workers and helpers included) and wait for it.

        1. Hang up the socket: the rank then ends its group itself, and takes the SIGTERM that follows for what
           it is, a stop on purpose, not a preemption notice (see :func:`dask_ddp.rank.main._die`).
        2. SIGTERM to the group, then up to ``grace`` s until no member runs. The group's resource tracker
           ignores SIGTERM: it outlives the others and removes the shared memory and semaphores they leaked
           (SIGKILL to the whole group at once killed it too, and they stayed in /dev/shm).
        3. If some still run (the job's code ignores SIGTERM, or handles it and goes on, in the rank or in what
           it forked): SIGKILL to every member but the resource trackers (:func:`_sparing_trackers`), then up to
           :data:`TRACKER_WAIT` s for the trackers to clean up and exit, then SIGKILL to the group. A tracker
           cleans up once every process that holds its pipe has ended: SIGKILL to the rank alone left its
           forked children holding it, the tracker waited, and the group's SIGKILL killed it with the segments
           still in /dev/shm.

        Every signal goes through :class:`~dask_ddp.worker.groups.ProcessGroup`, never to a pid that may have
        been reused. Thread-safe: a second call waits for the first; then a no-op.
        """
        with self._end_lock:
            if self._ended:
                return
            self._hang_up()
            self.group.signal(signal.SIGTERM)
            if not self.group.wait(grace):
                _sparing_trackers(self.group, TRACKER_WAIT)
                if not self.group.wait(0):
                    self.group.signal(signal.SIGKILL)
            self.wait(10)
            self.group.close()
            self._ended = True
        self.conn.close()
        if not self.pumped:  # else its reader closes it: closing under a blocked readline() would block here,
            for stream in (self.stdout, self.stderr):  # as long as a helper that escaped holds the pipe open
                stream.close()

    def _hang_up(self) -> None:
        try:  # a shutdown, not a close: another thread may be reading (it gets EOF)
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already, or the rank is gone
            pass


class RankProcess(RankBase):
    """A fresh child interpreter (``python -m dask_ddp.rank.main``) that imports torch itself."""

    def __init__(self):
        super().__init__()
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_ddp.rank.main", str(child.fileno())], pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env=rank_environment())
        child.close()
        self.conn = Connection(parent.detach())
        self.pid, self.stdout, self.stderr = self.proc.pid, self.proc.stdout, self.proc.stderr
        # our child, not reaped yet: the pid is surely its own
        self.group = ProcessGroup(self.pid, open_pidfd(self.pid), lambda: self.proc.returncode is not None)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it has ended (negative: killed by that signal), None if it still runs."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
