"""A rank process as its Dask worker sees it: start a warm child interpreter, talk to it, kill it.

Runs in: the Dask worker. The child runs :mod:`dask_ddp.rank` (``python -m
dask_ddp.rank FD``) in a process group of its own, so that killing the group
also kills the DataLoader workers it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

import dask

__all__ = ["RankProcess"]


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


class RankProcess:
    """A warm child interpreter (``python -m dask_ddp.rank``) with torch imported, in its own process group.

    Messages (:mod:`dask_ddp.messages`) go both ways over a socket pair;
    :meth:`send` may be called from several threads.
    """

    def __init__(self):
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_ddp.rank", str(child.fileno())], pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env=_rank_environment())
        child.close()
        self.conn = Connection(parent.detach())
        self.pid = self.proc.pid
        self._send_lock = threading.Lock()

    def alive(self) -> bool:
        """True while the child process runs."""
        return self.proc.poll() is None

    def send(self, msg) -> None:
        """Send one message to the child (thread-safe); raises OSError once the socket is closed."""
        with self._send_lock:
            self.conn.send(msg)

    def kill(self) -> None:
        """SIGKILL the child's whole process group (DataLoader workers included) and reap it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
        self.conn.close()
