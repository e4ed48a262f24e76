"""The store keeper of a live job: rank 0's store in a process of its own, so that it outlives rank 0's.

Runs in: a child that rank 0's process forks in its rendezvous (``recovery="live"``, two ranks or more), then
in its own session. Everything the job's ranks agree on lives in rank 0's ``TCPStore`` (the process group's
keys, the live group's votes, proposals and invitations): hosted by rank 0's process, the store would die with
it and take the job along. The keeper hosts it instead; rank 0 connects to it like every other rank, and when
rank 0's process dies, the others re-form their group through the same store and a replacement of rank 0 joins
them there (:mod:`dask_ddp.rank.live`).

The keeper keeps nothing of rank 0's but the store's listening socket: its other descriptors are closed (its
supervisor's pipe, the output pipes: rank 0's death is seen at once) and it runs in a session of its own (the
supervisor's end of rank 0 does not take it along). It exits once the job's ranks are done (:data:`CLOSED`, set
by :func:`dask_ddp.rank.rendezvous.finish`), when no rank has been connected for :data:`QUIET` seconds after
one was (the attempt ended any other way: its ranks stopped, its client left), or when none connected within
``timeout``. A host that is cut off or a worker that is lost takes the keeper along with rank 0: that loss
still restarts the job (:mod:`dask_ddp.client.live`).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

__all__ = ["start", "CLOSED", "QUIET"]

CLOSED = "dask_ddp/closed"  # set once every rank of the job is done: the keeper exits
QUIET = 2.0  # seconds with no rank connected (after one was) before the keeper exits


def start(host: str, port: int, fd: int, world_size: int, timeout: float, prefix: str) -> int:
    """Fork the keeper of the store listening on ``fd`` (``host:port``; ``prefix``: the attempt's, under which
    :data:`CLOSED` is set); return its pid. The caller closes its own ``fd`` and connects to the store as a
    client. Raises OSError (the fork failed)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        _serve(host, port, fd, world_size, timeout, prefix)
    finally:
        os._exit(0)


def _serve(host: str, port: int, fd: int, world_size: int, timeout: float, prefix: str) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.closerange(3, fd)
    os.closerange(fd + 1, max(fd + 2, os.sysconf("SC_OPEN_MAX")))
    import psutil
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=fd)
    keys = dist.PrefixStore(prefix, store)
    me, began, seen, quiet = psutil.Process(), time.monotonic(), False, None
    while True:
        time.sleep(0.2)
        if keys.check([CLOSED]):
            return
        peers = sum(1 for c in me.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED
                    and c.laddr and c.laddr.port == port)
        now = time.monotonic()
        if peers > 1:  # more than the keeper's own client connection
            seen, quiet = True, None
        elif seen or now - began > timeout:
            quiet = quiet or now
            if now - quiet > QUIET:
                return
