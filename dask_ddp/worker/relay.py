"""The relay: one rank's events, published from its Dask worker in batches.

Runs in: the Dask worker (the rank supervisor's thread and the relay's own); :func:`drop_topic` on the
scheduler (called through :func:`dask_ddp.worker.scheduler_call.on_scheduler`, the bounded scheduler call).

:class:`Relay` publishes one event per batch (the format of
:mod:`dask_ddp.wire.events`, items packed as bytes) on the job's topic, at most
``ddp.events.max-batch-bytes`` each: a batch of reports from the rank at once
(the rank sends one at most every ``ddp.events.flush-interval``; the relay
publishes at most one a tick, 0.1 s, whatever the rank's code sends), with any
output lines gathered meanwhile; output lines alone at the same pace. Each batch
costs about 2 ms of CPU across the rank, worker, scheduler and client, whatever
its size, so batches are few (``benchmarks/RESULTS_report_cpu.md``); in a job
that aggregates per host the relay hands its batches to the host's hub instead
(:mod:`dask_ddp.worker.hub`), which publishes several ranks' batches as one event.
The client reads them with :class:`dask_ddp.client.events.TopicFeed`.

The relay is where the scheduler is protected from whatever the rank's code
does (it could bypass ``report()`` and write any item to its event pipe): its
:class:`Gate` counts every item, of every kind, and drops what passes its
bounds, counted in a ``"dropped"`` item of the next batch. An honest rank's
reports are never dropped here: its own budget paces them within what the gate
allows (see :class:`Gate` for the one case where they could be).
"""

from __future__ import annotations

import logging
import threading
import time

import dask

from dask_ddp.wire.events import (
    MAX_LINE,
    Budget,
    EventLimits,
    chunked,
    clip_line,
    dropped_item,
    flat_size,
    item_size,
    pack_items,
)
from dask_ddp.worker.hub import forward

__all__ = ["Relay", "Gate", "drop_topic"]

logger = logging.getLogger("dask_ddp")

TICK = 0.1  # seconds between the relay's looks at what is queued
# small items the job relies on: bounded by count
CONTROL = frozenset({"telemetry", "dropped", "throttled", "forged", "preloaded"})
# one log record at most, by item_size: clip_line's cut and marker, escaped (a lone surrogate becomes 6
# characters), 4 bytes a character when not ASCII, and its other fields
LINE_BYTES = 4 * 6 * (MAX_LINE + 64) + 1024


class Gate:
    """What the worker lets through of one rank's events: every item counts, whatever its kind.

    - What the rank sends through its event pipe (reports, log records, items of any other kind): a token
      bucket of twice the rank's burst, refilled at the rank's rate (``max-bytes-per-interval`` a flush
      interval). The rank's own bucket (:class:`~dask_ddp.wire.events.Budget`) paces ``report()`` to at most
      one burst plus that rate, so an honest rank passes whole as long as its batches reach the worker within
      four intervals of being made. A report over ``max-report-bytes`` (+256 for its stamp), a log record over
      :data:`LINE_BYTES`, any other item over ``max-report-bytes`` is dropped whole.
    - The small items the job relies on (:data:`CONTROL`: telemetry, drop counts, waits, forged-notice counts,
      the preloaded modules)
      pass beside that budget, at most ``control_items`` per interval of at most ``control_bytes`` each.
    - Output lines (the rank's stdout and stderr, from :class:`~dask_ddp.worker.pump.OutputPump`): a budget of
      their own, ``max-bytes-per-interval`` a flush interval (two at once), so that a rank that prints much
      never costs it a report.
    - Anything that is not a flat dict of plain values (:func:`~dask_ddp.wire.events.flat_size`) is dropped.

    So one rank costs the scheduler at most about two budgets a flush interval, plus ``control_items *
    control_bytes``, plus its bursts. Not thread-safe: the :class:`Relay` calls it under its lock.
    """

    def __init__(self, limits: EventLimits, interval: float, clock=time.monotonic):
        self.limits, self.interval, self.clock = limits, interval, clock
        self.pipe = Budget.per_interval(limits.interval_bytes, interval, 2 * limits.burst_bytes, clock)
        self.lines = Budget.per_interval(limits.interval_bytes, interval, 2 * limits.interval_bytes, clock)
        self.dropped: dict[tuple[str, str], int] = {}  # (what, reason) -> count, not yet reported
        self._window, self._control = float("-inf"), 0  # the current interval's start, control items in it

    def admit(self, items: list) -> list[dict]:
        """The items of ``items`` that pass, in order; the others are counted in :attr:`dropped`."""
        return [item for item in items if self._passes(item)]

    def line(self, item: dict) -> bool:
        """Whether one output line (made by the relay: flat) passes the lines' budget; else it is counted."""
        if self.lines.take(item_size(item)):
            return True
        self._count("line", "rate")
        return False

    def take_dropped(self) -> dict[tuple[str, str], int]:
        """What was dropped since the last call, ``(what, reason) -> count``."""
        dropped, self.dropped = self.dropped, {}
        return dropped

    def _passes(self, item) -> bool:
        kind = item.get("kind") if type(item) is dict else None
        what = "report" if kind == "metric" else "line" if kind == "log" else "item"
        size = flat_size(item)
        if size is None:
            return self._count(what, "shape")
        if kind in CONTROL:
            return self._control_passes(size)
        cap = LINE_BYTES if kind == "log" else self.limits.report_bytes + (256 if kind == "metric" else 0)
        if size > cap:
            return self._count(what, "size")
        return self.pipe.take(size) or self._count(what, "rate")

    def _control_passes(self, size: int) -> bool:
        if size > self.limits.control_bytes:
            return self._count("item", "size")
        now = self.clock()
        if now - self._window >= self.interval:
            self._window, self._control = now, 0
        if self._control >= self.limits.control_items:
            return self._count("item", "count")
        self._control += 1
        return True

    def _count(self, what: str, reason: str) -> bool:
        self.dropped[what, reason] = self.dropped.get((what, reason), 0) + 1
        return False


class Relay:
    """Collects one rank's events on the worker and publishes them in batches (thread-safe)."""

    def __init__(self, worker, topic: str, rank: int, attempt: int, run_id: str, interval: float | None = None,
                 via: str | None = None, hub_interval: float = 1.0, limits: EventLimits | None = None,
                 joined: int = 0):
        self.worker, self.topic, self.rank, self.attempt, self.run_id = worker, topic, rank, attempt, run_id
        self.joined = joined  # a live job's replacement (RankTask.joined): its batches count from seq 0 again
        self.via, self.hub_interval = via, hub_interval  # the worker whose hub publishes for this host (see hub)
        self.seq = -1
        self._items: list[dict] = []
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval = dask.config.get("ddp.events.flush-interval") if interval is None else interval
        self.limits = EventLimits() if limits is None else limits
        self.max_bytes = self.limits.batch_bytes
        self._published = float("-inf")
        self.gate = Gate(self.limits, self.interval)  # guarded by _lock: what is queued has passed it
        self._urgent = False  # the rank sent a batch that waits for the relay's thread to publish it

    def log(self, stream: str, line: str) -> None:
        """Queue one output line of the rank (if its budget passes it)."""
        item = {"kind": "log", "rank": self.rank, "attempt": self.attempt, "time": time.time(), "stream": stream,
                "line": clip_line(line)}
        with self._lock:
            if self.gate.line(item):
                self._items.append(item)

    def extend(self, items: list[dict], now: bool = False) -> None:
        """Queue what of ``items`` (sent by the rank) passes the :class:`Gate`; ``now``: publish them (and the
        lines queued before) at once, as one batch; through a hub, hand them to it from the relay's thread at
        once (the hub publishes them on its own schedule)."""
        with self._lock:
            self._items.extend(self.gate.admit(items))
        if now:
            # a forward waits for the hub's publication: not in the caller's thread (the supervisor's); nor a
            # publication within a tick of the last (a rank's code could send a batch a millisecond, and each
            # event costs the scheduler the same whatever its size): the relay's thread publishes it a tick on
            if self.via is None and time.monotonic() - self._published >= TICK:
                self.flush()
            else:
                self._urgent = True
                self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dask-ddp-relay", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Output lines go within a tick after a quiet spell, else with the next rank batch or an interval after
        # the last batch: a rank printing every step adds no more than one batch per interval
        while not self._stop.is_set():
            self._wake.wait(min(TICK, self.interval))
            self._wake.clear()
            since = time.monotonic() - self._published
            if not self._stop.is_set() and (self._items or self.gate.dropped) and (
                    since >= self.interval or self._urgent and since >= TICK):
                self.flush(now=False)

    def flush(self, now: bool = True) -> None:
        """Publish what is queued (through the host's hub, if any; ``now``: it publishes at once too)."""
        with self._publish_lock:  # one publisher at a time keeps seq in order
            self._urgent = False
            with self._lock:
                items, self._items = self._items, []
                dropped = self.gate.take_dropped()
            items += [dropped_item(self.rank, self.attempt, what, reason, n) for (what, reason), n in dropped.items()]
            msgs = [self._message(batch) for batch in chunked(items, item_size, self.max_bytes)]
            if msgs:
                self._published = time.monotonic()
                self._publish(msgs, now)

    def _message(self, batch: list[dict]) -> dict:
        self.seq += 1
        # packed: the scheduler keeps a topic's last 1,000 events as they are, and bytes cost it their size; an
        # item msgpack refuses (it would cost the worker its scheduler) is escaped first (pack_items)
        msg = {"run": self.run_id, "rank": self.rank, "attempt": self.attempt, "seq": self.seq,
               "items": pack_items(batch)}
        if self.joined:  # told apart from the batches of the process it replaces (same rank and attempt)
            msg["joined"] = self.joined
        return msg

    def _publish(self, msgs: list[dict], now: bool) -> None:
        if self.via is not None:
            try:
                return forward(self.worker, self.via, self.topic, self.run_id, self.hub_interval, msgs, now)
            except Exception as exc:  # noqa: BLE001 - the hub's worker is gone or stuck: publish ourselves
                logger.warning("rank %s: the event hub on worker %s did not take its batches (%r); this worker "
                               "publishes them itself from now on", self.rank, self.via, exc)
                self.via = None
        for msg in msgs:
            self.worker.log_event(self.topic, msg)

    def stop(self) -> None:
        """Stop the relay's thread and publish what is left (through a hub: it publishes at once)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()



def drop_topic(topic: str, dask_scheduler=None) -> bool:
    """On the scheduler: forget ``topic``, its events and its subscribers (``Broker._topics``, private)."""
    topics = getattr(getattr(dask_scheduler, "_broker", None), "_topics", None)
    return topics is not None and topics.pop(topic, None) is not None
