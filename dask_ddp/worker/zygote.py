"""The worker's zygote as the worker sees it, and the ranks it forks.

Runs in: the Dask worker. :class:`Zygote` is the warm process (:mod:`dask_ddp.rank.zygote`) that forks a
:class:`ForkedRank` per job in tens of milliseconds: forked in turn by the host's zygote host
(:mod:`dask_ddp.worker.zygote_host`, ``ddp.zygote-host``, the default), or started by this worker as its child.
A :class:`ForkedRank` has the interface of :class:`~dask_ddp.worker.process.RankBase`; its parent is the zygote,
which reaps it and says how it ended.
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

from dask_ddp.worker import zygote_host
from dask_ddp.worker.groups import ProcessGroup, open_pidfd
from dask_ddp.worker.process import RankBase, rank_environment

__all__ = ["Zygote", "ForkedRank"]

_HOST_FAILED = False  # the zygote host failed once in this worker: its zygotes are its own children from then on
logger = logging.getLogger("dask_ddp")


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
        env = rank_environment()
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


class ForkedRank(RankBase):
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
