"""A job's events on the client: the feed of its Dask topic, in order, and the workers that leave.

Runs in: the client (:class:`TopicFeed`, :class:`EventOrder`, :class:`WorkerWatch`).

The ranks' batches (the format of :mod:`dask_ddp.wire.events`) are published by
each rank's :class:`~dask_ddp.worker.relay.Relay`, or a host's hub.
:class:`TopicFeed` subscribes before the ranks start, backfills once with
``get_events`` (subscribing does not replay the past) and unpacks hub events
into rank batches; :class:`EventOrder` drops batches already seen, keyed
by (attempt, rank, seq), and puts each rank's in the order it sent them. Handlers of
``subscribe_topic`` run on the client's event loop, so they only enqueue.

Dask allows one handler per topic and client; :class:`WorkerWatch` shares the
scheduler's ``"all"`` topic (which reports ``remove-worker``) among jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import Callable

from dask_ddp.wire.events import items_of, unpack
from dask_ddp.worker.relay import drop_topic
from dask_ddp.worker.scheduler_call import on_scheduler

__all__ = ["EventOrder", "TopicFeed", "WorkerWatch", "items_of"]

logger = logging.getLogger("dask_ddp")

_WAKE: dict = {}  # queued by TopicFeed.wake(): no batch, a reason to look


class EventOrder:
    """Every batch once, in the order each rank sent it: no I/O, fed with what the topic delivers.

    Batches come twice when a backfill (``get_events``) overlaps the live
    subscription, and out of order when a backfill brings an older one late:
    :meth:`take` drops the duplicates and holds a batch back until its
    predecessor (same attempt, rank and process, ``seq - 1``) has been given out.
    A live job's replacement rank (``"joined"``: its ``RankTask.joined``) counts
    its batches from 0 again: they are its own, never taken for the lost one's.
    """

    def __init__(self):
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        self.last_seq: dict[tuple[int, int, int], int] = {}
        self._held: dict[tuple[int, int, int], dict[int, dict]] = {}  # (attempt, rank, joined) -> seq -> batch
        self._next: dict[tuple[int, int, int], int] = {}  # (attempt, rank, joined) -> the seq to deliver next

    def take(self, msg: dict) -> list[dict]:
        """The batches ``msg`` makes ready, in ``seq`` order per rank and attempt.

        A duplicate gives ``[]``; so does a batch whose predecessor has not
        arrived yet (a backfill may bring it later): it is held back until
        then, or until :meth:`flush`.
        """
        rk, seq = (msg.get("attempt"), msg.get("rank"), msg.get("joined", 0)), msg.get("seq")
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

    def have_all(self, attempt: int, rank: int, last_seq: int, joined: int = 0) -> bool:
        """Whether every batch up to ``last_seq`` of that rank, attempt and process (``joined``) has been taken."""
        with self._lock:
            return all((attempt, rank, joined, s) in self._seen for s in range(last_seq + 1))


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

    def wake(self, *_) -> None:
        """End the wait of a :meth:`get` now (from any thread): something other than an event needs a look (a
        rank's task has ended); a :meth:`get` that is not waiting returns at once next time."""
        self.queue.put(_WAKE)

    def get(self, wait: float) -> list[dict]:
        """What arrived, waiting up to ``wait`` seconds for the first message or a :meth:`wake`."""
        try:
            out = [self.queue.get(timeout=wait)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return [batch for batch in out if batch is not _WAKE]

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
                on_scheduler(self.client, drop_topic, self.topic)
            except Exception:  # noqa: BLE001 - the client or scheduler is gone: so is the topic, or it stays
                drop = False
        if not drop:
            try:
                self.client.unsubscribe_topic(self.topic)
            except Exception:  # noqa: BLE001 - the client may be closed already
                pass
        if isinstance(handlers, dict):
            handlers.pop(self.topic, None)


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
