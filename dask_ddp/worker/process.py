"""Rank processes as their Dask worker sees them: start one, talk to it, kill it.

Runs in: the Dask worker. Two ways to get a rank process, one interface
(``pid``, ``conn``, ``stdout``, ``stderr``, :meth:`alive`, :meth:`send`,
:meth:`wait`, :meth:`kill`):

- :class:`ForkedRank`, forked by the worker's :class:`Zygote` (see
  :mod:`dask_ddp.rank.zygote`): tens of milliseconds once the zygote is warm;
- :class:`RankProcess`, a fresh ``python -m dask_ddp.rank.main`` (``ddp.zygote:
  false``, or when the zygote cannot start): seconds, for ``import torch``.

Either runs in a process group of its own, so that ending the group also
ends the DataLoader workers it started: SIGTERM, a grace, then SIGKILL
(:meth:`_Rank.kill`), signalled through a pidfd (:mod:`dask_ddp.worker.groups`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import dask

from dask_ddp.wire.task import TOKEN_VARIABLE
from dask_ddp.worker import zygote_host
from dask_ddp.worker.groups import ProcessGroup, open_pidfd
from dask_ddp.worker.tmpdirs import sweep_tmp_roots, worker_tmp_root  # their first home: here

__all__ = ["RankProcess", "Zygote", "ForkedRank", "stop_marked", "worker_tmp_root", "sweep_tmp_roots", "STOP_GRACE"]

STOP_GRACE = 3.0  # seconds a rank process has, after SIGTERM, before SIGKILL (see _Rank.kill)
_HOST_FAILED = False  # the zygote host failed once in this worker: its zygotes are its own children from then on
logger = logging.getLogger("dask_ddp")
TRACKER_WAIT = 1.0  # seconds the rank's resource tracker has, after the rank's SIGKILL, to remove what it leaked


def _rank_environment() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # a print of text with lone surrogates (os.listdir of non-UTF-8 names) is shown escaped, not raised
    env.setdefault("PYTHONIOENCODING", "utf-8:backslashreplace")
    # The Nanny sets MALLOC_TRIM_THRESHOLD_=65536 for the worker (distributed.nanny.pre-spawn-environ);
    # in a training process it makes glibc give memory back after every step: a few % slower per step.
    nanny = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    if env.get("MALLOC_TRIM_THRESHOLD_") == str(nanny.get("MALLOC_TRIM_THRESHOLD_", "")):
        env.pop("MALLOC_TRIM_THRESHOLD_")
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


class _Rank:
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


class RankProcess(_Rank):
    """A fresh child interpreter (``python -m dask_ddp.rank.main``) that imports torch itself."""

    def __init__(self):
        super().__init__()
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_ddp.rank.main", str(child.fileno())], pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env=_rank_environment())
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


class Zygote:
    """The worker's warm zygote process (:mod:`dask_ddp.rank.zygote`) and what it said about its children."""

    def __init__(self):
        parent, child = socket.socketpair()
        self.proc: subprocess.Popen | None = None  # started by this worker (not with ddp.zygote-host)
        self.pid: int | None = None  # known once it runs (forked by the zygote host: once the host answered)
        self.group: ProcessGroup | None = None
        self.sock = parent
        self._replies = Connection(os.dup(parent.fileno()), writable=False)
        self._cond = threading.Condition()
        self._ready = False
        self._error: str | None = None
        self._forked: list[int] = []
        self.exits: dict[int, int] = {}  # child pid -> exit code, for children that ended
        self._fork_lock = threading.Lock()
        env = _rank_environment()
        if _use_host():
            threading.Thread(target=self._read, args=(child, env), name="dask-ddp-zygote", daemon=True).start()
            return
        self._start(child, env)
        threading.Thread(target=self._read, name="dask-ddp-zygote", daemon=True).start()

    def _start(self, child: socket.socket, env: dict[str, str]) -> None:
        """Start the zygote as this worker's child, on socket ``child`` (closed here)."""
        with child:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dask_ddp.rank.zygote", str(child.fileno())], pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        with self._cond:
            self.pid = self.proc.pid
            proc = self.proc
            self.group = ProcessGroup(self.pid, open_pidfd(self.pid), lambda: proc.returncode is not None)

    def _from_host(self, child: socket.socket, env: dict[str, str]) -> None:
        """Have the zygote host fork this worker's zygote on ``child`` (closed here). Where the host cannot, this
        zygote counts as dead (a warning says why): the launcher replaces it with one this worker starts itself,
        as it does every zygote from then on."""
        global _HOST_FAILED
        try:
            with child:
                pid, pidfd = zygote_host.fork_zygote(env, [child.fileno(), 1, 2],
                                                     float(dask.config.get("ddp.spawn-timeout", 120)))
        except OSError as e:
            _HOST_FAILED = True
            logger.warning("dask-ddp: no zygote host (%s); this worker starts its zygotes itself", e)
            with self._cond:  # the launcher replaces a dead zygote: the next one is this worker's child
                self._error = f"the zygote host did not fork a zygote: {e}"
                self._cond.notify_all()
            return
        with self._cond:
            self.pid = pid
            self.group = ProcessGroup(pid, pidfd, lambda: True)  # the pidfd says; once closed, done
            self._cond.notify_all()
        if self.sock.fileno() < 0:  # closed while the host forked it: it sees its socket's end and exits
            self.close()

    def _read(self, child: socket.socket | None = None, env: dict[str, str] | None = None) -> None:
        if child is not None and env is not None:
            self._from_host(child, env)
            if self.pid is None:
                return
        try:
            while True:
                msg = self._replies.recv()
                with self._cond:
                    if msg[0] == "ready":
                        self._ready = True
                    elif msg[0] == "forked":
                        self._forked.append(msg[1])
                    elif msg[0] == "exit":
                        self.exits[msg[1]] = msg[2]
                    elif msg[0] == "error":
                        self._error = msg[1]
                    self._cond.notify_all()
        except (EOFError, OSError):
            with self._cond:
                self._error = self._error or "the zygote process ended"
                self._cond.notify_all()

    def alive(self) -> bool:
        if self.proc is not None:
            return self._error is None and self.proc.poll() is None
        return self._error is None and not (self.group is not None and self.group.leader_exited())

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the zygote has imported torch; True if it has (False: failed or still importing)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._error is not None, timeout=timeout)
            return self._ready and self._error is None

    def fork(self, timeout: float = 30.0) -> "ForkedRank":
        """A new rank process, forked from the warm zygote.

        Raises
        ------
        OSError
            The zygote is gone or did not answer within ``timeout`` seconds.
        """
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with self._fork_lock:  # one request at a time: answers come in order
                with self._cond:
                    self._forked.clear()
                socket.send_fds(self.sock, [b"F"], [theirs.fileno(), out_w, err_w])
                with self._cond:
                    if not self._cond.wait_for(lambda: self._forked or self._error, timeout=timeout) or \
                            not self._forked:
                        raise OSError(f"the zygote (pid {self.pid}) did not fork a rank: {self._error or 'no answer'}")
                    pid = self._forked.pop()
            pidfd = _own_pidfd(ours, pid, timeout)
        except BaseException:
            ours.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            theirs.close()
            for fd in (out_w, err_w):
                os.close(fd)
        return ForkedRank(self, pid, pidfd, Connection(ours.detach()), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The exit code of child ``pid`` once the zygote has reaped it (None: not within ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self.exits or self._error is not None, timeout=timeout)
            return self.exits.pop(pid, None)

    def close(self) -> None:
        """Stop the zygote (its children notice and die)."""
        self.sock.close()  # a zygote the host forks after this sees the end of its socket, and exits
        with self._cond:
            group = self.group
        if group is not None:
            group.signal(signal.SIGKILL)  # it holds no shared memory: no grace
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            else:
                group.wait(10)
            group.close()
        self._replies.close()


def _use_host() -> bool:
    """Whether this worker's zygotes come from the zygote host (``ddp.zygote-host``, on a kernel with pidfds,
    and the host has not failed in this worker)."""
    return bool(dask.config.get("ddp.zygote-host", True)) and hasattr(os, "pidfd_open") and not _HOST_FAILED


def _own_pidfd(sock: socket.socket, pid: int, timeout: float) -> int | None:
    """The pidfd that a rank forked by the zygote sends of itself, first thing on its socket (None where the
    kernel has none). The zygote reaps its children: a pid the worker opened itself might be another's by then.

    Raises OSError: the rank did not send it within ``timeout`` s (it died, or hangs).
    """
    sock.settimeout(timeout)
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
    finally:
        sock.settimeout(None)
    if msg != b"P":
        for fd in fds:
            os.close(fd)
        raise OSError(f"the rank forked by the zygote (pid {pid}) ended before it said it runs")
    return fds[0] if fds else None


class ForkedRank(_Rank):
    """A rank process forked by the worker's :class:`Zygote` (its parent is the zygote, not the worker)."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int | None, conn: Connection, stdout, stderr):
        super().__init__()
        self.zygote, self.pid, self.conn, self.stdout, self.stderr = zygote, pid, conn, stdout, stderr
        self._code: int | None = None
        self.group = ProcessGroup(pid, pidfd, self._exit_known)

    def _exit_known(self) -> bool:
        """Whether its end is known: the zygote reported it (then the pid may be another's), or with the
        zygote gone (nobody reaps it) the kernel no longer has the pid (without a pidfd: see ProcessGroup)."""
        if self._code is not None:
            return True
        with self.zygote._cond:
            if self.pid in self.zygote.exits:
                return True
        if self.zygote.alive():
            return False
        try:
            os.kill(self.pid, 0)  # sends nothing
        except ProcessLookupError:
            return True
        return False

    def alive(self) -> bool:
        """True while the process runs (the zygote has not reported its end)."""
        return not self.group.leader_exited()

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it has ended (negative: killed by that signal), None if not within ``timeout``."""
        if self._code is None:
            deadline = time.monotonic() + timeout
            self._code = self.zygote.exit_code(self.pid, timeout)
            while self._code is None and not self.zygote.alive() and time.monotonic() < deadline:
                if not self.alive():
                    self._code = -signal.SIGKILL  # unknown: its zygote died before reporting it
                time.sleep(0.05)
        return self._code
