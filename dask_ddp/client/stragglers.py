"""Stragglers named: which rank the others wait for, and whether its input or its compute is slow.

Runs in: the client (the job's controller feeds it every telemetry item).

DDP keeps ranks in lockstep, so one slow rank makes every rank's step slow;
the slow rank is the one that waits least in the gradient all-reduce, while
the others wait for it. :func:`find_straggler` is the decision (pure, over
each rank's latest telemetry that had steps); :class:`StragglerWatch` names
a rank once it has been the cause for ``window`` seconds, once per rank and
attempt. The controller acts on what it returns (a warning, ``job.history``,
callbacks, the ``dask-ddp-jobs`` event).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Straggler", "find_straggler", "StragglerWatch"]

MIN_GAP = 0.2  # the others wait at least this share of a step more than the straggler
STALE = 10.0  # seconds: telemetry older than this (beside the newest) is not compared


@dataclass(frozen=True)
class Straggler:
    """A rank the others wait for: its own and the others' collective wait and input wait (shares of a step)."""

    rank: int
    cause: str  # "input" or "compute"
    step_time: float
    wait: float  # its collective-wait share
    others_wait: float  # the least collective-wait share among the other ranks
    input_wait: float  # its input-wait share (0 when not measured)
    others_input: float  # the others' largest input-wait share

    def message(self, worker: str, host: str) -> str:
        """One line for the log, ``job.history`` and the scheduler's page."""
        what = ("its input (waiting for the DataLoader)" if self.cause == "input" else "its compute")
        return (f"rank {self.rank} on worker {worker} (host {host}) is a straggler: the other ranks wait "
                f"{self.others_wait:.0%} of each {self.step_time:.3g} s step for it in the gradient all-reduce, it "
                f"waits {self.wait:.0%}; {what} is slow (input wait {self.input_wait:.0%}, the others' at most "
                f"{self.others_input:.0%})")


def find_straggler(latest: dict[int, dict], min_gap: float = MIN_GAP) -> Straggler | None:
    """The rank every other rank waits for, judged from each rank's latest telemetry item with steps.

    None when a rank has no such item or no collective wait (no DDP model), when one item is stale
    beside the newest, or when no single rank waits clearly least (a uniformly slow job names nobody).
    Cause: ``"input"`` when the rank's input-wait share exceeds the others' by at least half the wait it
    causes them; else ``"compute"``.
    """
    if len(latest) < 2:
        return None
    items = list(latest.values())
    if any(it.get("collective_wait") is None or not it.get("step_time") for it in items):
        return None
    newest = max(it["time"] for it in items)
    if any(newest - it["time"] > STALE for it in items):
        return None
    order = sorted(latest, key=lambda r: latest[r]["collective_wait"])
    slow, runner_up = latest[order[0]], latest[order[1]]
    gap = runner_up["collective_wait"] - slow["collective_wait"]
    if gap < min_gap:
        return None
    own_input = slow.get("input_wait") or 0.0
    others_input = max((latest[r].get("input_wait") or 0.0) for r in order[1:])
    cause = "input" if own_input - others_input >= gap / 2 else "compute"
    return Straggler(rank=order[0], cause=cause, step_time=float(slow["step_time"]),
                     wait=float(slow["collective_wait"]), others_wait=float(runner_up["collective_wait"]),
                     input_wait=float(own_input), others_input=float(others_input))


class StragglerWatch:
    """Names a straggler once it has been the same rank (and cause) for ``window`` seconds of ``now``.

    ``update`` takes a telemetry item and the controller's clock; it returns a :class:`Straggler` the first
    time one is due, else None. Each rank is named at most once per attempt (``reset`` starts an attempt).
    """

    def __init__(self, window: float):
        self.window = window
        self.reset()

    def reset(self) -> None:
        self.latest: dict[int, dict] = {}  # rank -> its latest telemetry item with steps
        self.named: set[int] = set()
        self._suspect: tuple[int, str] | None = None
        self._since = 0.0

    def update(self, item: dict, now: float) -> Straggler | None:
        if item.get("steps"):
            self.latest[item["rank"]] = item
        found = find_straggler(self.latest)
        key = None if found is None else (found.rank, found.cause)
        if key != self._suspect:
            self._suspect, self._since = key, now
        if found is None or found.rank in self.named or now - self._since < self.window:
            return None
        self.named.add(found.rank)
        return found
