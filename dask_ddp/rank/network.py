"""Where a rank's store and collectives listen: the address of its own Dask worker, nowhere else.

Runs in: the rank process (at rendezvous).

- :func:`listen` binds rank 0's rendezvous store to one address (torch's
  libuv store binds every interface, IPv4 and IPv6, whatever host it is
  given; a socket bound here and handed over as ``master_listen_fd`` is not);
  :func:`keep_from_forks` keeps it out of the children the rank forks.
- :func:`pin_interfaces` sets ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` /
  ``TP_SOCKET_IFNAME`` to the interface that carries the worker's address.
  gloo otherwise resolves the host name, and where that name maps to
  127.0.1.1 (Debian, Ubuntu), to another interface (multi-homed nodes), or to
  nothing it falls back to loopback: a job across hosts then fails in
  ``connectFullMesh`` with ``remote=[127.0.0.1]``. A variable the user set
  in the worker's environment is never changed.

torch's store and collectives are unauthenticated and unencrypted, even when
Dask itself uses TLS: binding one address narrows who can reach them, it does
not protect them (see the README's security section).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import MutableMapping

import psutil

from dask_ddp.wire.errors import RendezvousError

__all__ = ["IFNAME_VARIABLES", "resolve", "interface_of", "pin_interfaces", "listen", "keep_from_forks"]

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def resolve(host: str) -> str:
    """The IP address ``host`` (a name or an address) stands for.

    Raises
    ------
    RendezvousError
        The name does not resolve here.
    """
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError, IndexError) as exc:
        raise RendezvousError(f"the rendezvous host {host!r} does not resolve on this host ({exc}); pass "
                              "run(master_addr=...) a name or address every rank can reach") from None


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds address ``ip`` here (``lo`` for 127.0.0.1), or None."""
    try:
        wanted = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(addr.address.split("%")[0]) == wanted:
                        return name
                except ValueError:
                    continue
    return "lo" if wanted.is_loopback and "lo" in psutil.net_if_addrs() else None  # all of 127/8


def pin_interfaces(worker_host: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Point gloo, NCCL and TensorPipe at the interface of ``worker_host``; return the variables it set.

    Sets only the variables not set already (the user's settings win); sets none when the address is
    not on an interface of this host (behind NAT, for instance), and then gloo keeps its own choice.
    Raises nothing.
    """
    missing = [var for var in IFNAME_VARIABLES if not environ.get(var)]
    if not missing:
        return {}
    try:
        name = interface_of(resolve(worker_host))
    except RendezvousError:
        return {}
    if name is None:
        return {}
    chosen = {var: name for var in missing}
    environ.update(chosen)
    return chosen


def listen(host: str, *, rank: int, worker: str) -> socket.socket:
    """A TCP socket listening on ``host`` (one address, a free port) for rank 0's rendezvous store.

    Raises
    ------
    RendezvousError
        ``host`` does not resolve, or is not an address of this host (a wrong ``master_addr``): the
        message names the rank, the worker and the address.
    """
    ip = resolve(host)
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((ip, 0))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        why = "is not an address of this host" if exc.errno == errno.EADDRNOTAVAIL else f"cannot be bound ({exc})"
        raise RendezvousError(f"rank {rank} on worker {worker} hosts the rendezvous store, but {host!r} ({ip}) "
                              f"{why}; leave master_addr unset (rank 0's address) or pass one of rank 0's "
                              "addresses") from None
    return sock  # not inheritable (Python's default): what the rank execs does not get it (see keep_from_forks)


def keep_from_forks(fd: int, port: int) -> None:
    """Let no child that this process forks (a DataLoader worker, a ``fork`` multiprocessing child) keep the
    store's listening socket ``fd`` (on ``port``): right after a fork, the child's copy becomes /dev/null.

    A child holding it keeps the port open after rank 0 has gone: the other ranks' connections are then
    accepted by the kernel and never answered, and they wait out their timeout instead of failing at once.
    (What the rank execs never gets it: the socket is not inheritable.) The number stays taken in the child, so
    nothing else of the child's gets it; a descriptor that is no longer that socket is left alone.
    """
    def in_child() -> None:
        try:
            with socket.socket(fileno=os.dup(fd)) as probe:
                if not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or probe.getsockname()[1] != port:
                    return
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, fd, inheritable=False)
            os.close(null)
        except OSError:  # closed, or not a socket: not the store's any more
            pass
    os.register_at_fork(after_in_child=in_child)
