"""Plain FSDP2 under live recovery: each rank's shards kept in a peer's memory, resharded after a loss.

Runs in: the rank process of a job started with ``dispatch.run(..., recovery="live")``, under
:func:`dask_ddp.rank.live.live_steps` with ``build=`` and no ``shards=`` (one copy of each shard: no replica
to heal from).

**The snapshot tier.** After each applied step every rank copies its shards (parameters and the optimizer's
state, as plain local tensors) and the loader's position to host memory, keeps that copy, and sends it to its
*buddy*, the next rank of the group on another host where the job spans hosts (the next rank otherwise),
while receiving its predecessor's (gloo ``isend``/``irecv`` on a group of their own: the transfer runs in
gloo's threads during the next step, and the rank waits for it only before its next vote, so that a step
commits only once every rank's previous snapshot is across). Each rank keeps the last two of its own and of
its predecessor's (``live_steps(memory_budget=)`` bytes at most: past it the tier is off and a loss falls back to a
restart, with a warning).

**A loss.** The members left (and any replacement) agree on the newest step whose snapshot of every former
member is held by someone (its own copy, or its buddy's), roll back to it (the steps after it run again: one
at most when the snapshots keep up), and reshard: each former shard is broadcast by its holder over the new
group and every rank keeps the rows FSDP2 gives it in the new layout (dim-0 chunks, as ``torch.chunk``). A
lost rank together with its buddy (two adjacent ranks at once) leaves no copy: a restart. The persisted DCP
checkpoints (``save_sharded``) stay behind it, for what memory cannot cover.
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any

from dask_ddp.rank.live_state import Sharded, StateError, loader_position, put_loader

__all__ = ["InMemory"]

KEEP = 2  # snapshots kept of its own and of its predecessor's


class InMemory(Sharded):
    """A plain FSDP2 rank's state (``live_steps(build=...)`` without ``shards``): a 1-D mesh over the group, and
    the snapshot tier (see the module docstring). ``budget``: bytes of snapshots a rank may hold (None: no
    bound)."""

    always_sync = True  # every new group reshards from the snapshots

    def __init__(self, build, world_size: int, device: Any, loader: Any = None, budget: int | None = None,
                 stride: int = 1) -> None:
        super().__init__(build, world_size, world_size, device, loader)
        self.budget, self.stride = budget, max(1, stride)
        self.mine: dict[int, Any] = {}  # step -> this rank's snapshot (a flat uint8 tensor: see _pack)
        self.held: dict[int, Any] = {}  # step -> the predecessor's snapshot
        self.held_from: int | None = None  # whose (a rank number)
        self.pending: Any = None  # (works, buffer, step, whose) of the transfer in flight
        self.pg: Any = None
        self.off = False

    def check(self, members: list[int]) -> None:
        """Any members can hold the state, resharded."""

    def formed(self, members: list[int], me: int, backend: str) -> None:
        """A 1-D mesh over the new group, the model rebuilt on it with ``build`` (the state comes back in
        :meth:`sync`), and the snapshots' own gloo group."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.model = self.optimizer = None
        self.shards = len(members)
        self.mesh = init_device_mesh(self.device_type, (len(members),), mesh_dim_names=("shard",))
        self.model, self.optimizer = self.rebuild(self.mesh)
        self.pg = dist.new_group(backend="gloo") if len(members) > 1 else None

    def applied(self, index: int, members: list[int], me: int) -> None:
        """Step ``index`` was applied: take this rank's snapshot and send it to its buddy (in the background)."""
        import torch
        import torch.distributed as dist

        if self.off:
            return
        self._settle(wait=True)
        blob = _pack(index, self.model, self.optimizer, loader_position(self.loader))
        if self.budget is not None and KEEP * 2 * blob.numel() > self.budget:
            self.off = True
            self.mine.clear()
            self.held.clear()
            logging.getLogger("dask_ddp").warning(
                "rank %d: live recovery's memory tier is off: %d snapshots of %s bytes each would pass "
                "live_steps(memory_budget=%s bytes); a lost rank now restarts the job", me, 2 * KEEP,
                f"{blob.numel():,}", f"{self.budget:,}")
            return
        self.mine[index] = blob
        _trim(self.mine)
        if self.pg is None:
            return
        n, pos = len(members), members.index(me)
        buddy, pred = (pos + self.stride) % n, (pos - self.stride) % n
        sizes = [torch.tensor([blob.numel()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, sizes[0], group_peer=buddy, group=self.pg),
                                         dist.P2POp(dist.irecv, sizes[1], group_peer=pred, group=self.pg)]):
            w.wait()
        into = torch.empty(int(sizes[1]), dtype=torch.uint8)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, blob, group_peer=buddy, group=self.pg),
                                        dist.P2POp(dist.irecv, into, group_peer=pred, group=self.pg)])
        self.pending = (works, into, index, members[pred])

    def before_vote(self) -> None:
        """Wait for the previous snapshot's transfer (a vote commits only once every snapshot before it is
        across). Raises what the transfer raises (a lost peer)."""
        self._settle(wait=True)

    def settle(self) -> None:
        """Before the group is re-formed: keep the predecessor's snapshot in flight if it has arrived."""
        self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """The transfer in flight: waited for (``wait``; its error raised) or, on a new group, kept if done."""
        if self.pending is None:
            return
        works, into, index, whose = self.pending
        self.pending = None
        if not wait and not all(w.is_completed() for w in works):
            return  # not across: the group goes without it
        try:
            for w in works:
                w.wait()
        except RuntimeError:
            if wait:
                raise
            return
        if self.held_from != whose:
            self.held.clear()
        self.held_from, self.held[index] = whose, into
        _trim(self.held)

    def sync(self, index: int | None, members: list[int], joiners: list[int], me: int, backend: str,
             before: list[int] | None = None) -> int:
        """Roll back to the newest step every former member's snapshot is held for, reshard it onto ``members``
        and put the loader there; returns the step to run next. Raises StateError (no such step)."""
        import torch.distributed as dist

        old = list(before or [])  # the members the snapshots were taken in (LiveGroup passes them)
        if self.off or not old:
            raise StateError("live recovery's memory tier holds no snapshot (off, or none taken yet): the plain "
                             "FSDP2 state cannot come back from memory")
        own: dict[int, list[int]] = {}
        if me in old and self.mine:
            own[me] = sorted(self.mine)
        if self.held_from in old and self.held:
            own.setdefault(self.held_from, sorted(self.held))  # type: ignore[arg-type]
        everyone: list = [None] * len(members)
        dist.all_gather_object(everyone, own)
        common = set.intersection(*({s for got in everyone for s in got.get(m, ())} for m in old))
        if not common:
            raise StateError(f"no step's snapshot is held for every former rank {old} (ranks lost with their "
                             "buddies' copies, or none taken yet)")
        step, here = max(common), members.index(me)
        holder = {m: next(i for i, got in enumerate(everyone) if step in got.get(m, ())) for m in old}
        mine = {m: _unpack(self.mine[step] if m == me and m in own else self.held[step])
                for m in old if holder[m] == here}
        loader = self._reshard(old, here, len(members), holder, mine)
        put_loader(self.loader, loader)
        self.mine, self.held, self.held_from = {}, {}, None  # the former layout's: of no use in this one
        self.applied(step, members, me)  # the new layout's first snapshot, at once
        return step + 1

    def _reshard(self, old: list[int], here: int, n: int, holder: dict, mine: dict) -> Any:
        """Every tensor of the state, former shard by former shard, broadcast by its holder over the new group;
        each rank keeps its rows (dim-0 chunks of the new layout). Returns the loader's position."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        params = list(self.model.parameters())
        first = mine.get(old[0])
        meta: list[Any] = [None if first is None else {
            "loader": first["loader"], "param_groups": first["optimizer"]["param_groups"],
            "state": {i: {k: (str(v.dtype) if isinstance(v, torch.Tensor) and v.dim() else v) for k, v in st.items()}
                      for i, st in first["optimizer"]["state"].items()}}]
        dist.broadcast_object_list(meta, group_src=holder[old[0]])  # the state's keys, dtypes and plain values
        sd: dict = meta[0]
        targets: list[tuple[tuple, Any, Any]] = [(("param", i), p.shape, p.dtype) for i, p in enumerate(params)]
        targets += [(("opt", int(i), k), params[int(i)].shape, getattr(torch, v.split(".")[-1]))
                    for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, str)]
        got: dict = {}
        for key, shape, dtype in targets:
            total = shape[0] if len(shape) else 1
            new_lo, new_hi = _rows(total, n, here)
            local = torch.empty((new_hi - new_lo, *shape[1:]), dtype=dtype)
            for k, m in enumerate(old):
                lo, hi = _rows(total, len(old), k)
                if hi <= lo:
                    continue
                part = (_part(mine[m], key).contiguous() if m in mine
                        else torch.empty((hi - lo, *shape[1:]), dtype=dtype))
                dist.broadcast(part, group_src=holder[m])
                a, b = max(lo, new_lo), min(hi, new_hi)
                if a < b:
                    local[a - new_lo:b - new_lo] = part[a - lo:b - lo]
            got[key] = local
        with torch.no_grad():
            for i, p in enumerate(params):
                p.to_local().copy_(got[("param", i)])
        state = {}
        for i, st in sd["state"].items():
            p = params[int(i)]
            state[int(i)] = {k: DTensor.from_local(got[("opt", int(i), k)].to(p.to_local().device), p.device_mesh,
                                                   p.placements, run_check=False, shape=p.shape, stride=p.stride())
                             if isinstance(v, str) else v for k, v in st.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
        return sd["loader"]


def _pack(index: int, model: Any, optimizer: Any, loader: Any) -> Any:
    """This rank's snapshot as one flat uint8 tensor: an 8-byte length, a small ``torch.save`` header (the step,
    the loader's position, the optimizer's plain values, where each tensor lies) and the tensors' bytes (the
    parameters' local shards, the buffers, the optimizer's state as local tensors), one copy of each."""
    import torch
    from torch.distributed.tensor import DTensor

    tensors: list = []

    def place(t: Any) -> tuple:
        t = (t.to_local() if isinstance(t, DTensor) else t).detach()
        tensors.append(t)
        return ("t", len(tensors) - 1, tuple(t.shape), str(t.dtype))

    sd = optimizer.state_dict()
    head = {"step": index, "loader": loader, "param_groups": sd["param_groups"],
            "params": [place(p) for p in model.parameters()], "buffers": [place(b) for b in model.buffers()],
            "state": {i: {k: place(v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in st.items()}
                      for i, st in sd["state"].items()}}
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += _align(t.numel() * t.element_size())
    head["offsets"] = offsets
    buf = io.BytesIO()
    torch.save(head, buf)
    meta = buf.getvalue()
    start = _align(8 + len(meta))
    flat = torch.empty(start + at, dtype=torch.uint8)
    flat[:8].view(torch.int64)[0] = len(meta)
    flat[8:8 + len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            flat[start + off:start + off + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat


def _unpack(flat: Any) -> dict:
    """A snapshot made by :func:`_pack`: its tensors are views of ``flat`` (read with ``weights_only=True``)."""
    import torch

    n = int(flat[:8].view(torch.int64)[0])
    head = torch.load(io.BytesIO(flat[8:8 + n].numpy().tobytes()), weights_only=True)
    start = _align(8 + n)

    def tensor(ref: Any) -> Any:
        if not (isinstance(ref, tuple) and len(ref) == 4 and ref[0] == "t"):
            return ref
        _, i, shape, dtype = ref
        kind = getattr(torch, dtype.split(".")[-1])
        size = math.prod(shape) * torch.empty((), dtype=kind).element_size()
        at = start + head["offsets"][i]
        return flat[at:at + size].view(kind).reshape(shape)

    return {"step": head["step"], "loader": head["loader"], "params": [tensor(r) for r in head["params"]],
            "buffers": [tensor(r) for r in head["buffers"]],
            "optimizer": {"param_groups": head["param_groups"],
                          "state": {i: {k: tensor(v) for k, v in st.items()} for i, st in head["state"].items()}}}


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def _rows(total: int, n: int, k: int) -> tuple[int, int]:
    """The dim-0 rows ``[lo, hi)`` that FSDP2 gives rank ``k`` of ``n`` (``torch.chunk``'s split)."""
    size = math.ceil(total / n) if total else 0
    return min(k * size, total), min((k + 1) * size, total)


def _part(snapshot: dict, key: tuple) -> Any:
    if key[0] == "param":
        return snapshot["params"][key[1]]
    return snapshot["optimizer"]["state"][key[1]][key[2]]


def _trim(kept: dict) -> None:
    for step in sorted(kept)[:-KEEP]:
        del kept[step]
