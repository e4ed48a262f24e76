"""A rank's rendezvous: its store, its device, its process group, every rank joined.

Runs in: the rank process (called by :func:`dask_ddp.rank.main.run_job` before the user's function).

Rank 0 hosts the rendezvous store on the master address only, on a port the OS
picks (no race, no collision) and sends the port to its supervisor, which
publishes it for the others. Then every rank takes its device
(:mod:`dask_ddp.rank.devices`), initialises the process group on the store,
waits until every rank has done so (:func:`join`), and starts its side of the
preemption protocol. At the end, :func:`finish` keeps rank 0's store up until
every rank is done.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from dask_ddp.rank import devices, keeper, live, network, preemption
from dask_ddp.wire.errors import RendezvousError
from dask_ddp.wire.messages import Port
from dask_ddp.wire.task import RankTask

__all__ = ["Joined", "rendezvous", "open_store", "join", "finish"]


@dataclass(frozen=True)
class Joined:
    """What the rendezvous gives the rank: its store (rank 0 hosts it) and its placement."""

    store: Any  # the rendezvous store itself (the process group's keys; rank 0 hosts it)
    keys: Any  # the same store under the attempt's secret prefix: dask-ddp's own keys
    backend: str
    device: Any
    device_ids: list | None


def rendezvous(send: Callable, task: RankTask, master_port: int | None, sampler=None,
               ending: Callable[[], bool] = lambda: False) -> Joined:
    """Meet the other ranks of ``task``'s attempt: store, device, process group, every rank joined.

    ``send``: the channel to the supervisor (rank 0 sends its store's port there; the preemption protocol
    its notices); ``sampler``: the rank's telemetry sampler, told the device; ``ending()``: whether the rank
    is being ended on purpose (then a SIGTERM is no preemption notice).

    Raises
    ------
    RendezvousError
        The store cannot be hosted on ``master_addr`` or reached in time (see :func:`open_store`).
    """
    import torch.distributed as dist  # imported (warm) by the rank's main() already

    spec = task.rank
    pinned = network.pin_interfaces(spec.host)
    store = open_store(send, task, master_port)
    keys = dist.PrefixStore(task.store_prefix, store)
    if spec.rank == 0 and pinned:  # worth a line in the notebook only where the interface matters: across hosts
        logging.getLogger("dask_ddp").log(
            logging.INFO if spec.num_nodes > 1 else logging.DEBUG,
            "collectives use interface %s (the worker's address %s); set %s to choose another",
            next(iter(pinned.values())), spec.host, " / ".join(pinned))
    backend, device, device_ids = devices.place(keys, spec.rank, spec.world_size, spec.address, task.backend,
                                                spec.local_rank, spec.local_world_size)
    if sampler is not None:
        sampler.device = device
    if not task.joined:  # a live job's replacement joins the survivors' group instead (dask_ddp.rank.live)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=timedelta(seconds=task.timeout),
                                # nccl across ranks: its communicator made now, on the rank's GPU (a failure
                                # shows here, named); alone, at its first collective, if any (0.3-0.4 s on an H200)
                                device_id=device if backend == "nccl" and spec.world_size > 1 else None)
    if backend == "nccl" and spec.world_size == 1:  # its GPU is the current device (devices.place set it)
        warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")
    join(keys, spec.world_size)
    if task.recovery == "live":
        live.setup(keys, task.signing_key, spec.rank, spec.world_size, backend, task.timeout, device,
                   joining=task.joined)
    preemption.start(keys, task.master_addr, int(os.environ["MASTER_PORT"]), spec.rank, spec.world_size, send,
                     preemption.grace_period(), spec.address, prefix=task.store_prefix, ending=ending,
                     key=task.signing_key, attempt=task.attempt)
    return Joined(store, keys, backend, device, device_ids)


def open_store(send: Callable, task: RankTask, master_port: int | None):
    """Rank 0: host the rendezvous store on ``master_addr`` only (a port the OS picks: no race, no collision)
    and send its port; in a live job its keeper hosts it (:mod:`dask_ddp.rank.keeper`). Other ranks: connect
    within ``rendezvous_timeout``, then wait on the store as long as the collectives do (``timeout``).

    Raises
    ------
    RendezvousError
        ``master_addr`` is not an address of rank 0's host, or a rank cannot reach the store in time.
    """
    import torch.distributed as dist

    spec, timeout = task.rank, timedelta(seconds=task.timeout)
    if spec.rank == 0 and not task.joined:
        sock = network.listen(task.master_addr, rank=0, worker=spec.address)
        host, port = sock.getsockname()[:2]
        fd = sock.detach()  # the store owns it now
        if task.recovery == "live" and spec.world_size > 1:  # a store that outlives rank 0's process
            keeper.start(host, port, fd, spec.world_size, task.timeout, task.store_prefix)
            os.close(fd)
            store = dist.TCPStore(host, port, spec.world_size, is_master=False, timeout=timeout)
        else:
            store = dist.TCPStore(host, port, spec.world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=fd)
            network.keep_from_forks(fd, port)
        send(Port(port))
    else:  # (a live job's replacement of rank 0 too: the keeper still holds the store)
        port = master_port
        try:
            store = dist.TCPStore(task.master_addr, port, spec.world_size, is_master=False,
                                  timeout=timedelta(seconds=task.rendezvous_timeout))
        except dist.DistError as exc:
            raise RendezvousError(
                f"rank {spec.rank} on worker {spec.address} could not reach the rendezvous store at "
                f"{task.master_addr}:{port} within {task.rendezvous_timeout:g} s (ddp.rendezvous-timeout): "
                f"{str(exc).splitlines()[0]}. Is master_addr an address every worker can reach, and is the port "
                "open between the workers (firewall, NetworkPolicy)?") from None
        store.set_timeout(timeout)
    os.environ["MASTER_PORT"] = str(port)
    return store


def join(store, world_size: int) -> None:
    """Wait until every rank has its process group: no rank starts the function (and fails) before all joined."""
    if store.add("dask_ddp/joined", 1) == world_size:
        store.set("dask_ddp/all_joined", "1")
    store.wait(["dask_ddp/all_joined"])


def finish(store, rank: int, world_size: int, wait: float = 30.0) -> None:
    """Rank 0 hosts the store: it stays until every rank has finished, so no rank loses it early; then every
    rank's notice watcher is let go (:func:`preemption.release`) before the store can close."""
    world_size = live.final_world_size(world_size)  # a live job ends with the ranks its group kept
    store.add("dask_ddp/done", 1)
    if rank == 0:
        deadline, nap = time.monotonic() + wait, 0.001
        while store.add("dask_ddp/done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(nap)  # from 1 ms up to 10 ms: ranks that end together wait for no full nap
            nap = min(2 * nap, 0.01)
    preemption.release(store, rank, world_size)  # no notice watcher left waiting on the store when it closes
    if rank == 0:
        store.set(keeper.CLOSED, "1")  # a live job's store keeper exits now (without one, nobody reads it)
