"""Live recovery inside a rank: a lost peer costs the step in flight, not a restart (``recovery="live"``).

Runs in: the rank process of a job started with ``dispatch.run(..., recovery="live")``.

The training loop runs under :func:`live_steps`::

    for step in dask_ddp.live_steps(total, model=net, optimizer=opt):
        with step:
            loss = loss_fn(net(batch_for(step.index, step.rank, step.world_size)))
            opt.zero_grad()
            loss.backward()
            opt.step()

``net`` is the plain module (no ``DistributedDataParallel`` around it): ``opt.step()`` averages the gradients
over the ranks of the current group itself (one all-reduce of a flat buffer per dtype), then **commits** the
step, and applies it only when every rank of the group has reached that point (a vote in the job's store:
:mod:`dask_ddp.rank.live_group`).

When a rank's process dies or its worker is lost, the controller sends every survivor a
:class:`~dask_ddp.wire.messages.PeerLost` (through its supervisor). A survivor in a collective with the dead
rank gets gloo's error at once (or, blocked on a hung peer, is released); one in the vote sees the loss there.
Either way the step's ``with`` block ends without applying anything, the survivors re-form the process group
without it (or with its replacement, healed from their memory, when the controller found a free worker) and
run the same step again. A collective blocked on a silent peer inside the block (the user's own too) is released
by the recovery. A job that went on smaller takes a replacement in at a step boundary once a worker is
free. A failure that is no lost peer (the code raised) is raised as ever.

Given a ``StreamingLoader``, the steps take their batches from it and every sample of an epoch is used once by
the committed steps (see :func:`live_steps`).

Rank 0's process is no exception: the job's store lives in a keeper process (:mod:`dask_ddp.rank.keeper`).

HSDP too: ``live_steps(total, build=build, shards=n)`` rebuilds the FSDP2 model on each new group's mesh, and
a replica group that took a replacement in heals from another replica's memory (:mod:`dask_ddp.rank.live_state`).

Plain FSDP2: ``live_steps(total, build=build)``: each rank's shards are kept in a peer's memory after every
step and resharded onto the group left after a loss (:mod:`dask_ddp.rank.live_memory`).

A rank hung alive (no process lost: nothing to recover) is the stall watch's: each committed step is progress
in the rank's telemetry, so ``stall_timeout`` fails such a job with every rank's stack, also when the loop never
calls ``report()``.

What this part does not do yet (issue 42): an HSDP job going on with a replica group fewer (no spare: it falls
back to a restart), the loss of rank 0's worker or host (the store's keeper goes with it: a restart), a
collective blocked on a hung peer outside a step's block (not released).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

from dask_ddp.rank import goodput, telemetry
from dask_ddp.rank.live_group import LiveGroup, LiveRecoveryError, StepAborted
from dask_ddp.rank.live_memory import InMemory
from dask_ddp.rank.live_state import Replicated, Sharded
from dask_ddp.wire.notices import Seal

__all__ = ["live_steps", "LiveStep", "LiveRecoveryError", "setup", "peer_lost", "final_world_size"]

_LIVE: LiveGroup | None = None


def setup(store, key: bytes, rank: int, world_size: int, backend: str, timeout: float, device=None,
          joining: int = 0) -> None:
    """Make this rank's live group (the rank's main thread, after the rendezvous): ``store`` is the job's store
    under the attempt's prefix, ``key`` the attempt's signing key; ``joining``: this rank replaces a lost one
    (``RankTask.joined``), it joins the survivors' group in :func:`live_steps`. Raises ValueError (a key under
    16 bytes)."""
    global _LIVE
    _LIVE = LiveGroup(store, Seal(key or os.urandom(32)), rank, world_size, backend, timeout, device, joining)


def peer_lost(ranks, replaced=(), joined=()) -> None:
    """Note that the processes of ``ranks`` (rank numbers; ``joined``: the n of each, 0 for a rank started with
    the attempt) were lost, and which have replacements starting (``(rank, n)`` pairs) (the listener thread, on a
    ``PeerLost``); raises nothing. Without live recovery set up, nothing."""
    if _LIVE is not None:
        _LIVE.note_lost(ranks, replaced, joined)


def final_world_size(world_size: int) -> int:
    """How many ranks end the job together: the live group's members, else ``world_size``."""
    return len(_LIVE.members) if _LIVE is not None else world_size


class LiveStep:
    """One step of :func:`live_steps`: use it as a context manager around the step's work.

    Attributes: ``index`` (the step number), ``rank`` and ``world_size`` (this rank's place in the current
    group: they change when a peer is lost), ``attempts`` (how many times this step has run, from 1),
    ``batch`` (the step's batch from ``live_steps``' loader, else None), ``model`` and ``optimizer`` (the
    step's: HSDP rebuilds them with each new group), ``committed`` (after the block: the step was applied on
    every rank of the group).
    """

    def __init__(self, live: LiveGroup, index: int, attempts: int, pace: list) -> None:
        self._live, self.index, self.attempts = live, index, attempts
        self.pace = pace  # [a committed step's typical seconds or None], shared by the loop's steps
        self.rank, self.world_size = live.rank, len(live.members)
        self.committed = False
        self.voted = False
        self.grow: dict[int, int] = {}
        self.batch: Any = None  # the step's batch, when live_steps was given a loader
        self.rewind: Any = None  # puts the loader back where the step began
        self.began = time.perf_counter()  # when the block was entered (the rank's goodput)
        self.model: Any = None  # the model and optimizer of this step (HSDP: rebuilt with each new group)
        self.optimizer: Any = None

    def __enter__(self) -> "LiveStep":
        self.began = time.perf_counter()
        self._live.collective += 1  # a loss heard in the block releases its collectives (the user's own too)
        if self._live.lost_members():  # heard before the block: its first collective may wait on a silent peer
            self._live.release_soon()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if self._live.collective % 2:
            self._live.collective += 1
        if exc is None and not self.voted:  # no optimizer step in the block: the vote is here
            try:
                self.committed, self.grow = self._live.commit(self.index)
            except RuntimeError as err:  # the store or the group failed: a loss decides below
                exc = err
        if exc is None and self.committed:
            telemetry.COUNTERS.live_step = self.index  # progress, for the stall watch (a loop may never report)
            took, typical = time.perf_counter() - self.began, self.pace[0]
            self.pace[0] = took if typical is None else 0.8 * typical + 0.2 * took
            if self.grow:  # replacements of ranks the group went on without: taken in before the next step
                with goodput.counting("recovery"):
                    self._live.regroup(self.index + 1, grow=self.grow)
            return False
        if exc is not None and not _lost_peer(exc):
            return False  # the code's own error: raised as ever
        self.committed = False
        spent = time.perf_counter() - self.began  # the rank's goodput: the step's own time is redone, the wait
        redone = min(spent, self.pace[0] or spent)  # past it (a collective blocked until the loss was heard) recovery
        goodput.add("redone", redone)
        goodput.add("recovery", spent - redone)
        with goodput.counting("recovery"):
            if self.rewind is not None:  # the loader back to where this step began: a replacement is sent that
                self.rewind()
            self._live.recover(self.index, exc)
        return True

    def __repr__(self) -> str:
        return f"LiveStep(index={self.index}, rank={self.rank}, world_size={self.world_size})"


def live_steps(total: int, *, model: Any = None, optimizer: Any = None, loader: Any = None, start: int = 0,
               build: Callable | None = None, shards: int | None = None,
               memory_budget: int | None = 4 << 30) -> Iterator[LiveStep]:
    """Steps ``start`` .. ``total - 1`` of a live-recovered loop; a step whose group lost a member runs again.

    DDP: ``model``, the plain ``torch.nn.Module`` (not wrapped in ``DistributedDataParallel``), and
    ``optimizer``, its optimizer, whose ``step()`` is taken over for the loop: it averages the gradients over
    the group, votes, and applies the step only once every member has voted (see the module docstring). After
    the loop the optimizer's own ``step`` is back.

    HSDP: instead of ``model`` and ``optimizer``, ``build``, a function that takes a ``DeviceMesh``
    ``(replicate, shard)`` and returns ``(model, optimizer)``, the model sharded on that mesh with
    ``fully_shard`` (or :func:`dask_ddp.shard_model`), and ``shards``, the ranks of a replica group (it divides
    the world size; ranks ``0 .. shards - 1`` are the first group). Every new group rebuilds the model with
    ``build`` and each rank keeps its shards; use ``step.model`` and ``step.optimizer`` in the loop, as they
    change with the group. A replica group that lost a rank heals from another one's memory (see
    :mod:`dask_ddp.rank.live_state`); without a spare worker for it, the job falls back to a restart.

    FSDP2 (one copy of each shard): ``build`` without ``shards``: the mesh is 1-D over the group, and after each
    step every rank's shards are copied to its memory and to a peer's (:mod:`dask_ddp.rank.live_memory`); a
    loss rolls the group back to the newest step held for every rank (one step at most, as a rule) and
    reshards it onto the ranks left, or onto the replacement's group. ``memory_budget``: bytes of snapshots
    (two of its own, two of its peer's) a rank may hold; past it the tier is off (a warning) and a loss
    restarts the job. ``step.index`` may then go back: data chosen by ``step.index`` stays right.

    ``loader``: a :class:`~dask_ddp.data.StreamingLoader` whose batches the
    steps take (``step.batch``, epoch after epoch): a step run again gets the same samples back, the loader
    follows the group's rank and size (its position counts the samples of all ranks together), and a
    replacement gets its position from the survivors: each sample of an epoch is used once by the committed
    steps, through any number of recoveries.

    Raises
    ------
    LiveRecoveryError
        The job was not started with ``recovery="live"``, or a recovery could not go on (see the class).
    TypeError
        ``total`` or ``start`` is not an int, or neither (or both) of ``model``/``optimizer`` and ``build``
        were given; ``build`` returned something other than ``(model, optimizer)``.
    ValueError
        ``shards`` does not divide the world size.
    """
    if isinstance(total, bool) or not isinstance(total, int) or isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(f"live_steps(total={total!r}, start={start!r}): expected ints")
    live = _LIVE
    if live is None:
        raise LiveRecoveryError("live_steps() runs in a rank of a job started with dispatch.run(..., "
                                "recovery=\"live\"); this rank has no live group")
    if (build is None) == (model is None or optimizer is None) or (build is None and shards is not None):
        raise TypeError("live_steps() takes model= and optimizer= (DDP), or build= (FSDP2; with shards=, HSDP)")
    if build is None:
        state: Replicated = Replicated(model, optimizer, loader)
    elif shards is None:  # plain FSDP2: one copy of each shard, kept in a peer's memory too
        state = InMemory(build, len(live.members), live.device, loader, memory_budget, _host_stride())
    else:
        state = Sharded(build, shards, len(live.members), live.device, loader)
    live.attach(state)
    goodput.began()
    if live.joining:  # a replacement: the step, model, optimizer and loader come from the survivors' memory
        with goodput.counting("recovery"):
            start = live.join()
    pace: list = [None]
    current = [LiveStep(live, start, 1, pace)]
    batches, taken = _Batches(loader, live), _TakenOver(live, current)
    try:
        index, attempts = start, 1
        while index < total:
            current[0] = s = LiveStep(live, index, attempts, pace)
            s.batch, s.rewind = batches.next()
            taken.take(state.optimizer)  # HSDP: a new group made a new optimizer
            s.model, s.optimizer = state.model, state.optimizer
            yield s
            if s.committed:
                index, attempts = index + 1, 1
            else:
                state.optimizer.zero_grad(set_to_none=True)
                attempts += 1
            if live.resume is not None:  # plain FSDP2: the group rolled back to its newest snapshot
                goodput.add("redone", max(0, index - live.resume) * (pace[0] or 0.0))  # committed, to run again
                index, live.resume = live.resume, None
    finally:
        taken.give_back()
        batches.close()


class _TakenOver:
    """The optimizer whose ``step()`` live_steps has taken over: it averages (DDP), votes, and applies the step
    only when the vote commits; given back after the loop."""

    def __init__(self, live: LiveGroup, current: list) -> None:
        self.live, self.current = live, current
        self.optimizer: Any = None
        self.own: Any = None

    def take(self, optimizer: Any) -> None:
        if optimizer is self.optimizer:
            return
        self.give_back()
        self.optimizer, own, live = optimizer, optimizer.step, self.live

        def step(*args, **kwargs):
            s = self.current[0]
            if live.lost_members():  # a member is known lost: its collective would fail or hang
                raise StepAborted()
            live.average()
            live.state.before_vote()  # plain FSDP2: the previous step's snapshot is across first
            s.voted = True
            s.committed, s.grow = live.commit(s.index)
            if not s.committed:
                raise StepAborted()
            out = own(*args, **kwargs)
            live.state.applied(s.index, live.members, live.me)  # plain FSDP2: its snapshot taken and sent
            return out

        self.own, optimizer.step = own, step

    def give_back(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step = self.own
            self.optimizer = None


def _host_stride() -> int:
    """How far a rank's snapshot peer is from it in the group: the ranks of one host (ranks are numbered host by
    host), so that the peer is on another host where the job spans hosts; 1 on one host."""
    from dask_ddp.rank.context import get_context

    ctx = get_context()
    return ctx.local_world_size if ctx.num_nodes > 1 else 1


class _Batches:
    """``live_steps``' batches from a loader (none without one): restarted from the loader's position whenever
    the group's rank or size changed or a step is run again."""

    def __init__(self, loader: Any, live: LiveGroup) -> None:
        self.loader, self.live = loader, live
        self.it: Any = None

    def next(self) -> tuple[Any, Any]:
        """The next batch and how to put the loader back before it (None, None without a loader)."""
        loader = self.loader
        if loader is None:
            return None, None
        place = (self.live.rank, len(self.live.members))
        if self.it is None or (loader.rank, loader.world_size) != place:
            self.close()
            loader.rank, loader.world_size = place
            self.it = iter(loader)
        before = loader.state_dict()
        try:
            batch = next(self.it)
        except StopIteration:  # the epoch ended: the loader is at the next one's start
            self.it = it = iter(loader)
            batch = next(it)

        def rewind() -> None:
            self.close()
            loader.load_state_dict(before)
        return batch, rewind

    def close(self) -> None:
        if self.it is not None:
            self.it.close()  # its DataLoader and workers go with it
            self.it = None


def _lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` may come of a lost peer: an aborted vote, or a collective's or the store's error."""
    if isinstance(exc, StepAborted):
        return True
    if isinstance(exc, LiveRecoveryError) or not isinstance(exc, RuntimeError):
        return False
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(w in text for w in ("gloo", "Connection", "NCCL", "Socket"))

