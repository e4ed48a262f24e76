"""FSDP2 and HSDP from ``dispatch.run``: the job's ``DeviceMesh``, and ``fully_shard`` in one call.

Runs in: the rank process.

>>> mesh = dask_ddp.device_mesh()                        # doctest: +SKIP
>>> model = dask_ddp.shard_model(build().to(ctx.device))  # doctest: +SKIP

:func:`device_mesh` builds a 1-D mesh over all ranks (FSDP: every rank holds
1/N of each parameter), or with ``hsdp=True`` the 2-D mesh
``(replicate=hosts, shard=ranks per host)`` (HSDP: shards stay within a host,
whose fast links carry the all-gathers; hosts hold replicas and all-reduce
gradients). Global ranks are numbered host by host (see the plan), which is
what that mesh needs. :func:`shard_model` calls torch's ``fully_shard`` on
each block, then on the root (torch's recipe). gloo on CPU works (tests and
CI); nccl on GPUs. The DDP path is untouched: these are opt-in helpers.
Save and load sharded models with :func:`dask_ddp.save_sharded` /
:func:`dask_ddp.load_sharded`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from dask_ddp.wire.errors import NotInRankError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "shard_model", "blocks_of"]


def _layout() -> tuple[int, int, int, str]:
    """(world size, hosts, ranks per host, device type) from the rank's context, else from torch.distributed."""
    import torch
    import torch.distributed as dist

    from dask_ddp.rank.context import get_context

    try:
        ctx = get_context()
    except NotInRankError:
        if not (dist.is_available() and dist.is_initialized()):
            raise NotInRankError("device_mesh() needs a process group: call it inside a function started by "
                                 "dask_ddp.dispatch.run, or after torch.distributed.init_process_group") from None
        world = dist.get_world_size()
        return world, 1, world, "cuda" if dist.get_backend() == "nccl" else "cpu"
    per_host = ctx.local_world_size
    if ctx.world_size != ctx.num_nodes * per_host:
        per_host = 0  # uneven hosts: no 2-D mesh
    return ctx.world_size, ctx.num_nodes, per_host, getattr(ctx.device, "type", None) or (
        "cuda" if torch.cuda.is_available() else "cpu")


def device_mesh(*, hsdp: bool = False, shard_size: int | None = None) -> DeviceMesh:
    """Return the job's ``DeviceMesh``: 1-D ``("shard",)``, or with ``hsdp=True`` 2-D ``("replicate", "shard")``.

    Call it on every rank (it is collective). ``shard_size`` (HSDP) is the number
    of ranks a parameter is sharded over; default: the ranks per host.

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank with no process group.
    ValueError
        ``hsdp=True`` when the world size is not a multiple of the shard size (hosts with
        different numbers of ranks: pass ``shard_size=`` dividing the world size).
    """
    from torch.distributed.device_mesh import init_device_mesh

    world, hosts, per_host, device = _layout()
    if not hsdp:
        return init_device_mesh(device, (world,), mesh_dim_names=("shard",))
    size = shard_size or per_host
    if not size or world % size:
        raise ValueError(f"HSDP needs the {world} ranks split evenly into shard groups; this job has {hosts} hosts "
                         f"with {'unequal numbers of ranks' if not per_host else f'{per_host} ranks each'}"
                         f"{f' and shard_size={shard_size}' if shard_size else ''}: pass shard_size= dividing "
                         f"{world}, or use device_mesh() (1-D FSDP)")
    return init_device_mesh(device, (world // size, size), mesh_dim_names=("replicate", "shard"))


def blocks_of(model) -> list:
    """The blocks :func:`shard_model` shards first: the items of the model's largest ``ModuleList``/``Sequential``,
    else its direct children that hold parameters."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    lists = [m for m in lists if len(m) > 1]
    if lists:
        best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        return [b for b in best if any(True for _ in b.parameters())]
    return [c for c in model.children() if any(True for _ in c.parameters())]


def shard_model(model: nn.Module, *, mesh: DeviceMesh | None = None, blocks: Iterable[nn.Module] | None = None,
                **fully_shard_kwargs: Any) -> nn.Module:
    """Apply FSDP2's ``fully_shard`` to each block of ``model``, then to ``model``; return it (sharded in place).

    Parameters
    ----------
    model : the ``nn.Module``, on the rank's device (``get_context().device``).
    mesh : a ``DeviceMesh``; default :func:`device_mesh` (1-D; pass ``device_mesh(hsdp=True)`` for HSDP).
    blocks : the modules to shard one by one (transformer layers, ...); default :func:`blocks_of`.
    fully_shard_kwargs : passed on (``mp_policy=``, ``reshard_after_forward=``, ``offload_policy=``).

    Build the optimizer after this call, from ``model.parameters()`` (they are DTensors now).

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module`` (or is wrapped in DDP: shard the bare model instead).
    NotInRankError, ValueError
        As :func:`device_mesh`.
    """
    import torch
    from torch.distributed.fsdp import fully_shard

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shard_model takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("shard_model takes the bare model, not one wrapped in DistributedDataParallel: FSDP2 "
                        "replaces DDP (shard_model(model) instead of DDP(model))")
    mesh = device_mesh() if mesh is None else mesh
    for block in blocks_of(model) if blocks is None else blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model
