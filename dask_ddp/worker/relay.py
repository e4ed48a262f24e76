"""The relay: one rank's events, published from its Dask worker in batches.

Runs in: the Dask worker (the rank supervisor's thread and the relay's own); :func:`drop_topic` on the
scheduler, :func:`on_scheduler` wherever a client calls it (the worker's or the notebook's).

:class:`Relay` publishes one event per batch (the format of
:mod:`dask_ddp.wire.events`, items packed as bytes) on the job's topic, at most
``ddp.events.max-batch-bytes`` each: a batch of reports from the rank at once
(the rank sends one at most every ``ddp.events.flush-interval``), with any
output lines gathered meanwhile; output lines alone at the same pace. Each batch
costs about 2 ms of CPU across the rank, worker, scheduler and client, whatever
its size, so batches are few (``benchmarks/RESULTS_report_cpu.md``); in a job
that aggregates per host the relay hands its batches to the host's hub instead
(:mod:`dask_ddp.worker.hub`), which publishes several ranks' batches as one event.
The client reads them with :class:`dask_ddp.client.events.TopicFeed`.

The relay is where the scheduler is protected from whatever the rank's code
does (it could bypass ``report()``): reports and output lines past twice the
rank's byte budget per interval (``ddp.events.max-bytes-per-interval``), and
any report over ``max-report-bytes``, are dropped here and counted in a
``"dropped"`` item of the next batch.
"""

from __future__ import annotations

import logging
import threading
import time

import dask

from dask_ddp.wire.events import EventLimits, chunked, clip_line, dropped_item, item_size, pack_items
from dask_ddp.worker.hub import forward

__all__ = ["Relay", "drop_topic", "on_scheduler"]

logger = logging.getLogger("dask_ddp")

TICK = 0.1  # seconds between the relay's looks at what is queued
SCHEDULER_CALL_TIMEOUT = 10.0  # seconds a best-effort call to the scheduler may take (a job's end waits for it)


class Relay:
    """Collects one rank's events on the worker and publishes them in batches (thread-safe)."""

    def __init__(self, worker, topic: str, rank: int, attempt: int, run_id: str, interval: float | None = None,
                 via: str | None = None, hub_interval: float = 1.0, limits: EventLimits | None = None):
        self.worker, self.topic, self.rank, self.attempt, self.run_id = worker, topic, rank, attempt, run_id
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
        self._window, self._used = float("-inf"), 0  # the current interval's start and the bytes passed in it
        self._dropped: dict[tuple[str, str], int] = {}  # (what, reason) -> count, not yet reported

    def log(self, stream: str, line: str) -> None:
        self.extend([{"kind": "log", "rank": self.rank, "attempt": self.attempt, "time": time.time(),
                      "stream": stream, "line": clip_line(line)}])

    def extend(self, items: list[dict], now: bool = False) -> None:
        """Queue ``items``; ``now``: publish them (and the lines queued before) at once, as one batch; through a
        hub, hand them to it from the relay's thread at once (the hub publishes them on its own schedule)."""
        with self._lock:
            self._items.extend(items)
        if now:
            if self.via is None:
                self.flush()
            else:  # a forward waits for the hub's publication: not in the caller's thread (the supervisor's)
                self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dask-ddp-relay", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Output lines go within a tick after a quiet spell, else with the next rank batch or an interval after
        # the last batch: a rank printing every step adds no more than one batch per interval
        while not self._stop.is_set():
            woken = self._wake.wait(min(TICK, self.interval))
            self._wake.clear()
            if not self._stop.is_set() and self._items and (woken or time.monotonic() - self._published
                                                            >= self.interval):
                self.flush(now=False)

    def flush(self, now: bool = True) -> None:
        """Publish what is queued (through the host's hub, if any; ``now``: it publishes at once too)."""
        with self._publish_lock:  # one publisher at a time keeps seq in order
            with self._lock:
                items, self._items = self._items, []
            items = self._within_budget(items)
            msgs = [self._message(batch) for batch in chunked(items, item_size, self.max_bytes)]
            if msgs:
                self._published = time.monotonic()
                self._publish(msgs, now)

    def _within_budget(self, items: list[dict]) -> list[dict]:
        """``items`` less the reports and lines past this interval's budget (twice the rank's: its reports and
        its output lines share it) or over ``max-report-bytes``, with a ``"dropped"`` item per reason."""
        now = time.monotonic()
        if now - self._window >= self.interval:
            self._window, self._used = now, 0
        budget, kept = 2 * self.limits.interval_bytes, []
        for item in items:
            kind = item.get("kind")
            if kind not in ("metric", "log"):  # telemetry, outcomes, dropped counts: small, always pass
                kept.append(item)
                continue
            size, what = item_size(item), "report" if kind == "metric" else "line"
            reason = ("size" if kind == "metric" and size > self.limits.report_bytes + 256 else
                      "rate" if self._used + size > budget else None)
            if reason is None:
                self._used += size
                kept.append(item)
            else:
                self._dropped[what, reason] = self._dropped.get((what, reason), 0) + 1
        if self._dropped:
            kept += [dropped_item(self.rank, self.attempt, what, reason, n)
                     for (what, reason), n in self._dropped.items()]
            self._dropped = {}
        return kept

    def _message(self, batch: list[dict]) -> dict:
        self.seq += 1
        # packed: the scheduler keeps a topic's last 1,000 events as they are, and bytes cost it their size; an
        # item msgpack refuses (it would cost the worker its scheduler) is escaped first (pack_items)
        return {"run": self.run_id, "rank": self.rank, "attempt": self.attempt, "seq": self.seq,
                "items": pack_items(batch)}

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


def on_scheduler(client, fn, *args):
    """``client.run_on_scheduler(fn, *args)`` for the best-effort calls at a job's or sweep's end, bounded.

    Raises
    ------
    ConnectionError
        The client is not running: a closing client's call never returned (its loop closed under it).
    TimeoutError
        No answer within :data:`SCHEDULER_CALL_TIMEOUT` seconds.
    """
    if getattr(client, "status", None) != "running":
        raise ConnectionError(f"the Dask client is not running (status {getattr(client, 'status', None)!r})")
    return client.run_on_scheduler(fn, *args, callback_timeout=SCHEDULER_CALL_TIMEOUT)
