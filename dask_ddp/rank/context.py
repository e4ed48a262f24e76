"""What a rank knows about itself, and the small per-rank helpers.

Runs in: the rank process.

Inside the function passed to :func:`dask_ddp.dispatch.run`, :func:`get_context`
returns the rank's :class:`Context`; the torch process group is already
initialised. The helpers follow the idioms of the DDP articles this project
grew from: rank 0 does one-off work first (:func:`rank_zero_first`), each
rank seeds with ``seed + rank`` (:func:`seed_everything`), and scalars are
averaged across ranks with one all-reduce (:func:`all_reduce_mean`).
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field
from typing import Iterator

from dask_ddp.checkpoint import folder as checkpoint_folder
from dask_ddp.wire.errors import NotInRankError

__all__ = ["Context", "get_context", "rank_zero_first", "seed_everything", "all_reduce_mean"]

_CONTEXT: "Context | None" = None  # set once by the rank process (dask_ddp.rank.main), never by users


@dataclass(frozen=True)
class Context:
    """A rank's place in the job (frozen; made by the rank process before the user's function runs).

    Attributes
    ----------
    rank, world_size : global rank and number of ranks.
    local_rank, local_world_size : index and count of ranks on this host.
    node_rank, num_nodes : index of this host and number of hosts.
    device : the rank's GPU, else ``torch.device("cpu")``: ``cuda:LOCAL_RANK``,
        under dask-cuda too (the rank sees its GPUs in torchrun's order; see
        :mod:`dask_ddp.rank.devices` for the rule and for shared GPUs).
    device_ids : ``[device.index]`` with a GPU, else None; pass to ``DistributedDataParallel``.
    backend : the torch.distributed backend in use ("nccl" or "gloo").
    run_id : the job's id; restart_count : the attempt, 0 first; max_restarts.
    worker : address of the Dask worker running this rank.
    checkpoint_dir : the ``checkpoint_dir=`` given to ``run`` (fsspec URL) or None; this
        job's checkpoints go to its folder ``<checkpoint_dir>/<run_id>`` in it.
    checkpoint_options : the ``checkpoint_options=`` given to ``run`` (fsspec storage options; not in the repr).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: object
    device_ids: list | None
    backend: str
    run_id: str
    restart_count: int = 0
    max_restarts: int = 0
    worker: str = ""
    master_addr: str = ""
    master_port: int = 0
    checkpoint_dir: str | None = field(default=None, repr=False)  # its URL may carry credentials (userinfo)
    checkpoint_options: dict = field(default_factory=dict, repr=False)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def get_context() -> Context:
    """Return this rank's :class:`Context`.

    Raises
    ------
    NotInRankError
        When called outside a function started by ``dask_ddp.dispatch.run``.
    """
    if _CONTEXT is None:
        raise NotInRankError("get_context() was called outside a dask-ddp rank: call it inside the "
                             "function you pass to dask_ddp.dispatch.run(client, fn, ...)")
    return _CONTEXT


def set_context(ctx: Context | None) -> None:
    """Make ``ctx`` this process's rank context (what :func:`get_context` returns; None: outside a rank again)
    and default checkpoints to its job's folder. Called by the rank process once it joined its group (and by
    tests). Raises nothing."""
    global _CONTEXT
    _CONTEXT = ctx
    checkpoint_folder.set_job(ctx)  # checkpoints default to the job's folder


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Let rank 0 run the block first while the others wait at a barrier, then the others.

    Use it for one-off work whose result the other ranks reuse, e.g. a
    download into a shared cache::

        with dask_ddp.rank_zero_first():
            data = load_or_download(root)

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    """
    import torch.distributed as dist

    ctx = get_context()
    if ctx.rank != 0:
        dist.barrier()
    try:
        yield
    finally:
        if ctx.rank == 0:
            dist.barrier()


def seed_everything(seed: int, *, per_rank: bool = True) -> int:
    """Seed Python, NumPy and torch (CPU and CUDA) with ``seed + rank`` (or ``seed``).

    Different seeds per rank give each rank different random augmentations;
    model initialisation stays identical anyway because DDP broadcasts rank
    0's parameters at construction. Returns the seed used.

    Raises
    ------
    TypeError
        If ``seed`` is not an int.
    NotInRankError
        With ``per_rank=True`` outside a dask-ddp rank.
    """
    import numpy as np
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed_everything(seed=...) takes an int, got {type(seed).__name__}")
    value = seed + (get_context().rank if per_rank else 0)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    os.environ["PYTHONHASHSEED"] = str(value)
    return value


def all_reduce_mean(value: float) -> float:
    """Average a scalar across all ranks with one all-reduce; every rank gets the mean.

    Accepts a Python number, a NumPy scalar or a 0-d tensor; returns a float.

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    TypeError
        If ``value`` is not a number.
    """
    import torch
    import torch.distributed as dist

    ctx = get_context()
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"all_reduce_mean takes a number, got {type(value).__name__}") from exc
    device = ctx.device if ctx.backend == "nccl" else "cpu"
    t = torch.tensor([number], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / ctx.world_size
