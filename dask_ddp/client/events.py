"""Events between ranks and the notebook, over Dask's ``log_event`` / ``subscribe_topic``.

Runs in: the Dask worker (:class:`Relay`) and the client (:class:`TopicFeed`,
:class:`EventOrder`, :class:`WorkerWatch`); one batch format between them.

Worker side, :class:`Relay` publishes one event per batch
(``{"run", "rank", "attempt", "seq", "items"}``) on the job's topic, at most
``ddp.events.max-batch-bytes`` each: a batch of reports from the rank at once
(the rank sends one at most every ``ddp.events.flush-interval``), with any
output lines gathered meanwhile; output lines alone at the same pace. Each batch
costs about 2 ms of CPU across the rank, worker, scheduler and client, whatever
its size, so batches are few (``benchmarks/RESULTS_report_cpu.md``); in a job
that aggregates per host the Relay hands its batches to the host's hub instead
(:mod:`dask_ddp.worker.hub`), which publishes several ranks' batches as one event. Client
side, :class:`TopicFeed` subscribes before the ranks start, backfills once
with ``get_events`` (subscribing does not replay the past) and unpacks hub
events into rank batches; :class:`EventOrder` drops batches already seen, keyed
by (attempt, rank, seq), and puts each rank's in the order it sent them. Handlers of
``subscribe_topic`` run on the client's event loop, so they only enqueue.

Dask allows one handler per topic and client; :class:`WorkerWatch` shares the
scheduler's ``"all"`` topic (which reports ``remove-worker``) among jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from typing import Callable

import dask
import msgpack

from dask_ddp.rank.reporting import INT_MAX, INT_MIN, TICK, clip_line, safe_text
from dask_ddp.worker.hub import chunked, forward, item_size, unpack

__all__ = ["Relay", "EventOrder", "TopicFeed", "WorkerWatch"]

logger = logging.getLogger("dask_ddp")


def wire_safe(msg) -> bool:
    """Whether ``msg`` encodes as Dask's batched stream does (msgpack): Dask's own check lets more through."""
    try:
        msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
        return False
    return True


def escaped(value):
    """``value`` made wire-safe: text escaped, integers out of msgpack's range as floats, other objects as text."""
    if isinstance(value, dict):
        return {safe_text(str(k)): escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped(v) for v in value]
    if type(value) is str:
        return safe_text(value)
    if type(value) is int:
        return value if INT_MIN <= value <= INT_MAX else float(value)
    if value is None or type(value) in (bool, float, bytes):
        return value
    return safe_text(repr(value))


class Relay:
    """Collects one rank's events on the worker and publishes them in batches (thread-safe)."""

    def __init__(self, worker, topic: str, rank: int, attempt: int, run_id: str, interval: float | None = None,
                 via: str | None = None, hub_interval: float = 1.0):
        self.worker, self.topic, self.rank, self.attempt, self.run_id = worker, topic, rank, attempt, run_id
        self.via, self.hub_interval = via, hub_interval  # the worker whose hub publishes for this host (dask_ddp.worker.hub)
        self.seq = -1
        self._items: list[dict] = []
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.interval = dask.config.get("ddp.events.flush-interval") if interval is None else interval
        self.max_bytes = dask.config.get("ddp.events.max-batch-bytes")
        self._published = float("-inf")

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
            msgs = [self._message(batch) for batch in chunked(items, item_size, self.max_bytes)]
            if msgs:
                self._published = time.monotonic()
                self._publish(msgs, now)

    def _message(self, batch: list[dict]) -> dict:
        self.seq += 1
        msg = {"run": self.run_id, "rank": self.rank, "attempt": self.attempt, "seq": self.seq, "items": batch}
        if not wire_safe(msg):  # the last guard: a message msgpack refuses would cost the worker its scheduler
            msg = escaped(msg)
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


class EventOrder:
    """Every batch once, in the order each rank sent it: no I/O, fed with what the topic delivers.

    Batches come twice when a backfill (``get_events``) overlaps the live
    subscription, and out of order when a backfill brings an older one late:
    :meth:`take` drops the duplicates and holds a batch back until its
    predecessor (same attempt and rank, ``seq - 1``) has been given out.
    """

    def __init__(self):
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        self.last_seq: dict[tuple[int, int], int] = {}
        self._held: dict[tuple[int, int], dict[int, dict]] = {}  # (attempt, rank) -> seq -> batch, waiting
        self._next: dict[tuple[int, int], int] = {}  # (attempt, rank) -> the seq to deliver next

    def take(self, msg: dict) -> list[dict]:
        """The batches ``msg`` makes ready, in ``seq`` order per rank and attempt.

        A duplicate gives ``[]``; so does a batch whose predecessor has not
        arrived yet (a backfill may bring it later): it is held back until
        then, or until :meth:`flush`.
        """
        rk, seq = (msg.get("attempt"), msg.get("rank")), msg.get("seq")
        with self._lock:
            if (*rk, seq) in self._seen:
                return []
            self._seen.add((*rk, seq))
            self.last_seq[rk] = max(self.last_seq.get(rk, -1), -1 if seq is None else seq)
            if seq is None:
                return [msg]
            held = self._held.setdefault(rk, {})
            held[seq] = msg
            ready, nxt = [], self._next.get(rk, 0)
            while nxt in held:
                ready.append(held.pop(nxt))
                nxt += 1
            self._next[rk] = nxt
            return ready

    def flush(self) -> list[dict]:
        """Every held-back batch (its predecessor never came), in ``seq`` order: late is better than lost."""
        with self._lock:
            out = [held[s] for held in self._held.values() for s in sorted(held)]
            self._held.clear()
            return out

    def have_all(self, attempt: int, rank: int, last_seq: int) -> bool:
        """Whether every batch up to ``last_seq`` of that rank and attempt has been taken."""
        with self._lock:
            return all((attempt, rank, s) in self._seen for s in range(last_seq + 1))


class TopicFeed:
    """A job's Dask event topic on the client: what arrives goes to a thread-safe queue.

    Subscribing goes over the client's batched stream to the scheduler, the same
    stream that later submits the ranks' tasks, so the scheduler has the
    subscription before any rank can publish. :meth:`backfill` fetches what was
    published before (subscribing does not replay the past).
    """

    def __init__(self, client, topic: str):
        self.client, self.topic = client, topic
        self.queue: queue.Queue = queue.Queue()
        client.subscribe_topic(topic, self._on_event)

    def _on_event(self, event) -> None:  # runs on the client's event loop: enqueue only
        for batch in unpack(event[1]):  # a host's hub sends several ranks' batches in one event
            self.queue.put(batch)

    def get(self, wait: float) -> list[dict]:
        """What arrived, waiting up to ``wait`` seconds for the first message."""
        try:
            out = [self.queue.get(timeout=wait)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def backfill(self) -> list[dict]:
        """What the scheduler holds for the topic (``get_events``)."""
        return [batch for _, msg in self.client.get_events(self.topic) for batch in unpack(msg)]

    def close(self, drop: bool = True) -> None:
        """Stop listening; with ``drop``, remove the topic and what it holds from the scheduler too.

        Dask has no API for either: ``unsubscribe_topic`` leaves the handler in the client and the
        topic (up to ``distributed.admin.low-level-log-length`` events) on the scheduler for good, so
        every job would leave both behind. The scheduler's topic goes with its subscriptions.
        """
        handlers = getattr(self.client, "_event_handlers", None)  # private (distributed 2026.7): guarded
        if drop:
            try:
                self.client.run_on_scheduler(_drop_topic, self.topic)
            except Exception:  # noqa: BLE001 - the client or scheduler is gone: so is the topic, or it stays
                drop = False
        if not drop:
            try:
                self.client.unsubscribe_topic(self.topic)
            except Exception:  # noqa: BLE001 - the client may be closed already
                pass
        if isinstance(handlers, dict):
            handlers.pop(self.topic, None)


def _drop_topic(topic: str, dask_scheduler=None) -> bool:
    """On the scheduler: forget ``topic``, its events and its subscribers (``Broker._topics``, private)."""
    topics = getattr(getattr(dask_scheduler, "_broker", None), "_topics", None)
    return topics is not None and topics.pop(topic, None) is not None


class WorkerWatch:
    """Fans the scheduler's ``remove-worker`` events out to every job of one client."""

    _by_client: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, client):
        self.client = client
        self._callbacks: dict[int, Callable[[str], None]] = {}
        self._previous = None  # a handler the user had on "all": kept, called too, and put back afterwards

    @classmethod
    def of(cls, client) -> "WorkerWatch":
        with cls._lock:
            watch = cls._by_client.get(client)
            if watch is None:
                watch = cls._by_client[client] = cls(client)
            return watch

    def _on_event(self, event):
        msg = event[1]
        if isinstance(msg, dict) and msg.get("action") == "remove-worker":
            for callback in list(self._callbacks.values()):  # expected: retired (retire_workers, scale-down)
                callback(msg.get("worker", ""), bool(msg.get("expected")))
        if self._previous is not None:
            return self._previous(event)  # the client awaits it if it is a coroutine
        return None

    def add(self, callback: Callable[[str, bool], None]) -> int:
        """Call ``callback(address, expected)`` when a worker leaves (``expected``: the scheduler retired it);
        subscribes while any job listens."""
        with self._lock:
            if not self._callbacks:
                # Dask keeps one handler per topic and client: chain to the user's own, if any
                # (Client._event_handlers is private; without it a user's handler would be replaced)
                previous = getattr(self.client, "_event_handlers", {}).get("all")
                # unsubscribe_topic leaves the handler in that dict (distributed 2026.7): never chain to our own
                self._previous = None if isinstance(getattr(previous, "__self__", None), WorkerWatch) else previous
                self.client.subscribe_topic("all", self._on_event)
            token = id(callback)
            self._callbacks[token] = callback
        return token

    def remove(self, token: int) -> None:
        with self._lock:
            self._callbacks.pop(token, None)
            if not self._callbacks and self.client.status == "running":
                try:
                    if self._previous is not None:
                        self.client.subscribe_topic("all", self._previous)
                    else:
                        self.client.unsubscribe_topic("all")
                except Exception:  # noqa: BLE001
                    pass
                self._previous = None
