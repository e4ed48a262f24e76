"""HSDP across simulated hosts: network namespaces on a bridge (tests/_hosts.py), one Dask worker process per rank.

``device_mesh(hsdp=True)`` with no ``shard_size`` builds ``(replicate=hosts, shard=ranks per host)`` from what the
scheduler knows; the shard groups must be the ranks of one host (their all-gathers stay on the host) and the
replicate groups one rank of each host. The job trains to the parameters of one process, and its sharded
checkpoint, written from two hosts to one shared folder, loads back bitwise. Needs root and ``ip``; skips otherwise.
"""

from __future__ import annotations

import pytest
import torch
from _cluster import run
from _hosts import simulated_hosts, unavailable

import dask_ddp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, BATCH = 4, 12


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(3)], torch.nn.Linear(6, 5))


def batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, 6, generator=gen) for _ in range(STEPS)]


def full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def hsdp_on_hosts(directory):
    """Train HSDP on this rank's slice of each global batch, save sharded, load into a fresh HSDP model."""
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    mesh = dask_ddp.device_mesh(hsdp=True)
    groups = {name: sorted(dist.get_process_group_ranks(mesh.get_group(name))) for name in ("replicate", "shard")}
    model = dask_ddp.shard_model(build(), mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for batch in batches():
        opt.zero_grad()
        model(batch.chunk(ctx.world_size)[ctx.rank]).square().mean().backward()
        opt.step()
    trained = full(model, opt)
    dask_ddp.save_sharded({"model": model, "optim": opt}, STEPS, directory=directory)
    fresh = dask_ddp.shard_model(build(), mesh=mesh)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    fresh(torch.zeros(1, 6)).sum().backward()
    fresh_opt.step()  # the optimizer has state to load into
    step = dask_ddp.load_sharded({"model": fresh, "optim": fresh_opt}, directory=directory)
    loaded = full(fresh, fresh_opt)
    return {"rank": ctx.rank, "node": ctx.node_rank, "address": ctx.worker, "mesh": tuple(mesh.shape),
            "groups": groups, "step": step, "trained": trained if ctx.rank == 0 else None,
            "same_after_load": all(torch.equal(a, b) for a, b in zip(trained[0].values(), loaded[0].values()))}


def reference_params(world):
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for batch in batches():
        opt.zero_grad()
        torch.stack([model(part).square().mean() for part in batch.chunk(world)]).mean().backward()
        opt.step()
    return model.state_dict()


def test_hsdp_mesh_follows_the_hosts_and_trains_like_one_process(tmp_path):
    """2 hosts x 2 ranks: mesh (2, 2), shard groups = the ranks of one host, replicate groups = one rank a host;
    parameters within 1e-5 of one process (float32 sums in another order); the sharded checkpoint both hosts
    wrote to one folder loads back bitwise at the step saved."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with simulated_hosts([2, 2]) as hosts:
        out = sorted(run(hosts.client, hsdp_on_hosts, str(tmp_path)).result(timeout=600), key=lambda o: o["rank"])
    assert [o["node"] for o in out] == [0, 0, 1, 1]
    for o in out:
        assert o["mesh"] == (2, 2), o
        same_host = sorted(p["rank"] for p in out if p["node"] == o["node"])
        assert o["groups"]["shard"] == same_host, o
        assert o["groups"]["replicate"] == sorted(p["rank"] for p in out if p["rank"] % 2 == o["rank"] % 2), o
        assert o["step"] == STEPS and o["same_after_load"], o
    hosts_of = {o["node"]: o["address"].split("://")[-1].rsplit(":", 1)[0] for o in out}
    assert len(set(hosts_of.values())) == 2, f"the two hosts' workers share an address: {hosts_of}"
    want = reference_params(4)
    for key, value in want.items():
        torch.testing.assert_close(out[0]["trained"][0][key], value, rtol=1e-5, atol=1e-5, msg=key)
