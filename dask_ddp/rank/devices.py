"""GPU placement: which GPU each rank takes, what ``backend="auto"`` means, and the order a rank sees its GPUs in.

Runs in: the rank process (:func:`place`, at rendezvous); the rules are pure functions.

Decisions apart from actions: :func:`host_order`, :func:`assign` and
:func:`choose_backend` are pure functions of what each rank sees (its
``CUDA_VISIBLE_DEVICES``; the UUIDs of its visible GPUs, in CUDA's order);
:func:`place` is the rank-side action that shares those through the job's
store and applies the decisions.

The order first (:func:`host_order`), so that ``cuda:LOCAL_RANK`` is the rank's
own GPU, as a torchrun script's ``torch.cuda.set_device(LOCAL_RANK)`` expects.
Where every worker of the job on a host has a GPU of its own first in its
``CUDA_VISIBLE_DEVICES`` (dask-cuda gives worker *i* ``"i,i+1,...,i-1"``), the
rank process, before CUDA starts in it, re-lists its GPUs as the host's ranks'
own GPUs in local-rank order, then the others it sees. Every rank of the host
then sees one order, torchrun's: ``cuda:k`` is local rank *k*'s GPU, so
``cuda:LOCAL_RANK`` is the rank's own, and ``cuda:0`` is local rank 0's (no
longer the rank's own, as it is in the Dask worker). The Dask worker's own
``CUDA_VISIBLE_DEVICES`` is left as it was. Workers that share one list
(torchrun's layout, a plain ``LocalCluster``) keep it; so does a rank alone on
its host (``cuda:0`` is ``cuda:LOCAL_RANK`` there), and a rank that does not see
the other ranks' GPUs (one GPU per worker: ``cuda:LOCAL_RANK`` does not exist
there and fails loudly rather than picking another worker's GPU).

Then the placement: in rank order, each rank takes the first GPU it sees that
no earlier rank took. A GPU is known by its UUID, so the rule holds across
hosts and whatever ``CUDA_VISIBLE_DEVICES`` says:

- under dask-cuda, re-listed as above, rank *r* takes ``cuda:LOCAL_RANK``, its
  worker's own GPU (``torch.cuda.current_device()``, and so ``"cuda"`` without an
  index, name it too);
- on workers that see every GPU (a plain ``LocalCluster`` on a GPU box) rank
  *r* takes ``cuda:LOCAL_RANK``, as under torchrun;
- a rank that finds every GPU it sees taken (more ranks than GPUs) shares the
  least used one. nccl cannot run two ranks on one GPU, so ``auto`` then picks
  gloo (the ranks still compute on their GPUs) and ``nccl`` is refused with an
  error naming the ranks.

``backend="gloo"`` keeps every rank on the CPU (the order above still applies,
for the function's own use of the GPUs).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import MutableMapping, Sequence

from dask_ddp.wire.errors import PlanError

__all__ = ["Placement", "assign", "choose_backend", "host_order", "place"]

log = logging.getLogger("dask_ddp")


@dataclass(frozen=True)
class Placement:
    """One rank's GPU: ``index`` in the rank's own CUDA numbering (None: no GPU), its UUID, who else uses it."""

    index: int | None = None
    uuid: str = ""
    shared_with: tuple[int, ...] = ()


def host_order(visible: Sequence[Sequence[str]], local_rank: int) -> tuple[str, ...] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries that local rank ``local_rank`` should see, None to keep its own; pure.

    ``visible[k]`` is what local rank *k* of the host sees (its ``CUDA_VISIBLE_DEVICES``, split at the commas;
    empty where unset or empty). Where every list is set, their first entries (each worker's own GPU) all
    differ, and this rank sees each of them: those first entries in local-rank order, then the rest of what
    this rank sees (in local rank 0's order, then its own). Position ``local_rank`` is then its own GPU.
    """
    own = [gpus[0] if gpus else None for gpus in visible]
    mine = list(visible[local_rank])
    if len(visible) < 2 or None in own or len(set(own)) < len(own) or not set(own) <= set(mine):
        return None
    order = list(dict.fromkeys([*own, *(g for g in visible[0] if g in mine), *mine]))
    return None if order == mine else tuple(order)


def _split(value: str | None) -> tuple[str, ...]:
    return tuple(g.strip() for g in (value or "").split(",") if g.strip())


def _own_gpu_at_local_rank(store, rank: int, local_rank: int, local_world_size: int, worker: str,
                           env: MutableMapping[str, str] | None = None) -> None:
    """Re-list this process's GPUs by :func:`host_order` in ``env`` (``os.environ``), agreed with the host's ranks
    through ``store``.

    The host's ranks are ``rank - local_rank`` onwards (the plan orders ranks by host). Must run before CUDA
    starts in this process: CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it starts (the zygote that forked
    the rank never starts it, :mod:`dask_ddp.rank.zygote`).
    """
    env = os.environ if env is None else env
    if local_world_size < 2:  # alone on its host: LOCAL_RANK is 0, its own GPU is first already
        return
    store.set(f"dask_ddp/visible/{rank}", env.get("CUDA_VISIBLE_DEVICES", ""))
    first = rank - local_rank
    visible = [_split(store.get(f"dask_ddp/visible/{r}").decode()) for r in range(first, first + local_world_size)]
    order = host_order(visible, local_rank)
    if order is None:
        return
    import torch

    if torch.cuda.is_initialized():  # something the function's arguments hold (a CUDA tensor) started it
        log.warning("rank %d on worker %s: CUDA started before dask-ddp could re-list its GPUs, so "
                    "cuda:LOCAL_RANK (%d) is not its own GPU (CUDA_VISIBLE_DEVICES=%s); pass CPU tensors",
                    rank, worker, local_rank, env.get("CUDA_VISIBLE_DEVICES"))
        return
    env["CUDA_VISIBLE_DEVICES"] = ",".join(order)


def assign(visible: Sequence[Sequence[str]]) -> list[Placement]:
    """Give each rank a GPU from the UUIDs it sees (``visible[rank]``, in CUDA order); pure."""
    users: dict[str, list[int]] = {}
    picks: list[int | None] = []
    for rank, uuids in enumerate(visible):
        if not uuids:
            picks.append(None)
            continue
        pick = next((i for i, u in enumerate(uuids) if u not in users), None)
        if pick is None:  # every GPU it sees is taken: share the least used one
            pick = min(range(len(uuids)), key=lambda i: (len(users[uuids[i]]), i))
        users.setdefault(uuids[pick], []).append(rank)
        picks.append(pick)
    out = []
    for rank, pick in enumerate(picks):
        if pick is None:
            out.append(Placement())
            continue
        uuid = visible[rank][pick]
        out.append(Placement(pick, uuid, tuple(r for r in users[uuid] if r != rank)))
    return out


def choose_backend(requested: str, placements: Sequence[Placement]) -> str:
    """``auto`` -> nccl when every rank has a GPU of its own, else gloo; other choices stand; pure."""
    if requested != "auto":
        return requested
    own = all(p.index is not None and not p.shared_with for p in placements)
    return "nccl" if own else "gloo"


def visible_gpus() -> tuple[str, ...]:
    """UUIDs of the GPUs this process sees, in CUDA's order (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(_uuid(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count()))


def _uuid(props) -> str:
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    # older torch: the PCI location on this host is as unique
    return f"{socket.gethostname()}/{props.pci_domain_id}:{props.pci_bus_id}:{props.pci_device_id}"


def place(store, rank: int, world_size: int, worker: str, requested: str, local_rank: int = 0,
          local_world_size: int = 1):
    """Choose this rank's device and the job's backend, agreed with every rank through ``store``.

    First re-lists the GPUs this process sees so that ``cuda:LOCAL_RANK`` is its own (see the module's
    docstring), whatever the backend: call it before anything starts CUDA in the process. Returns
    ``(backend, torch.device, device_ids)`` and makes the GPU, if any, the current CUDA device.

    Raises
    ------
    PlanError
        ``backend="nccl"`` where a rank has no GPU of its own (none visible, or
        shared with another rank); the message names the ranks and workers.
    """
    import torch

    _own_gpu_at_local_rank(store, rank, local_rank, local_world_size, worker)
    if requested == "gloo":
        return "gloo", torch.device("cpu"), None
    visible = visible_gpus()
    if requested == "nccl" and not visible:  # fail at once, before waiting on the others
        raise PlanError(f"backend='nccl' needs a GPU, but rank {rank} on worker {worker} sees none "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use backend='gloo' or "
                        "'auto', or run on GPU workers (dask-cuda)", rank=rank, worker=worker)
    store.set(f"dask_ddp/gpus/{rank}", "\n".join((worker, *visible)))
    seen = [store.get(f"dask_ddp/gpus/{r}").decode().split("\n") for r in range(world_size)]
    workers, placements = [s[0] for s in seen], assign([s[1:] for s in seen])
    backend = choose_backend(requested, placements)
    mine = placements[rank]
    shared = next((r for r, p in enumerate(placements) if p.shared_with), None)
    if shared is not None and backend == "nccl":
        p = placements[shared]
        raise PlanError(f"backend='nccl' needs one GPU per rank, but rank {shared} (worker {workers[shared]}) "
                        f"shares GPU {p.uuid} with rank(s) {', '.join(map(str, p.shared_with))} "
                        f"({', '.join(workers[r] for r in p.shared_with)}): the job has more ranks than GPUs. "
                        "Start one worker per GPU (dask-cuda's LocalCUDACluster or dask-cuda-worker), "
                        f"use fewer workers, or backend='auto' (gloo on shared GPUs). Seen from rank {rank}.",
                        rank=rank, worker=worker)
    if shared is not None and rank == 0:
        log.warning("ranks share GPUs (%s): nccl needs one GPU per rank, so backend='auto' uses gloo; "
                    "start one worker per GPU (dask-cuda) for nccl", _describe(placements))
    if mine.index is None:
        return backend, torch.device("cpu"), None
    torch.cuda.set_device(mine.index)
    return backend, torch.device("cuda", mine.index), [mine.index]


def _describe(placements: Sequence[Placement]) -> str:
    groups: dict = {}
    for r, p in enumerate(placements):
        if p.shared_with:
            groups.setdefault(p.uuid, []).append(r)
    return "; ".join(f"ranks {', '.join(map(str, rs))} on {u}" for u, rs in groups.items())
