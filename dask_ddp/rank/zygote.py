"""The zygote: a warm interpreter per Dask worker that forks a fresh rank process for each job.

Runs in: the zygote process: forked for its Dask worker by the host's zygote host
(:mod:`dask_ddp.rank.zygote_host`, ``ddp.zygote-host``, the default), or started by the
worker as ``python -m dask_ddp.rank.zygote FD``; and, after each fork, in the new rank
process until it becomes a rank (:func:`dask_ddp.rank.main.serve`).

Why: a rank process needs torch imported, which takes seconds; a job started
right after another would wait for it. The zygote imports torch once and
then forks a rank in tens of milliseconds, as often as jobs come.

Why it must never initialise CUDA nor start threads before forking: a
forked child gets a copy of the parent's memory but only the thread that
called ``fork``. A CUDA context does not survive a fork (the child's first
CUDA call fails), and a lock held by any other thread at that moment stays
held forever in the child (a deadlock at its first use). So the zygote only
imports (``import torch`` leaves CUDA untouched), runs no Python thread, and
watches its worker through its socket rather than a thread. The one native
thread it has, OpenBLAS's pool (started by NumPy's import), is fork-aware:
OpenBLAS re-creates it in the child, as in every forked DataLoader worker.

Protocol on the socket to the worker (``FD``): the worker sends ``b"F"`` with
three file descriptors (the rank's end of its supervisor socket, its stdout
and its stderr); the zygote forks and answers ``("forked", pid)``. The new
rank's first bytes on its supervisor socket are ``b"P"`` with a pidfd of
itself, for the worker to signal it by. When a
child ends, the zygote reaps it and sends ``("exit", pid, code)`` (a negative
code: killed by that signal). Replies are pickles framed as by
``multiprocessing.connection``. The zygote exits when the socket closes (its
worker is gone); its children then notice their parent is gone and die too.
"""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from typing import Iterator

__all__ = ["main", "reaped"]


def reaped() -> Iterator[tuple[int, int]]:
    """Reap every child of this process that has ended, yielding its pid and exit code (negative: the signal
    that killed it); also the zygote host's loop. Raises nothing."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _reap(replies: Connection) -> None:
    for pid, code in reaped():
        replies.send(("exit", pid, code))


def _become_rank(ctl: socket.socket, replies: Connection, wake: tuple[int, int], fds: list[int]) -> None:
    """In the forked child: drop the zygote's parts, take the passed descriptors, reseed, serve. Never returns."""
    try:
        chan, out, err = fds
        replies.close()
        ctl.close()
        signal.set_wakeup_fd(-1)
        for fd in wake:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote ignores it; a rank takes it as a notice
        os.setsid()  # a process group of its own: killing it kills its DataLoader workers too
        _send_own_pidfd(chan)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        _reseed()
        from dask_ddp.rank import main as rank

        rank.die_with_parent()  # the zygote; it exits with its worker
        rank.serve(chan)
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        os._exit(70)


def _send_own_pidfd(fd: int) -> None:
    """First thing on the rank's socket: ``b"P"`` with a pidfd of this process (none where the kernel has none).

    The worker ends the rank through it (:mod:`dask_ddp.worker.groups`): the zygote reaps its children, so a
    pid the worker looked up itself might, by then, be another process's.
    """
    try:
        own = [os.pidfd_open(os.getpid())]
    except (AttributeError, OSError):
        own = []
    sock = socket.socket(fileno=fd)
    try:
        socket.send_fds(sock, [b"P"], own)
    finally:
        sock.detach()
        for pidfd in own:
            os.close(pidfd)


def _reseed() -> None:
    """Fresh random state, as a freshly started interpreter would have (the fork copied the zygote's)."""
    random.seed()
    try:
        import numpy as np

        np.random.seed()
    except ImportError:
        pass
    import torch

    torch.seed()


def main(argv: list[str] | None = None) -> None:
    """Entry point: warm up, say ready, then fork a rank for each request until the worker goes."""
    argv = sys.argv[1:] if argv is None else argv
    ctl = socket.socket(fileno=int(argv[0]))
    replies = Connection(os.dup(ctl.fileno()), readable=False)
    from dask_ddp.rank import main as rank

    # A batch system signals every process of a job (``scancel``: SIGTERM to all, SIGKILL KillWait s later):
    # the zygote must outlive the ranks it forked, which die with it, while they save for that notice. It ends
    # when its worker goes (the socket's end, below) or by SIGKILL (Zygote.close).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank.warm_imports()
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:  # see the module docstring: forking beside a live thread can deadlock the child
        replies.send(("error", f"the zygote has threads {extra} after its imports; it cannot fork safely (a module of "
                                  "ddp.zygote-preload that starts a thread cannot be preloaded)"))
        os._exit(1)
    replies.send(("ready", os.getpid()))
    wake_r, wake_w = os.pipe()  # SIGCHLD writes here (set_wakeup_fd): select() wakes at once to reap
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        readable, _, _ = select.select([ctl.fileno(), wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        _reap(replies)
        if ctl.fileno() not in readable:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 16, 3)
        except OSError:
            msg, fds = b"", []
        if not msg:  # the worker closed its end: it is gone or closing
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            _become_rank(ctl, replies, (wake_r, wake_w), fds)
        for fd in fds:
            os.close(fd)
        replies.send(("forked", pid))


if __name__ == "__main__":
    main()
