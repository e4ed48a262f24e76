"""A live job's group inside a rank: the commit vote, the group re-formed, a replacement healed from memory.

Runs in: the rank process of a job started with ``dispatch.run(..., recovery="live")``, under
:func:`dask_ddp.rank.live.live_steps` (its main thread) and the rank's listener thread (:meth:`LiveGroup.note_lost`).

**The vote.** Each step is committed in the job's rendezvous store (its keeper, :mod:`dask_ddp.rank.keeper`,
hosts it): each rank adds one to the step's count; the rank whose vote completes it writes ``commit`` with
``compare_set`` (with the replacements the group takes in after the step, if any), and a rank that knows a
member was lost writes ``abort``: the first written wins and every rank follows it (a vote that completes after
an abort changes nothing). Values are signed with the attempt's key (:class:`~dask_ddp.wire.notices.Seal`), as
the preemption protocol's.

**Re-forming.** After a loss the members left agree on the next generation (the first proposal in the store
wins), each checks in to it, and once every member has, they make its process group on a fresh store prefix
(the same processes, a new group). A generation with a member this rank knows was lost is given up for the next:
a loss heard while it forms (two losses at once; a replacement lost while it joins), or one the agreed proposal
did not know of (it came from a rank that had not heard of it yet). Only that gives a generation up: when any news
did, a rank that had heard everything could be left alone in a generation the others had left (a hang, 1 run in
~20 of the five-recoveries test). Losses name the process (its rank and ``RankTask.joined``), so an old loss never
counts against a replacement.

**Healing.** A replacement (the lost rank's number, started into the running attempt) is invited through the
store (signed) to the generation that takes it in; every member then takes the state from the survivors' memory
over the new group: the model's parameters and buffers (in place), the optimizer's state and the data loader's
position (``torch.save`` bytes, read back with ``weights_only=True``) and the step. What the state is and who
sends it (DDP: one survivor; HSDP: a whole replica group) is :mod:`dask_ddp.rank.live_state`'s.

**Releasing.** A peer that hangs or is cut off (a stopped process, a host off the network) sends no FIN: a
survivor blocked in a collective (the gradients' all-reduce, FSDP2's all-gathers, one of the user's own) would
wait for gloo's timeout. When the loss is heard while the rank is in a live step's block, it shuts down its own
connections to its peers (every TCP connection of the process but the store's) 0.2 s later: a collective
blocked fails at once and the recovery goes on (the group those connections served is replaced anyway).
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

from dask_ddp.rank.live_state import StateError
from dask_ddp.wire.errors import DaskDDPError
from dask_ddp.wire.notices import Seal

__all__ = ["LiveGroup", "LiveRecoveryError", "StepAborted", "KEY"]

KEY = "dask_ddp/live/"
LOSS_WAIT = 60.0  # seconds a rank whose collective failed waits to hear which peer was lost, before it raises
RELEASE_AFTER = 0.2  # seconds after a loss is heard until a collective still blocked is released (its sockets shut)


class LiveRecoveryError(DaskDDPError):
    """Live recovery could not go on (no peer loss was reported for a failed collective, this rank was counted
    lost, or the store is gone): the job falls back to a restart, as without live recovery."""


class StepAborted(BaseException):
    """The step's vote ended in ``abort``: a member of the group was lost before every rank voted. A
    ``BaseException``: a training loop's ``except Exception`` lets it pass to the step."""


class LiveGroup:
    """This rank's live group: the members (rank numbers), the generation, the processes known lost, the
    replacements coming (see the module docstring). ``store``: the job's store under the attempt's prefix;
    ``seal``: the attempt's key; ``joining``: this rank replaces a lost one (its ``RankTask.joined``)."""

    def __init__(self, store, seal: Seal, rank: int, world_size: int, backend: str, timeout: float,
                 device=None, joining: int = 0) -> None:
        self.store, self.seal, self.me, self.backend, self.timeout = store, seal, rank, backend, timeout
        self.device, self.joining = device, joining
        self.members = list(range(world_size))
        self.gen = 0
        self.lost: set[tuple[int, int]] = set()  # (rank, n): the process of rank ``rank`` started n-th was lost
        self.incarnation = dict.fromkeys(self.members, 0)  # member -> n of its process (0: started with the attempt)
        self.replacing: dict[int, int] = {}  # lost rank -> n of the replacement starting (RankTask.joined)
        self.heard = threading.Condition()
        self.state: Any = None  # what the group holds and heals (dask_ddp.rank.live_state)
        self.resume: int | None = None  # the step to run after a re-forming that rolled the state back
        self.collective = 0  # odd while the main thread is in a live step's block (+1 in, +1 out): its collectives

    def attach(self, state: Any) -> None:
        """What the group holds and heals a replacement with: a :class:`~dask_ddp.rank.live_state.Replicated` or
        :class:`~dask_ddp.rank.live_state.Sharded` (:func:`~dask_ddp.rank.live.live_steps`); a rank started with
        the attempt builds it on the attempt's group now."""
        self.state = state
        if not self.joining:
            state.formed(self.members, self.me, self.backend)

    def average(self) -> None:
        """Average the gradients over the group where the state's kind does it at the step (DDP: one all-reduce
        per dtype and device). Raises what the collective raises."""
        self.state.average(len(self.members))

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def note_lost(self, ranks, replaced=(), joined=()) -> None:
        with self.heard:
            for r, n in zip(ranks, joined or [0] * len(ranks)):
                self.lost.add((int(r), int(n)))
                self.replacing.pop(int(r), None)  # a replacement lost while it joined: it is no longer coming
            self.replacing.update((int(r), int(n)) for r, n in replaced)
            self.heard.notify_all()
        # in a step's block and a member of this group lost: maybe blocked on a peer that never answers (hung, cut
        # off): release it soon. Not for news of a process the group already went on without (a replacement
        # started for it, to be taken in at a step boundary): shutting the connections then fails a step for no
        # loss, and the ranks wait in vain to hear one
        if self.collective % 2 and self.lost_members():
            self.release_soon()

    def release_soon(self) -> None:
        """Release the main thread's collectives ``RELEASE_AFTER`` s from now if it is still in the same step's
        block then (see :meth:`_release`)."""
        timer = threading.Timer(RELEASE_AFTER, self._release, (self.collective,))
        timer.daemon = True
        timer.start()

    def _release(self, seen: int) -> None:
        """Still in the collective the loss found the main thread in: shut down this process's connections to
        its peers (every TCP connection but the store's: gloo's), so that the collective fails at once instead
        of at gloo's timeout. What dies with them is this group only, which the recovery replaces."""
        if self.collective != seen:  # that collective ended meanwhile
            return
        import socket

        import psutil

        store = int(os.environ.get("MASTER_PORT", "0"))
        for c in psutil.Process().net_connections(kind="tcp"):
            if c.status != psutil.CONN_ESTABLISHED or not c.raddr or store in (c.laddr.port, c.raddr.port):
                continue
            try:
                with socket.socket(fileno=os.dup(c.fd)) as sock:  # the dup shares the connection: gloo sees EOF
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def lost_members(self) -> set[int]:
        """The members of the current group whose processes were lost."""
        with self.heard:
            return {r for r, n in self.lost if r in self.members and self.incarnation.get(r) == n}

    # ---- the commit vote --------------------------------------------------------------------------------------
    def commit(self, index: int) -> tuple[bool, dict[int, int]]:
        """Vote for step ``index``: (True, joiners) when every member voted (commit; ``joiners``, rank -> n, are
        replacements started for ranks the group went on without: it takes them in after this step), (False,
        {}) when a member was lost first (abort)."""
        base = f"{KEY}{self.gen}/{index}/"
        want = "commit" if int(self.store.add(base + "votes", 1)) >= len(self.members) else None
        nap, deadline = 0.0002, time.monotonic() + self.timeout
        while True:
            if want is None and self.store.check([base + "decided"]):
                return self._decision(base, None)
            if want is None and self.lost_members():
                want = "abort"
            if want is None and int(self.store.add(base + "votes", 0)) >= len(self.members):
                want = "commit"
            if want is not None:
                return self._decision(base, want)
            if time.monotonic() > deadline:
                raise LiveRecoveryError(f"rank {self.me}: the vote of step {index} did not complete within "
                                        f"{self.timeout:g} s (ddp.timeout), and no peer was reported lost")
            time.sleep(nap)
            nap = min(nap * 2, 0.005)

    def _decision(self, base: str, want: str | None) -> tuple[bool, dict[int, int]]:
        name = base + "decided"
        if want == "commit":
            with self.heard:
                grow = {str(r): n for r, n in self.replacing.items() if r not in self.members}
            want = json.dumps({"commit": True, "grow": grow})
        elif want == "abort":
            want = json.dumps({"commit": False})
        held = (self.store.compare_set(name, "", self.seal.sign(name, want)) if want is not None
                else self.store.get(name))
        decided = json.loads(self.seal.open(name, held) or "{}")  # a forged decision is no commit: the step runs again
        return bool(decided.get("commit")), {int(r): int(n) for r, n in decided.get("grow", {}).items()}

    # ---- re-forming the group ---------------------------------------------------------------------------------
    def recover(self, index: int, error: BaseException | None) -> None:
        """After step ``index`` failed: wait to hear which member was lost, agree on the members left (with the
        replacements that are starting), re-form the process group with them, and heal the replacements from
        memory. A loss heard while the group forms gives it up for the next one. Raises LiveRecoveryError (no
        loss reported, this rank counted lost, the group not formed within ``timeout``)."""
        with self.heard:
            self.heard.wait_for(self.lost_members, timeout=LOSS_WAIT)
        if not self.lost_members():
            raise LiveRecoveryError(
                f"rank {self.me}: step {index} failed ({error!r}) and no peer was reported lost within "
                f"{LOSS_WAIT:g} s: not a loss live recovery can heal") from error
        self.regroup(index, error)

    def regroup(self, index: int, error: BaseException | None = None, grow: dict[int, int] | None = None) -> None:
        """Re-form the group at step ``index``: without the members lost, with the replacements starting for them
        and with ``grow`` (rank -> n: replacements of ranks the group went on without, taken in at a step
        boundary); every member then takes the state from a survivor if any joined. Raises LiveRecoveryError."""
        gen, grow, before = self.gen + 1, grow or {}, list(self.members)
        self.state.settle()  # plain FSDP2: a peer's snapshot that has arrived is kept before the group goes
        while True:
            with self.heard:
                lost = self.lost_members()
                joiners = {r: n for r, n in self.replacing.items() if r in lost}
                joiners.update((r, n) for r, n in grow.items() if (r, n) not in self.lost)
            members, joiners = self._agree(gen, sorted((set(self.members) - lost) | set(joiners)), joiners, error)
            if self._doomed(members, joiners):  # agreed by a rank that had not heard a loss this one has: it
                gen += 1  # can never form (a lost process never checks in), and no later news would say so here
                continue
            try:
                self.state.check(members)
            except StateError as exc:
                raise LiveRecoveryError(f"rank {self.me}: {exc}") from error
            incarnation = {**self.incarnation, **joiners}
            for n in joiners.values():  # where each replacement learns its group (the same value from every rank)
                invite = f"{KEY}invite/{n}"
                self.store.set(invite, self.seal.sign(invite, json.dumps(
                    {"gen": gen, "members": members, "joiners": sorted(joiners), "before": before,
                     "incarnation": {str(m): incarnation.get(m, 0) for m in members}})))
            if self._form(gen, members, joiners):
                break
            gen += 1
        self.incarnation = {m: incarnation.get(m, 0) for m in members}
        if joiners or self.state.always_sync:
            self.resume = self._sync(index, sorted(joiners), before)
        with self.heard:
            for r in joiners:
                self.replacing.pop(r, None)

    def _agree(self, gen: int, members: list[int], joiners: dict[int, int], error) -> tuple[list[int], dict]:
        """The members (and joiners) of generation ``gen``: the first proposal written to the store wins."""
        name = f"{KEY}{gen}/members"
        proposal = json.dumps({"members": members, "joiners": {str(r): n for r, n in joiners.items()}})
        text = self.seal.open(name, self.store.compare_set(name, "", self.seal.sign(name, proposal)))
        agreed = json.loads(text) if text is not None else {}
        members, joiners = agreed.get("members") or [], {int(r): n for r, n in agreed.get("joiners", {}).items()}
        if self.me not in members:
            raise LiveRecoveryError(f"rank {self.me} is not among the members agreed for generation {gen} "
                                    f"({members or 'none: a forged proposal'}): it was counted lost") from error
        return members, joiners

    def _doomed(self, members: list[int], joiners: dict[int, int]) -> bool:
        """Whether a process of the agreed generation (``members``; ``joiners``: rank -> n of those that join it) is
        one this rank knows was lost: that generation can never form."""
        with self.heard:
            return any((m, joiners.get(m, self.incarnation.get(m, 0))) in self.lost for m in members)

    def join(self) -> int:
        """A replacement's start: wait for its invitation, join the survivors' group (a newer invitation when they
        give one up), take the model, optimizer and step from their memory; returns the step to run. Raises
        LiveRecoveryError (no invitation or no group within ``timeout``, a forged invitation)."""
        name, deadline, gen = f"{KEY}invite/{self.joining}", time.monotonic() + self.timeout, None
        while True:
            if self.store.check([name]):
                text = self.seal.open(name, self.store.get(name))
                if text is None:
                    raise LiveRecoveryError(f"rank {self.me} (a replacement): its invitation in the store is forged")
                invite = json.loads(text)
                if invite["gen"] != gen:
                    gen = invite["gen"]
                    self.incarnation = {int(m): n for m, n in invite["incarnation"].items()}
                    if self._form(gen, invite["members"], None, fresh=True, invite=name):
                        break
                    continue
            if time.monotonic() > deadline:
                raise LiveRecoveryError(f"rank {self.me} (a replacement) was not taken into the job's group within "
                                        f"{self.timeout:g} s (ddp.timeout)")
            time.sleep(0.01)
        self.joining = 0
        return self._sync(None, invite["joiners"], invite["before"])

    def _form(self, gen: int, members: list[int], joiners: dict[int, int] | None, fresh: bool = False,
              invite: str | None = None) -> bool:
        """Check in to generation ``gen``, wait until every member has, then make its process group. False: given
        up before every member checked in (a survivor, given the generation's ``joiners``: a member it knows was
        lost, :meth:`_doomed`; a replacement: a newer invitation at ``invite``). Raises LiveRecoveryError (not
        every member within ``timeout``)."""
        import torch.distributed as dist

        key, deadline, nap = f"{KEY}{gen}/in", time.monotonic() + self.timeout, 0.001
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < len(members):
            if joiners is not None and self._doomed(members, joiners):
                return False  # a member that never checks in was lost: everyone gives this generation up
            if invite is not None and json.loads(self.seal.open(invite, self.store.get(invite)) or "{}").get(
                    "gen") != gen:
                return False
            if time.monotonic() > deadline:
                raise LiveRecoveryError(f"rank {self.me}: the members {members} of generation {gen} did not all "
                                        f"check in within {self.timeout:g} s (ddp.timeout)")
            time.sleep(nap)
            nap = min(nap * 2, 0.02)
        if not fresh:
            dist.destroy_process_group()
        self.gen, self.members = gen, members
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"{KEY}{gen}/pg/", self.store),
                                rank=self.rank, world_size=len(members), timeout=timedelta(seconds=self.timeout),
                                device_id=self.device if self.backend == "nccl" and len(members) > 1 else None)
        self.state.formed(members, self.me, self.backend)
        return True

    def _sync(self, index: int | None, joiners: list[int], before: list[int]) -> int:
        """Every member takes the state (see :mod:`~dask_ddp.rank.live_state`) from the members that are not
        ``joiners`` (or, plain FSDP2, from the snapshots of the members ``before``); returns the step to run.
        Raises LiveRecoveryError (no whole copy of the state is left)."""
        try:
            return self.state.sync(index, self.members, joiners, self.me, self.backend, before)
        except StateError as exc:
            raise LiveRecoveryError(f"rank {self.me}: {exc}") from None
