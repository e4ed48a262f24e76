"""The failure policy: pure decisions about a running or ended attempt; no cluster, no side effects.

Runs in: the client. The controller (:mod:`dask_ddp.client.controller`) is the one
place that acts on these decisions; each is a function of plain data, unit-
tested without a cluster (``tests/test_policy.py``):

- :func:`decide`: restart or fail (or finish) after an attempt's ranks have all ended;
- :func:`root_cause` and :func:`root_error`: which rank's failure explains the others, and the
  exception ``result()`` raises for it;
- :func:`restart_request`: how many workers a restart needs, and which selection it plans with;
- :func:`blame_stall` and :func:`stall_error`: which rank a stall blames, and the error that says so;
- :func:`lost_outcome`: the outcome of a rank whose worker left or went silent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import cloudpickle
import dask

from dask_ddp.wire.errors import DaskDDPError, PickledRankError, RankFailedError, StallError, WorkerLostError
from dask_ddp.wire.notices import Notice, Stopped
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.plan import RankSpec, elastic_bounds

__all__ = ["Action", "Decision", "decide", "root_cause", "root_error", "restart_request", "StallBlame", "blame_stall",
           "stall_error", "lost_outcome", "in_collective"]

# Which failure explains the others: a lost worker explains its peers' broken collectives,
# a killed process likewise, then a rank's own exception; collective errors seen by the
# survivors (secondary) only when nothing else is known.
_PRIORITY = {Status.LOST: 0, Status.STALLED: 0, Status.DIED: 1, Status.ERROR: 2}
_WHAT = {Status.LOST: "lost its worker", Status.STALLED: "stalled", Status.DIED: "died", Status.ERROR: "raised"}
_FATE = {Status.OK: "finished", Status.ABORTED: "was stopped", Status.ERROR: "raised", Status.DIED: "died",
         Status.LOST: "lost its worker", Status.STALLED: "stalled", Status.PREEMPTED: "stopped for a preemption"}


class Action(enum.StrEnum):
    """What follows an attempt whose ranks have all ended."""

    FINISH = "finish"  # every rank returned: the job ends FINISHED
    FAIL = "fail"  # the job ends FAILED (or CANCELLED)
    RESTART = "restart"  # a new attempt, on the workers the cluster has


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt (an :class:`Action`), why, and the root cause if any."""

    action: Action
    reason: str
    root: RankOutcome | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))


def root_cause(outcomes: Sequence[RankOutcome]) -> RankOutcome | None:
    """The outcome that explains the failure: by kind (see ``_PRIORITY``), first-hand before
    secondary collective errors, then the earliest; None when no rank failed on its own."""
    failed = [o for o in outcomes if o.status in _PRIORITY]
    if not failed:
        return None
    return min(failed, key=lambda o: (_PRIORITY[o.status], o.secondary, o.time))


def decide(outcomes: Sequence[RankOutcome], *, cancelled: bool, attempt: int, max_restarts: int) -> Decision:
    """Decide what follows an attempt whose ranks have all ended.

    ``attempt`` counts from 0; a failed attempt is restarted while
    ``attempt < max_restarts``. Cancellation is never restarted.
    """
    if cancelled:
        return Decision(Action.FAIL, "cancelled by the user")
    root = root_cause(outcomes)
    if root is None:
        if all(o.status == Status.OK for o in outcomes):
            return Decision(Action.FINISH, "every rank returned")
        return Decision(Action.FAIL, "ranks were stopped without a failure of their own")
    where = f"rank {root.rank} on {root.worker} {_WHAT[root.status]}"
    if root.status == Status.ERROR and root.message.startswith("live recovery"):  # why the job did not go on live
        where = f"{where} ({root.message})"
    if attempt < max_restarts:
        return Decision(Action.RESTART, f"{where}; attempt {attempt + 2}/{max_restarts + 1}", root)
    tail = f" after {attempt + 1} attempts" if max_restarts else ""
    return Decision(Action.FAIL, f"{where}{tail}", root)


def root_error(decision: Decision, outcomes: Sequence[RankOutcome], run_id: str, raw: bool = False) -> BaseException:
    """The exception ``Job.result()`` raises for a failed attempt: the root cause's own exception (its type
    and traceback kept), with a note grouping what happened to the other ranks.

    ``raw``: keep it pickled, as a :class:`~dask_ddp.wire.errors.PickledRankError` of at most
    ``ddp.detached.max-result-bytes`` (a driver in the scheduler's process, as for :func:`results`): only the
    client that reads the job unpickles it (``load()``).
    """
    root = decision.root
    if root is None:
        return RankFailedError(f"job {run_id} failed: {decision.reason}")
    where, cap = f"rank {root.rank} on worker {root.worker}", int(dask.config.get("ddp.detached.max-result-bytes"))
    if raw and len(root.error or b"") > cap:
        err: BaseException = RankFailedError(
            f"{where} raised an exception of {len(root.error or b''):,} bytes pickled, over "
            f"ddp.detached.max-result-bytes ({cap:,}): the scheduler keeps a detached job's errors. Raise a smaller "
            f"exception (keep large data out of its fields), or raise the setting. {root.message}".rstrip(),
            rank=root.rank, worker=root.worker)
    else:
        err = PickledRankError(f"{where} failed: {root.message or 'it raised an exception'} (kept pickled in the "
                               "scheduler's process: the client that reads the job unpickles it)",
                               blob=root.error or b"", detail=root.message, rank=root.rank, worker=root.worker)
    others = sorted((o for o in outcomes if o.rank != root.rank or o.status != root.status), key=lambda o: o.rank)
    if others:
        err.add_note("[dask-ddp] other ranks: " + "; ".join(f"rank {o.rank} {_FATE[o.status]}" for o in others))
    return err if raw or not isinstance(err, PickledRankError) else err.load()


def restart_request(selection: Any, world_size: int) -> tuple[int, Any]:
    """``(workers needed, selection to plan with)`` for restarting an attempt of ``world_size`` ranks.

    Elastic bounds ``(min, max)`` need ``min`` and keep the bounds; every worker
    (None) or a count restart on the same number of workers, whichever they are;
    a list of names needs those same workers.
    """
    bounds = elastic_bounds(selection)
    if bounds is not None:
        return bounds[0], selection
    if selection is None or isinstance(selection, int):
        return world_size, world_size
    return world_size, selection


_COLLECTIVE_FRAMES = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")


def in_collective(stack: str) -> bool:
    """Whether a rank's stack dump shows it inside torch.distributed or a backward pass (DDP's all-reduce)."""
    return any(frame in stack.replace("\\", "/") for frame in _COLLECTIVE_FRAMES)


@dataclass(frozen=True)
class StallBlame:
    """The rank a stall is blamed on; ``outside``: it is the one not inside a collective, the others wait in one."""

    rank: int
    age: float | None  # seconds since its last progress (a report, a step); None: none yet
    outside: bool


def blame_stall(ages: Mapping[int, float], live: Sequence[int], stacks: Mapping[int, str]) -> StallBlame:
    """Blame one rank for a stall, given each live rank's seconds since its last progress and stack dump.

    Ranks that wait inside a collective wait for one that is not: blame that one,
    past the limit yet or not (reports arrive up to a flush interval apart, so
    the waiting rank may cross the limit first); among several, the longest
    silent. If every rank is outside (or inside) a collective, the longest silent.
    """
    outside = [rk for rk in live if rk in stacks and not in_collective(stacks[rk])]
    pool = outside or [rk for rk in live if rk in ages] or list(live)
    worst = max(pool, key=lambda rk: ages.get(rk, float("inf")))
    return StallBlame(worst, ages.get(worst), bool(outside) and len(outside) < len(live))


def stall_error(run_id: str, blame: StallBlame, limit: float, stacks: Mapping[int, str], worker: str) -> StallError:
    """The :class:`StallError` for ``blame``, with every rank's stack dump."""
    silent = f"made no progress for {blame.age:.0f} s" if blame.age is not None else "made no progress yet"
    where = " and is not inside a collective (the others wait inside one)" if blame.outside else ""
    dump = "\n".join(f"--- rank {rk} ---\n{stacks[rk]}" for rk in sorted(stacks))
    return StallError(f"job {run_id} stalled: rank {blame.rank} {silent}{where} (stall_timeout={limit} s; the "
                      f"clock of a rank starts at its first report or step; progress is a report() or a step its "
                      f"telemetry counted). Stack dump of every rank:\n{dump}",
                      stacks=dict(stacks), rank=blame.rank, worker=worker)


def lost_outcome(r: RankSpec, when: float, silent: float | None = None, retired: bool = False) -> RankOutcome:
    """The outcome of rank ``r`` whose worker left the cluster at ``when`` (or sent no heartbeat for ``silent`` s).

    ``retired``: the scheduler retired the worker (``retire_workers``, a scale-down, ``adapt``, SIGTERM to the
    worker) and its rank did not stop at an agreed step (its code registered no save): a preemption, whose
    notice the outcome carries, so that the restart is not counted against ``max_restarts``.
    """
    if retired:
        how = ("was retired (retire_workers, a scale-down, adapt or SIGTERM) and the job's code neither registered "
               "on_preemption nor polls preempted(), so it could not save at an agreed step")
        notice = Notice(when, f"worker {r.address} was retired", r.address, "leave")
        err = WorkerLostError(f"rank {r.rank}'s worker {r.address} {how}", rank=r.rank, worker=r.address)
        return RankOutcome(r.rank, r.address, Status.LOST, error=cloudpickle.dumps(err), message=str(err),
                           time=when, preempt=Stopped(notice, heard=when))
    how = (f"sent the scheduler no heartbeat for {silent:.0f} s (ddp.worker-timeout): its machine or network "
           "went away, or the process is frozen" if silent is not None else
           "left the cluster while the job ran (killed, out of memory, or its machine went away)")
    err = WorkerLostError(f"rank {r.rank}'s worker {r.address} (name {r.name!r}) {how}; see the worker's logs, or "
                          "set max_restarts= to restart on the workers left", rank=r.rank, worker=r.address)
    return RankOutcome(r.rank, r.address, Status.LOST, error=cloudpickle.dumps(err), message=str(err), time=when)


def results(outcomes: Mapping[int, RankOutcome], raw: bool, run_id: str) -> tuple[list | None, Exception | None]:
    """The ranks' return values in rank order, and None; or None and the error that ends the job instead.

    ``raw``: keep each value pickled (a detached job's driver, in the scheduler's process: only the client that
    asks unpickles them, so a value's ``__reduce__`` never runs in the scheduler), each at most
    ``ddp.detached.max-result-bytes``. Otherwise the values unpickled.
    """
    blobs = [outcomes[r].value for r in sorted(outcomes)]
    if not raw:
        return [cloudpickle.loads(b) for b in blobs], None
    cap = int(dask.config.get("ddp.detached.max-result-bytes"))
    for r, blob in zip(sorted(outcomes), blobs):
        if len(blob) > cap:
            return None, DaskDDPError(
                f"detached job {run_id}: rank {r} returned {len(blob):,} bytes pickled, over "
                f"ddp.detached.max-result-bytes ({cap:,}): the scheduler keeps a detached job's results. Return "
                "less (save large state with dask_ddp.save_checkpoint and return its step), or raise the setting")
    return blobs, None


def queued_message(found: Mapping[str, Mapping], rank_of: Mapping[str, int]) -> str | None:
    """What to tell the notebook about rank tasks that wait for a free thread on their workers, or None.

    ``found``: per worker, what :func:`dask_ddp.worker.plugin.queued_tasks` answered; ``rank_of``: task key -> rank.
    """
    parts = []
    for address, info in sorted(found.items()):
        ranks = sorted(rank_of[k] for k in info.get("queued", ()) if k in rank_of)
        if not ranks:
            continue
        running = ", ".join(info.get("running", ())) or "nothing"
        more = f" and {info['more']} more" if info.get("more") else ""
        threads = info.get("threads")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on worker {address}, whose "
                     f"{threads} thread{'' if threads == 1 else 's'} run{'s' if threads == 1 else ''} "
                     f"{running}{more}")
    if not parts:
        return None
    return ("ranks wait for a free Dask thread: " + "; ".join(parts) + ". The job starts once those tasks end "
            "(other Dask work, or another job's ranks); cancel() stops it")
