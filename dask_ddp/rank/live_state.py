"""What a live group holds and heals: the model, its optimizer and the data position, replicated or sharded.

Runs in: the rank process of a job started with ``dispatch.run(..., recovery="live")``, under
:func:`dask_ddp.rank.live.live_steps` (its main thread).

Two kinds, one interface (:class:`~dask_ddp.rank.live_group.LiveGroup` calls them as its group changes):

- :class:`Replicated` (DDP, ``live_steps(model=, optimizer=)``): every rank holds the whole state. The
  gradients are averaged by one all-reduce per dtype at the optimizer's step; a replacement takes the state
  from one survivor (broadcasts over the new group). The model and optimizer stay the user's objects.
- :class:`Sharded` (HSDP, ``live_steps(build=, shards=)``): FSDP2 over a 2-D mesh ``(replicate, shard)``;
  each replica group (``shards`` ranks, original ranks ``g * shards`` .. ``g * shards + shards - 1``) holds one
  copy of the state, sharded; FSDP2 reduces the gradients in the backward. Every new group is a new mesh, so
  the model is rebuilt by the user's ``build(mesh)`` on every rank and each rank puts its own shards back
  (copied to memory first: same shapes, as each rank keeps its place in its replica group). A replica group
  that took a replacement in then takes every shard from a replica group that did not (one broadcast per
  replicate group: torchft's FT-HSDP heal, from memory). The unit of recovery is the replica group: a
  group left short (no worker free for the lost rank) cannot go on, and the job falls back to a restart.
"""

from __future__ import annotations

import io
from typing import Any, Callable

from dask_ddp.wire.errors import DaskDDPError

__all__ = ["Replicated", "Sharded", "StateError", "loader_position", "put_loader"]


class StateError(DaskDDPError):
    """The group left cannot hold the state (an HSDP replica group short of a rank, no whole replica left):
    :class:`~dask_ddp.rank.live_group.LiveGroup` turns it into a ``LiveRecoveryError`` (a restart)."""


class Replicated:
    """A DDP rank's state: ``model`` (the plain module) and ``optimizer``, the same on every rank."""

    always_sync = False  # a new group takes the state from the members only when a replacement joined

    def applied(self, index: int, members: list[int], me: int) -> None:
        """Step ``index`` was applied (the state keeps no snapshots)."""

    def before_vote(self) -> None:
        """Nothing to wait for before a vote."""

    def settle(self) -> None:
        """Nothing in flight to keep before the group is re-formed."""

    def __init__(self, model: Any, optimizer: Any, loader: Any = None) -> None:
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.params = [p for p in model.parameters() if p.requires_grad]

    def check(self, members: list[int]) -> None:
        """Any members can hold a replicated state."""

    def formed(self, members: list[int], me: int, backend: str) -> None:
        """Nothing to rebuild: the module is plain, the new process group is the default one."""

    def average(self, world_size: int) -> None:
        """Average the gradients over the group: one all-reduce per dtype and device."""
        _average(self.params, world_size)

    def sync(self, index: int | None, members: list[int], joiners: list[int], me: int, backend: str,
             before: list[int] | None = None) -> int:
        """Every member takes the model's parameters and buffers (in place), the optimizer's state, the data
        loader's position and the step from the first member that is not a joiner; returns the step."""
        import torch

        source = next(m for m in members if m not in joiners)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        dev = tensors[0].device if backend == "nccl" and tensors else torch.device("cpu")
        state = _bytes_from(members.index(source), me == source, index, dev, tensors,
                            lambda: {"optimizer": self.optimizer.state_dict(), "loader": loader_position(self.loader)})
        if index is None:  # the replacement: a state its code never had
            self.optimizer.load_state_dict(state["optimizer"])
            put_loader(self.loader, state["loader"])
        return state["index"]


class Sharded(Replicated):
    """An HSDP rank's state: the model and optimizer ``build(mesh)`` returns, sharded by FSDP2 over ``shards``
    ranks; rebuilt on every new group (see the module docstring). ``device``: the rank's device (its type
    names the mesh's)."""

    def __init__(self, build: Callable, shards: int, world_size: int, device: Any, loader: Any = None) -> None:
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 or world_size % shards:
            raise ValueError(f"live_steps(shards={shards!r}): expected a positive int dividing the world size "
                             f"({world_size})")
        self.build, self.shards, self.loader = build, shards, loader
        self.device_type = getattr(device, "type", None) or "cpu"
        self.model: Any = None
        self.optimizer: Any = None
        self.mesh: Any = None

    def check(self, members: list[int]) -> None:
        """Raise StateError unless ``members`` are whole replica groups."""
        groups: dict[int, int] = {}
        for m in members:
            groups[m // self.shards] = groups.get(m // self.shards, 0) + 1
        short = sorted(g for g, n in groups.items() if n != self.shards)
        if short:
            raise StateError(
                f"HSDP replica group{'s' if len(short) > 1 else ''} {short} lost a rank and no worker was free to "
                f"replace it: live recovery re-forms whole replica groups of {self.shards} ranks only (add a "
                "spare worker to keep such jobs live)")

    def formed(self, members: list[int], me: int, backend: str) -> None:
        """Make the new group's mesh and rebuild the model on it with ``build(mesh)``, then put this rank's own
        shards and optimizer state back (none the first time). Raises TypeError (``build`` returned something
        other than a module and its optimizer)."""
        from torch.distributed.device_mesh import init_device_mesh

        kept = self.local_state() if self.model is not None else None
        self.model = self.optimizer = None  # the old mesh's modules go before the new ones are built
        self.mesh = init_device_mesh(self.device_type, (len(members) // self.shards, self.shards),
                                     mesh_dim_names=("replicate", "shard"))
        self.model, self.optimizer = self.rebuild(self.mesh)
        if kept is not None:
            self._put_back(kept)

    def rebuild(self, mesh: Any) -> tuple[Any, Any]:
        """``build(mesh)``: the model sharded on ``mesh`` and its optimizer. Raises TypeError (anything else)."""
        import torch

        built = self.build(mesh)
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
            raise TypeError(f"live_steps(build=...): build(mesh) must return (model, optimizer), the model sharded "
                            f"with fully_shard on that mesh; it returned {type(built).__name__}")
        return built

    def average(self, world_size: int) -> None:
        """Nothing: FSDP2 reduced the gradients over both mesh dimensions in the backward."""

    def sync(self, index: int | None, members: list[int], joiners: list[int], me: int, backend: str,
             before: list[int] | None = None) -> int:
        """The replica groups that took a joiner in take every shard, the optimizer's state, the loader's position
        and the step from the first replica group that did not (a broadcast per replicate group); returns the
        step. Raises StateError (every replica group took a joiner: no whole copy of the state is left)."""
        import torch

        groups = sorted({m // self.shards for m in members})
        healed = {j // self.shards for j in joiners}
        whole = [g for g in groups if g not in healed]
        if not whole:
            raise StateError(f"every HSDP replica group lost a rank ({sorted(joiners)} replaced): no whole copy of "
                             "the state is left in memory")
        source, mine = groups.index(whole[0]), me // self.shards in healed
        tensors = [p.to_local() for p in self.model.parameters()] + list(self.model.buffers())
        dev = tensors[0].device if backend == "nccl" and tensors else torch.device("cpu")
        state = _bytes_from(source, me // self.shards == whole[0], index, dev, tensors,
                            lambda: {"optimizer": self.local_state()["optimizer"],
                                     "loader": loader_position(self.loader)},
                            group=self.mesh.get_group("replicate"))
        if mine:
            self._put_back({"optimizer": state["optimizer"]}, params=False)
            put_loader(self.loader, state["loader"])
        return state["index"]

    def local_state(self) -> dict:
        """This rank's shards (plain tensors, copied) and its optimizer's state with plain local tensors."""
        from torch.distributed.tensor import DTensor

        plain = lambda v: v.to_local().clone() if isinstance(v, DTensor) else v.clone() if hasattr(v, "clone") else v  # noqa: E731
        sd = self.optimizer.state_dict()
        return {"params": [p.to_local().detach().clone() for p in self.model.parameters()],
                "buffers": [b.detach().clone() for b in self.model.buffers()],
                "optimizer": {"state": {i: {k: plain(v) for k, v in s.items()} for i, s in sd["state"].items()},
                              "param_groups": sd["param_groups"]}}

    def _put_back(self, kept: dict, params: bool = True) -> None:
        """Copy ``kept`` (as :meth:`_local` makes it) into the rebuilt model and optimizer."""
        import torch
        from torch.distributed.tensor import DTensor

        ps = list(self.model.parameters())
        if params:
            with torch.no_grad():
                for p, t in zip(ps, kept["params"]):
                    p.to_local().copy_(t)
                for b, t in zip(self.model.buffers(), kept["buffers"]):
                    b.copy_(t)
        state = {}
        for i, s in kept["optimizer"]["state"].items():
            p = ps[int(i)]
            like = p.to_local()
            state[int(i)] = {k: DTensor.from_local(v.to(like.device), p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
                             if isinstance(v, torch.Tensor) and v.dim() and v.shape == like.shape else v
                             for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": kept["optimizer"]["param_groups"]})


def _bytes_from(src: int, sending: bool, index: int | None, dev: Any, tensors: list, state: Callable,
                group: Any = None) -> dict:
    """Broadcast ``tensors`` (in place) and the pickled ``state()`` (``torch.save`` bytes, read back with
    ``weights_only=True``) with the step ``index`` from group rank ``src`` over ``group`` (default: the world);
    returns the state with its ``index``."""
    import torch
    import torch.distributed as dist

    head = torch.tensor([-1 if index is None else index, 0], dtype=torch.int64, device=dev)
    blob = b""
    if sending:
        buf = io.BytesIO()
        torch.save(state(), buf)
        blob = buf.getvalue()
        head[1] = len(blob)
    dist.broadcast(head, group=group, group_src=src)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, group=group, group_src=src)
    data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev) if sending
            else torch.empty(int(head[1]), dtype=torch.uint8, device=dev))
    dist.broadcast(data, group=group, group_src=src)
    out = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
    out["index"] = int(head[0])
    return out


def loader_position(loader: Any) -> Any:
    """The loader's ``state_dict()`` (None without a loader)."""
    return loader.state_dict() if loader is not None else None


def put_loader(loader: Any, position: Any) -> None:
    """Put the loader at ``position`` (nothing without a loader or a position)."""
    if loader is not None and position is not None:
        loader.load_state_dict(position)


def _average(params: list, world_size: int) -> None:
    """Average the gradients of ``params`` over the current group: one all-reduce per dtype and device."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups: dict[tuple, list] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every rank sends the same buffers, used or not
        groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world_size
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
