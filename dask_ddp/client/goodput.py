"""A job's goodput: its wall time split into productive steps, start-up, data, checkpoints, recovery, redone.

Runs in: the client (the job's record feeds it under the record's lock). Each rank process sends its own
ledger in its telemetry (:mod:`dask_ddp.wire.goodput` says what each category holds); the book keeps each
process's latest and adds what no process can know:

- **attempts**: the time before a rank process started (scheduling, spawning) is start-up in the first
  attempt, recovery in a later one; so is a whole later attempt's start-up (the restart's price);
- **redone steps after a restart**: the productive time a rank spent on steps up to the highest step
  reported before the restart (counted per telemetry window, about a second; a window that crosses that step
  is shared in proportion to its steps);
- **live replacements**: a replacement's start-up and the time its rank's place stood empty are recovery;
- **other**: the time after a rank's process ended while others ran, the newest seconds of a running rank not
  yet reported, the time of a process that was lost before it sent a ledger, and the time after the last
  attempt ended.

A rank's row covers the attempts' windows; the job's row covers the job's wall time from ``dispatch.run`` on:
each attempt's window shared equally among its ranks' places, plus the time outside attempts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_ddp.wire.goodput import CATEGORIES, OTHER, checked, ratio, total

__all__ = ["GoodputBook", "summary", "COLUMNS"]

COLUMNS = ["rank", *(f"{k}_s" for k in CATEGORIES), "wall_s", "goodput"]  # a row of GoodputBook.rows
QUIET = 5.0  # seconds without telemetry after which a running rank process counts as gone (its place: recovery)


@dataclass
class _Attempt:
    index: int
    launched: float  # unix time
    world_size: int
    prior: int  # the highest step reported before it (-1: none)
    end: float | None = None


@dataclass
class _Process:
    since: float  # unix time its task started
    seen: float  # unix time of its latest telemetry
    split: dict[str, float]
    final: bool
    joined: int
    moved: float = 0.0  # productive seconds that were steps redone after a restart
    step: int | None = None  # the step it last reported


class GoodputBook:
    """Each rank process's latest ledger and the job's attempts; :meth:`rows` makes the table."""

    def __init__(self, created: float) -> None:
        self.created = created
        self.attempts: list[_Attempt] = []
        self.procs: dict[tuple[int, int, int], _Process] = {}  # (attempt, rank, joined) -> its latest ledger
        self.finished: float | None = None

    def launched(self, index: int, at: float, world_size: int, prior: int) -> None:
        """Attempt ``index`` of ``world_size`` ranks started at ``at``; ``prior``: the highest step reported
        before it (-1: none)."""
        if any(a.index == index for a in self.attempts):
            return
        self.ended(at)
        self.attempts.append(_Attempt(index, at, max(1, int(world_size)), prior))

    def ended(self, at: float, job: bool = False) -> None:
        """The current attempt ended at ``at`` (a restart, or the job's end: ``job``)."""
        if self.attempts and self.attempts[-1].end is None:
            self.attempts[-1].end = at
        if job and self.finished is None:
            self.finished = at

    def telemetry(self, item: dict) -> None:
        """Keep a telemetry item's ledger (ignored without a valid one, or of an attempt not launched)."""
        split, since, seen = checked(item), _number(item.get("goodput_since")), _number(item.get("time"))
        rank, index, joined = _count(item.get("rank")), _count(item.get("attempt", 0)), _count(item.get("joined", 0))
        if split is None or since is None or seen is None or rank is None or index is None or joined is None:
            return
        att = next((a for a in self.attempts if a.index == index), None)
        if att is None or rank >= att.world_size:
            return
        key = (index, rank, joined)
        proc = self.procs.get(key)
        step = _count(item.get("goodput_step"))
        moved = proc.moved if proc is not None else 0.0
        if att.prior >= 0 and step is not None:  # steps reported before the restart are done again
            first = _count(item.get("goodput_from"))
            before = proc.step if proc is not None and proc.step is not None else None if first is None else first - 1
            window = max(0.0, split["productive"] - (proc.split["productive"] if proc is not None else 0.0))
            if step <= att.prior:
                moved += window
            elif before is not None and before < att.prior:  # the window crossed it: its share, step by step
                moved += window * (att.prior - before) / (step - before)
        self.procs[key] = _Process(since, seen, split, bool(item.get("final")), joined, moved, step)

    def rows(self, now: float) -> list[dict]:
        """The table: the job's row (``"rank": "job"``) then one per rank, each with the seconds of every
        category of :data:`~dask_ddp.wire.goodput.CATEGORIES`, ``"wall_s"`` (their sum) and ``"goodput"`` (the
        productive share, None before any time)."""
        job, ranks = _zeros(), dict[int, dict[str, float]]()
        end = self.finished if self.finished is not None else now
        cursor, places = self.created, dict[tuple[int, int], list[_Process]]()
        for (index, rank, _), proc in self.procs.items():
            places.setdefault((index, rank), []).append(proc)
        for att in self.attempts:
            stop = att.end if att.end is not None else end
            job["startup" if att.index == 0 else "recovery"] += max(0.0, att.launched - cursor)
            for rank in range(att.world_size):
                place = _place(att, places.get((att.index, rank), []), stop, now)
                _add(ranks.setdefault(rank, _zeros()), place)
                _add(job, {k: v / att.world_size for k, v in place.items()})
            cursor = max(cursor, stop)
        job["startup" if not self.attempts else OTHER] += max(0.0, end - cursor)
        return [_row("job", job)] + [_row(rank, split) for rank, split in sorted(ranks.items())]


def _place(att: _Attempt, procs: list[_Process], stop: float, now: float) -> dict[str, float]:
    """How the time of a rank's place in ``att`` (from its launch to ``stop``) went; ``procs``: the ledgers of
    the processes that held it."""
    out, cursor = _zeros(), att.launched
    procs = sorted(procs, key=lambda p: p.since)
    waiting = "startup" if att.index == 0 else "recovery"
    if procs and procs[0].joined:  # the place's first process left no ledger (lost within its first second)
        waiting = OTHER
    for proc in procs:
        since = min(max(proc.since, cursor), stop)
        out[waiting] += since - cursor
        split = dict(proc.split)
        if att.index > 0 or proc.joined:  # a restart's or a replacement's start-up is the recovery's price
            split["recovery"] += split.pop("startup")
            split["startup"] = 0.0
        redone = min(proc.moved, split["productive"])
        split["productive"] -= redone
        split["redone"] += redone
        take = min(total(split), max(0.0, stop - since))  # a clock ahead of the client's: within the window
        _add(out, _scaled(split, take))
        cursor, waiting = since + take, "recovery"  # a place empty after a process: until one takes it
    last = procs[-1] if procs else None
    tail = max(0.0, stop - cursor)
    if last is not None and (last.final or (att.end is None and now - last.seen < QUIET)):
        waiting = OTHER  # ended normally, or still running and reporting: not yet accounted for
    out[waiting] += tail
    return out


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _count(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _zeros() -> dict[str, float]:
    return {k: 0.0 for k in CATEGORIES}


def _add(into: dict[str, float], split: dict[str, float]) -> None:
    for k, v in split.items():
        into[k] = into.get(k, 0.0) + v


def _scaled(split: dict[str, float], seconds: float) -> dict[str, float]:
    """``split`` cut down in proportion to ``seconds`` when it holds more."""
    whole = total(split)
    return {k: v * seconds / whole for k, v in split.items()} if whole > seconds else split


def _row(rank, split: dict[str, float]) -> dict:
    return {"rank": rank, **{f"{k}_s": split[k] for k in CATEGORIES}, "wall_s": total(split),
            "goodput": ratio(split)}


def summary(row: dict) -> str:
    """``goodput 91.2 % of 40.1 s (start-up 2.0 s, data 0.4 s, ...)``: one row of :meth:`GoodputBook.rows`."""
    share = row["goodput"]
    parts = ", ".join(f"{'start-up' if k == 'startup' else k} {row[f'{k}_s']:.1f} s" for k in CATEGORIES[1:])
    head = "goodput unknown" if share is None else f"goodput {100 * share:.1f} %"
    return f"{head} of {row['wall_s']:.1f} s ({parts})"
