"""GPU placement: which GPU each rank takes, and what ``backend="auto"`` means.

Runs in: the rank process (:func:`place`, at rendezvous); the rules are pure functions.

Decisions apart from actions: :func:`assign` and :func:`choose_backend` are pure
functions of what each rank sees (the UUIDs of its visible GPUs, in CUDA's
order); :func:`place` is the rank-side action that shares those through the
job's store and applies the decision.

The rule: in rank order, each rank takes the first GPU it sees that no earlier
rank took. A GPU is known by its UUID, so the rule holds across hosts and
whatever ``CUDA_VISIBLE_DEVICES`` says:

- under dask-cuda (worker *i* sees the GPUs rotated to start at *i*) every rank
  takes ``cuda:0``, its worker's own GPU;
- on workers that see every GPU (a plain ``LocalCluster`` on a GPU box) rank
  *r* takes ``cuda:LOCAL_RANK``, as under torchrun;
- a rank that finds every GPU it sees taken (more ranks than GPUs) shares the
  least used one. nccl cannot run two ranks on one GPU, so ``auto`` then picks
  gloo (the ranks still compute on their GPUs) and ``nccl`` is refused with an
  error naming the ranks.

``backend="gloo"`` keeps every rank on the CPU.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Sequence

from dask_ddp.wire.errors import PlanError

__all__ = ["Placement", "assign", "choose_backend", "place"]

log = logging.getLogger("dask_ddp")


@dataclass(frozen=True)
class Placement:
    """One rank's GPU: ``index`` in the rank's own CUDA numbering (None: no GPU), its UUID, who else uses it."""

    index: int | None = None
    uuid: str = ""
    shared_with: tuple[int, ...] = ()


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


def place(store, rank: int, world_size: int, worker: str, requested: str):
    """Choose this rank's device and the job's backend, agreed with every rank through ``store``.

    Returns ``(backend, torch.device, device_ids)`` and makes the GPU, if any,
    the current CUDA device.

    Raises
    ------
    PlanError
        ``backend="nccl"`` where a rank has no GPU of its own (none visible, or
        shared with another rank); the message names the ranks and workers.
    """
    import torch

    if requested == "gloo":
        return "gloo", torch.device("cpu"), None
    visible = visible_gpus()
    if requested == "nccl" and not visible:  # fail at once, before waiting on the others
        raise PlanError(f"backend='nccl' needs a GPU, but rank {rank} on worker {worker} sees none "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use backend='gloo' or 'auto', "
                        "or run on GPU workers (dask-cuda)", rank=rank, worker=worker)
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
    groups = {}
    for r, p in enumerate(placements):
        if p.shared_with:
            groups.setdefault(p.uuid, []).append(r)
    return "; ".join(f"ranks {', '.join(map(str, rs))} on {u}" for u, rs in groups.items())
