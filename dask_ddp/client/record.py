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
from collections import deque

__all__ = ["JobRecord", "format_log", "STATES", "ENDED"]

logger = logging.getLogger("dask_ddp")

#: A job's states; every transition is logged with its cause and kept in ``history``.
STATES = ("PENDING", "RUNNING", "RESTARTING", "FINISHED", "FAILED", "CANCELLED")
ENDED = ("FINISHED", "FAILED", "CANCELLED")  # a job in one of these states has its outcome


def format_log(item: dict) -> str:
    """``[rank N] line``; after a restart ``[rank N, attempt K] line`` (K counts from 1, as in ``job.history``)."""
    attempt = item.get("attempt", 0)
    where = f"rank {item['rank']}, attempt {attempt + 1}" if attempt else f"rank {item['rank']}"
    return f"[{where}] {item['line']}"


class JobRecord:
    """A job's state, history, events and outcome; thread-safe (``cond`` guards everything).

    Bounded: it holds the latest ``max_rows`` reports and ``max_lines`` log records (``ddp.events.max-rows``
    and ``ddp.events.max-lines``); a sink (``JSONLinesSink``) keeps the whole history. ``n_events`` counts
    every event ever added, so a reader can tell where it is even after the oldest were dropped.
    """

    def __init__(self, run_id: str, max_rows: int = 100_000, max_lines: int = 10_000):
        self.run_id = run_id
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
        self.latest: dict[int, dict] = {}  # rank -> its latest report
        self.telemetry: dict[int, dict] = {}  # rank -> its latest telemetry item (not kept in ``events``)
        self.stragglers: dict[int, str] = {}  # rank -> the message that named it a straggler (this attempt)
        self.created = time.time()  # when the job was started: job.metrics's "elapsed" counts from here
        self.error: BaseException | None = None
        self.values: list | None = None
        self.settled = False  # True once the end state is set and on_finish callbacks have run
        self._warned = False

    def add(self, items: list[dict]) -> None:
        """Keep a delivered batch's items and wake the readers (once per batch: they redraw on each wake)."""
        with self.cond:
            telemetry = [it for it in items if it.get("kind") == "telemetry"]
            if telemetry:  # a rank's latest only; its history is the scheduler's page's and the sinks' business
                for it in telemetry:  # a window with no step has no step time: the last one known stays
                    prev = self.telemetry.get(it["rank"])
                    if prev is not None and prev.get("attempt") == it.get("attempt"):
                        it = {**prev, **{k: v for k, v in it.items() if v is not None}}
                    self.telemetry[it["rank"]] = it
                items = [it for it in items if it.get("kind") != "telemetry"]
            for item in items:
                self.events.append(item)
                if item.get("kind") == "metric":
                    self.metric_rows.append(item)
                    self.n_metrics += 1
                    self.latest[item["rank"]] = item
                    self.top_step = max(self.top_step, item["step"])
                elif item.get("kind") == "log":
                    self.log_items.append(item)
            self.n_events += len(items)
            self.cond.notify_all()
        if not self._warned and self.n_metrics > self.max_rows:
            self._warned = True
            logger.warning("job %s: more than %d reports; job.metrics keeps the latest %d (ddp.events.max-rows): "
                           "attach a sink (dask_ddp.JSONLinesSink) for the whole history", self.run_id,
                           self.metric_rows.maxlen, self.metric_rows.maxlen)

    def events_since(self, n: int, limit: int | None = None) -> tuple[list[dict], int]:
        """Events from number ``n`` on, at most ``limit`` (those dropped meanwhile are skipped), and the number
        after the last returned."""
        with self.cond:
            first = self.n_events - len(self.events)
            start = max(n, first) - first
            stop = None if limit is None else start + limit
            batch = list(itertools.islice(self.events, start, stop))
            return batch, first + start + len(batch)

    def transition(self, new: str, cause: str) -> None:
        """Move to state ``new``, keep it in ``history`` and log it with its cause."""
        with self.cond:
            old, self.state = self.state, new
            self.history.append((time.time(), old, new, cause))
            self.cond.notify_all()
        logger.info("job %s: %s -> %s (%s)", self.run_id, old, new, cause)

    def note(self, cause: str) -> None:
        """Keep an event that is no transition in ``history`` (old and new state the same), logged as a warning."""
        with self.cond:
            self.history.append((time.time(), self.state, self.state, cause))
            self.cond.notify_all()
        logger.warning("job %s: %s", self.run_id, cause)

    def settle(self) -> None:
        """The end state is set and its callbacks have run: wake ``result()``."""
        with self.cond:
            self.settled = True
            self.cond.notify_all()
