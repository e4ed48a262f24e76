"""Where the rendezvous store and the collectives listen, and how rendezvous fails.

Every address here is 127.0.0.1, except 192.0.2.1 (TEST-NET-1, reserved for documentation): it is only
ever given to ``bind``, which fails without sending a packet, so no test targets it.
"""

from __future__ import annotations

import socket
import time

import psutil
import pytest
from _cluster import local_client, run

import dask_ddp
from dask_ddp.rank import network
from dask_ddp.wire.errors import RendezvousError


def _listening(port: int) -> list[str]:
    """The local addresses on which some process of this host listens on TCP ``port``."""
    return sorted({c.laddr.ip for c in psutil.net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port})


def _where_rank_listens():
    import os

    ctx = dask_ddp.get_context()
    out = {name: os.environ.get(name) for name in network.IFNAME_VARIABLES}
    if ctx.rank == 0:
        out["store"] = _listening(int(os.environ["MASTER_PORT"]))
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return out | {"sum": t.item()}


@pytest.mark.slow
def test_the_store_listens_on_the_workers_address_only_and_collectives_use_its_interface(client):
    job = run(client, _where_rank_listens)
    got = job.result(timeout=120)
    assert got[0]["store"] == ["127.0.0.1"], "the store must not listen on every interface (*, ::)"
    for seen in got:
        assert seen["sum"] == 2.0
        assert all(seen[name] == "lo" for name in network.IFNAME_VARIABLES), seen
    # one host: the interface is no news, and the notebook of every LocalCluster job would repeat it
    assert not [line for line in job.logs if "collectives use interface" in line], job.logs[-20:]


@pytest.mark.slow
def test_the_users_interface_setting_wins():
    with local_client(2, env={"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "eth9"}) as own:
        got = run(own, _where_rank_listens).result(timeout=120)
    assert [g["TP_SOCKET_IFNAME"] for g in got] == ["eth9", "eth9"]  # not used by gloo: the job still runs
    assert [g["NCCL_SOCKET_IFNAME"] for g in got] == ["lo", "lo"]


def test_a_master_addr_that_is_not_rank_0s_fails_fast_naming_it(client):
    t0 = time.monotonic()
    job = run(client, lambda: 1, master_addr="192.0.2.1")
    with pytest.raises(RendezvousError, match=r"rank 0 on worker tcp://127\.0\.0\.1:\d+ .*'192\.0\.2\.1'.* not an "
                                              r"address of this host"):
        job.result(timeout=120)
    took = time.monotonic() - t0
    print(f"wrong master_addr: RendezvousError after {took:.2f} s")
    assert took < 60


@pytest.mark.slow
def test_a_store_nobody_listens_on_gives_a_rendezvous_error_in_the_rendezvous_timeout():
    """Rank 1's side, against a port of 127.0.0.1 that is bound but not listening (refused, like a firewall's
    REJECT): RendezvousError naming address and port after ddp.rendezvous-timeout, not the collective timeout."""
    from dask_ddp.rank.rendezvous import open_store as _open_store
    from dask_ddp.wire.plan import RankSpec
    from dask_ddp.wire.task import RankTask

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))  # reserved, never listening: connections are refused
    port = blocker.getsockname()[1]
    spec = RankSpec(rank=1, local_rank=1, node_rank=0, world_size=2, local_world_size=2, num_nodes=1,
                    address="tcp://127.0.0.1:1234", host="127.0.0.1", name="w1")
    task = RankTask(run_id="r-00000000", attempt=0, rank=spec, master_addr="127.0.0.1", backend="gloo", call=b"",
                    timeout=1800, rendezvous_timeout=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(RendezvousError, match=rf"rank 1 on worker tcp://127\.0\.0\.1:1234 could not reach the "
                                                  rf"rendezvous store at 127\.0\.0\.1:{port} within 2 s"):
            _open_store(None, task, port)
    finally:
        blocker.close()
    took = time.monotonic() - t0
    print(f"store not reachable: RendezvousError after {took:.2f} s (rendezvous-timeout 2 s)")
    assert took < 30


def test_pin_interfaces_keeps_what_is_set_and_skips_foreign_addresses():
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert network.pin_interfaces("127.0.0.1", env) == {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}
    assert env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert network.pin_interfaces("192.0.2.1", {}) == {}  # not an address here: gloo keeps its own choice
    assert network.interface_of("127.0.1.1") == "lo"  # Debian's host-name address is loopback
    with pytest.raises(RendezvousError, match="not an address of this host"):
        network.listen("192.0.2.1", rank=0, worker="tcp://127.0.0.1:1")
