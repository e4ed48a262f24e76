"""The zygote host: one warm interpreter per host that forks each Dask worker's zygote.

Runs in: the zygote host process (``python -m dask_ddp.rank.zygote_host PATH``), started by the first worker
of a host that needs a zygote (:mod:`dask_ddp.worker.zygote_host`), detached from it; after each fork, in the
new zygote (:mod:`dask_ddp.rank.zygote`), which serves its worker alone from then on.

Why: a zygote costs ~5 s of CPU to warm up (``import torch`` and ``torch._dynamo``, which DDP imports), and
every worker has one. With eight workers on a GPU box (dask-cuda), or the ~200 short-lived workers of this
project's test suite, that is paid per worker. The host pays it once, then forks a warm zygote per worker in
milliseconds; the zygote takes its worker's environment, working directory, CPU affinity and umask after the
fork, so it is the zygote the worker would have started, warm. Only processes that would import torch the
same way share a host: the worker names the socket after everything an import can see (interpreter, package,
environment, namespaces, cgroup, limits: :func:`dask_ddp.worker.zygote_host.host_key`).

Protocol on the host's socket (a ``SOCK_SEQPACKET`` Unix socket in a directory only its user can enter; the
host also checks the peer's uid): the worker sends one message, the JSON of ``{"env", "cwd", "umask",
"affinity"}``, with three file descriptors: its zygote's end of the zygote socket, and the worker's stdout and
stderr. The host forks; the child becomes that zygote (:func:`dask_ddp.rank.zygote.main` on that socket, with
that stdout and stderr) and the host answers ``b"Z"`` and the child's pid, with a pidfd of the child. The host
reaps its children and exits once it has had none for ``ddp.zygote-host-idle`` seconds (5: long enough for the
next cluster of a notebook or a test suite, short enough that a command's local cluster leaves nothing behind
for long).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time

from dask_ddp.rank import zygote

__all__ = ["main"]

MAX_REQUEST = 1 << 20  # bytes of one request (the environment is most of it)


def _reap(children: set[int]) -> None:
    for pid, _ in zygote.reaped():
        children.discard(pid)


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _become_zygote(listener: socket.socket, conn: socket.socket, wake: tuple[int, int], request: dict,
                   fds: list[int]) -> None:
    """In the forked child: take the worker's environment, then serve it as its zygote. Never returns."""
    try:
        listener.close()
        conn.close()
        signal.set_wakeup_fd(-1)
        for end in wake:
            os.close(end)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote sets its own
        ctl, out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.setsid()  # as a zygote started by its worker (start_new_session): a process group of its own
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as ``python -m`` started there would have it
        os.umask(request["umask"])
        if request.get("affinity"):
            os.sched_setaffinity(0, request["affinity"])
        if "dask" in sys.modules:  # the DASK_* variables of this worker, not the first one's
            import dask.config

            dask.config.refresh()
        zygote.main([str(ctl)])
    except BaseException:  # noqa: BLE001 - a child must never return into the host's loop
        os._exit(70)
    os._exit(0)


def _serve_one(listener: socket.socket, wake: tuple[int, int], children: set[int]) -> None:
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        if _peer_uid(conn) != os.getuid():
            return
        conn.settimeout(10)
        msg, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        if len(fds) != 3 or flags & socket.MSG_TRUNC:
            return
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            _become_zygote(listener, conn, wake, request, fds)
        children.add(pid)
        pidfd = os.pidfd_open(pid)  # not yet reaped: surely our child
        try:
            socket.send_fds(conn, [b"Z%d" % pid], [pidfd])
        finally:
            os.close(pidfd)
    except (OSError, ValueError):
        pass
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point: take the listening socket (file descriptor 0), warm up, fork a zygote per request, and exit
    after ``ddp.zygote-host-idle`` seconds without a zygote."""
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0]
    if os.fork() > 0:  # detach: the worker that started it must not be its parent (it waits for this exit)
        os._exit(0)
    listener = socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    inode = os.stat(path).st_ino
    signal.signal(signal.SIGTERM, lambda *_: _leave(path, inode))  # scancel, a pod's end: its zygotes live on
    from dask_ddp.rank.warm import warm_imports

    warm_imports()
    import dask

    idle = float(dask.config.get("ddp.zygote-host-idle", 5))
    extra = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:  # as the zygote: forking beside a live thread can deadlock the child
        sys.exit(f"the zygote host has threads {extra} after its imports; it cannot fork safely (a module "
                 "of ddp.zygote-preload that starts a thread cannot be preloaded)")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    idle_since, children = time.monotonic(), set[int]()
    while True:
        readable, _, _ = select.select([listener.fileno(), wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        _reap(children)
        if listener.fileno() in readable:
            _serve_one(listener, (wake_r, wake_w), children)
        if children:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > idle and not select.select([listener], [], [], 0)[0]:
            _leave(path, inode)


def _leave(path: str, inode: int) -> None:
    """Remove this host's socket (not a newer host's of the same name) and exit."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
