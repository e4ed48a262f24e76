"""What the notebook knows of a job: its state and history, its events and metrics, its end.

Runs in: the client. The controller writes a :class:`JobRecord` (from the
watcher thread); the :class:`~dask_ddp.client.job.Job` handle reads it (from the
user's thread). One condition variable guards it and wakes the readers.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import warnings
from collections import deque

from dask_ddp.client import goodput as goodput_book
from dask_ddp.wire.errors import DaskDDPWarning
from dask_ddp.wire.events import EventLimits, item_size
from dask_ddp.wire.notices import forged_note

__all__ = ["JobRecord", "format_log", "STATES", "ENDED"]

logger = logging.getLogger("dask_ddp")

#: A job's states; every transition is logged with its cause and kept in ``history``.
STATES = ("PENDING", "RUNNING", "RESTARTING", "FINISHED", "FAILED", "CANCELLED")
ENDED = ("FINISHED", "FAILED", "CANCELLED")  # a job in one of these states has its outcome


def format_log(item: dict) -> str:
    """``[rank N] line``; after a restart ``[rank N, attempt K] line`` (K counts from 1, as in ``job.history``); each
    line of a multi-line record (a traceback) so prefixed."""
    attempt = item.get("attempt", 0)
    where = f"rank {item['rank']}, attempt {attempt + 1}" if attempt else f"rank {item['rank']}"
    return "\n".join(f"[{where}] {line}" for line in str(item["line"]).split("\n"))  # every line of a record


def preloaded_note(item: dict) -> str:
    """The history's words for a rank's ``preloaded`` item (:func:`dask_ddp.wire.events.preloaded_item`)."""
    modules, failed = str(item.get("modules") or "nothing"), str(item.get("failed") or "")
    said = f"rank {item.get('rank')}'s warm process had imported {modules} before the job (ddp.zygote-preload)"
    return said + (f"; did not import: {failed}" if failed else "")


class JobRecord:
    """A job's state, history, events and outcome; thread-safe (``cond`` guards everything).

    Bounded: it holds the latest ``max_rows`` reports and ``max_lines`` log records (``ddp.events.max-rows``
    and ``ddp.events.max-lines``), and about ``max_bytes`` of them (``ddp.events.max-record-bytes``, counted
    by :func:`~dask_ddp.wire.events.item_size`): past it the older half of the reports is thinned (every
    other row goes, the newest half stays whole: a long job keeps its shape), and the oldest lines and
    events go. A sink (``JSONLinesSink``) keeps the whole history. ``n_events`` counts every event ever
    added, so a reader can tell where it is even after the oldest were dropped. ``dropped`` counts, per
    rank, what its ranks' limits dropped (``ddp.events.max-*``, see :class:`~dask_ddp.wire.events.EventLimits`);
    ``throttled``, per rank, the seconds its ``report()`` calls waited for room in its budget (nothing lost).
    """

    def __init__(self, run_id: str, max_rows: int = 100_000, max_lines: int = 10_000, max_bytes: int = 32 << 20,
                 limits: EventLimits | None = None):
        self.run_id = run_id
        self.max_bytes, self.limits = max_bytes, EventLimits() if limits is None else limits
        self.sizes = {"metrics": 0, "logs": 0, "events": 0}  # item_size of what each deque holds
        self.thinned = 0  # reports dropped from metric_rows to stay within max_bytes
        self.dropped: dict[int, int] = {}  # rank -> reports and lines its limits dropped (all attempts)
        self.drop_reasons: dict[tuple[str, str], int] = {}  # (what, reason) -> count
        self.throttled: dict[int, float] = {}  # rank -> seconds its reports waited for room (all attempts)
        self.cond = threading.Condition()
        self.state = "PENDING"
        self.history: list[tuple[float, str, str, str]] = []  # (time, old, new, cause)
        self.events: deque[dict] = deque(maxlen=max_rows + max_lines)  # metrics and log records, in order
        self.metric_rows: deque[dict] = deque(maxlen=max_rows)
        self.max_rows = max_rows
        self.log_items: deque[dict] = deque(maxlen=max_lines)
        self.n_events = 0  # events ever added (the first of ``events`` is number n_events - len(events))
        self.n_metrics = 0
        self.top_step = -1  # the highest step any rank reported
        self.stopped_step: int | None = None  # Job.stop(): the step every rank stopped at
        self.latest: dict[int, dict] = {}  # rank -> its latest report
        self.telemetry: dict[int, dict] = {}  # rank -> its latest telemetry item (not kept in ``events``)
        self.stragglers: dict[int, str] = {}  # rank -> the message that named it a straggler (this attempt)
        self.created = time.time()  # when the job was started: job.metrics's "elapsed" counts from here
        self.goodput = goodput_book.GoodputBook(self.created)  # where the wall time went (job.goodput)
        self.error: BaseException | None = None
        self.values: list | None = None
        self.settled = False  # True once the end state is set and on_finish callbacks have run
        self._warned = False
        self._warned_thin = False

    def add(self, items: list[dict]) -> None:
        """Keep a delivered batch's items and wake the readers (once per batch: they redraw on each wake)."""
        with self.cond:
            telemetry = [it for it in items if it.get("kind") == "telemetry"]
            if telemetry:  # a rank's latest only; its history is the scheduler's page's and the sinks' business
                for it in telemetry:  # a window with no step has no step time: the last one known stays
                    self.goodput.telemetry(it)
                    prev = self.telemetry.get(it["rank"])
                    if prev is not None and prev.get("attempt") == it.get("attempt"):
                        it = {**prev, **{k: v for k, v in it.items() if v is not None}}
                    self.telemetry[it["rank"]] = it
                items = [it for it in items if it.get("kind") != "telemetry"]
            if any(it.get("kind") in ("dropped", "throttled") for it in items):
                items = self._count_dropped(items)
            if any(it.get("kind") in ("forged", "preloaded") for it in items):  # history only
                for it in items:
                    if it.get("kind") == "forged":  # a rank ignored forged store values
                        self.note(forged_note(it))
                    elif it.get("kind") == "preloaded":
                        self.note(preloaded_note(it))
                items = [it for it in items if it.get("kind") not in ("forged", "preloaded")]
            for item in items:
                size = item_size(item)
                self._append(self.events, "events", item, size)
                if item.get("kind") == "metric":
                    self._append(self.metric_rows, "metrics", item, size)
                    self.n_metrics += 1
                    self.latest[item["rank"]] = item
                    self.top_step = max(self.top_step, item["step"])
                elif item.get("kind") == "log":
                    self._append(self.log_items, "logs", item, size)
            self.n_events += len(items)
            self._bound()
            self.cond.notify_all()
        if not self._warned and self.n_metrics > self.max_rows:
            self._warned = True
            warnings.warn(f"job {self.run_id}: more than {self.metric_rows.maxlen} reports; job.metrics keeps the "
                          f"latest {self.metric_rows.maxlen} (ddp.events.max-rows): attach a sink "
                          "(dask_ddp.JSONLinesSink) for the whole history", DaskDDPWarning, stacklevel=2)

    def _append(self, rows: deque, name: str, item: dict, size: int) -> None:
        if len(rows) == rows.maxlen:
            self.sizes[name] -= item_size(rows[0])
        rows.append(item)
        self.sizes[name] += size

    def _bound(self) -> None:
        """Hold about ``max_bytes``: thin the older half of the reports, drop the oldest lines and events."""
        while self.sizes["metrics"] > self.max_bytes // 2 and len(self.metric_rows) > 1:
            rows = list(self.metric_rows)
            half = len(rows) // 2
            kept = rows[:half:2] + rows[half:]
            self.thinned += len(rows) - len(kept)
            self.metric_rows = deque(kept, maxlen=self.metric_rows.maxlen)
            self.sizes["metrics"] = sum(map(item_size, kept))
            if not self._warned_thin:
                self._warned_thin = True
                self.note(f"job.metrics holds more than {self.max_bytes // 2} bytes of reports "
                          "(ddp.events.max-record-bytes): its older half is thinned (every other row dropped) to "
                          "stay within it; attach a sink (dask_ddp.JSONLinesSink) for every row", user=True)
        for rows, name in ((self.log_items, "logs"), (self.events, "events")):
            while self.sizes[name] > self.max_bytes // 4 and len(rows) > 1:
                self.sizes[name] -= item_size(rows.popleft())

    def _count_dropped(self, items: list[dict]) -> list[dict]:
        """Count the ``"dropped"`` and ``"throttled"`` items (named once per reason in ``history``); the other
        items."""
        for it in items:
            if it.get("kind") == "throttled":
                self._count_throttled(it)
            if it.get("kind") != "dropped":
                continue
            rank, count, what, reason = it.get("rank"), it.get("count"), it.get("what"), it.get("reason")
            count = count if type(count) is int and count > 0 else 0  # a rank's code could send any value
            self.dropped[rank] = self.dropped.get(rank, 0) + count
            first = (what, reason) not in self.drop_reasons
            self.drop_reasons[what, reason] = self.drop_reasons.get((what, reason), 0) + count
            if first:
                self.note(f"rank {rank} sent {what}s past its limit: {self.limits.why(str(reason))}; they are "
                          f"dropped and counted (job.dropped); report less often or fewer keys, or raise the setting",
                          user=True)
        return [it for it in items if it.get("kind") not in ("dropped", "throttled")]

    def _count_throttled(self, item: dict) -> None:
        """A rank's reports waited for room in its budget (none lost): said once, added up for the end."""
        rank, seconds = item.get("rank"), item.get("seconds")
        seconds = float(seconds) if isinstance(seconds, (int, float)) else 0.0
        first = not self.throttled
        self.throttled[rank] = self.throttled.get(rank, 0.0) + seconds
        if first:
            self.note(f"rank {rank} reported faster than its budget ({self.limits.interval_bytes} bytes a flush "
                      "interval after a burst of four, ddp.events.max-bytes-per-interval): report() waits for room "
                      "so that no report is lost, which slows the loop; report less often or fewer keys, or raise "
                      "the setting", user=True)

    def dropped_summary(self) -> str | None:
        """What the ranks' limits dropped, all reasons, as one line (None when nothing was)."""
        with self.cond:
            if not self.drop_reasons:
                return None
            parts = [f"{n} {what}s ({reason})" for (what, reason), n in sorted(self.drop_reasons.items())]
            ranks = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.dropped.items(), key=lambda kv: str(kv[0])))
        return f"dropped past the ranks' limits (ddp.events.max-*): {', '.join(parts)}; by rank: {ranks}"

    def throttled_summary(self) -> str | None:
        """How long the ranks' reports waited for room in their budgets, as one line (None if they never did)."""
        with self.cond:
            if not self.throttled:
                return None
            waits = sorted(self.throttled.items(), key=lambda kv: str(kv[0]))
            ranks = ", ".join(f"rank {r}: {s:.1f} s" for r, s in waits)
            total = sum(self.throttled.values())
        return (f"report() waited for room in the ranks' budgets (ddp.events.max-bytes-per-interval), {total:.1f} s "
                f"in all ({ranks}); no report was lost")

    def goodput_rows(self) -> list[dict]:
        """Where the wall time went: the job's row then one per rank (see
        :meth:`~dask_ddp.client.goodput.GoodputBook.rows`)."""
        with self.cond:
            return self.goodput.rows(time.time())

    def events_since(self, n: int, limit: int | None = None) -> tuple[list[dict], int]:
        """Events from number ``n`` on, at most ``limit`` (those dropped meanwhile are skipped), and the number
        after the last returned."""
        with self.cond:
            first = self.n_events - len(self.events)
            start = max(n, first) - first
            stop = None if limit is None else start + limit
            batch = list(itertools.islice(self.events, start, stop))
            return batch, first + start + len(batch)

    def transition(self, new: str, cause: str, attempt=None) -> None:
        """Move to state ``new``, keep it in ``history`` and log it with its cause; ``attempt`` (an
        :class:`~dask_ddp.client.attempt.Attempt`): the attempt that is running, whose start a move to
        RUNNING marks. The end state's cause ends with the job's goodput (``; goodput 87.3 % of ...``)."""
        with self.cond:
            old, self.state, now = self.state, new, time.time()
            if new == "RUNNING" and attempt is not None:
                self.goodput.launched(attempt.index, now, attempt.plan.world_size, self.top_step)
            elif new != "RUNNING":
                self.goodput.ended(now, job=new in ENDED)
            if new in ENDED and self.goodput.procs:  # where the time went (known from the ranks' telemetry)
                cause = f"{cause}; {goodput_book.summary(self.goodput.rows(now)[0])}"
            self.history.append((now, old, new, cause))
            self.cond.notify_all()
        logger.info("job %s: %s -> %s (%s)", self.run_id, old, new, cause)

    def note(self, cause: str, user: bool = False) -> None:
        """Keep an event that is no transition in ``history`` (old and new state the same), logged as a warning;
        ``user``: something the user should change, also a :class:`~dask_ddp.DaskDDPWarning`."""
        if user:
            warnings.warn(f"job {self.run_id}: {cause}", DaskDDPWarning, stacklevel=3)
        with self.cond:
            self.history.append((time.time(), self.state, self.state, cause))
            self.cond.notify_all()
        logger.warning("job %s: %s", self.run_id, cause)

    def settle(self) -> None:
        """The end state is set and its callbacks have run: wake ``result()`` (with a last ``history`` note of
        what the ranks' limits dropped, if anything was)."""
        summary = self.dropped_summary()
        if summary is not None and not self.settled:
            self.note(summary)
        waited = self.throttled_summary()
        if waited is not None and not self.settled:
            self.note(waited)
        with self.cond:
            self.settled = True
            self.cond.notify_all()
