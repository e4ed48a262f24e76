"""The preemption protocol's values in a job's rendezvous store, signed: only the job's ranks can write them.

Runs in: the rank process (:mod:`dask_ddp.rank.preemption`, in the main thread and the notice watcher's).

Anyone who can connect to rank 0's store can list its keys (torch's ``TCPStore.list_keys()`` shows the
attempt's prefix) and write, delete or pop any of them. So every value a rank acts on carries an HMAC made
with the attempt's key (:class:`~dask_ddp.wire.notices.Seal`), which only the job's processes hold, and a
value that fails the check is ignored, counted and reported to ``job.history`` (:class:`Forgeries`). No
forged value can take a genuine one's place either: each rank has a queue of its own for notices, and a forged
entry there is popped and skipped. The keys, under the attempt's prefix::

    dask_ddp/pre/notice        the first genuine notice, set by compare_set: its writer fans it out (a
                               forged value here only makes every announcer fan out its own)
    dask_ddp/pre/q/<rank>      the rank's queue: every notice fanned out, and its own "end" at the job's end;
                               its watcher thread waits in a blocking ``queue_pop``
    dask_ddp/pre/seen/<rank>   the step the rank was at when it took part: the agreed step is the largest
    dask_ddp/pre/stopped/<rank>  the rank has stopped at the agreed step and saved (the commit barrier)
    dask_ddp/pre/seen, .../stopped  how many ranks posted: a hint only, each value is checked before use

What an outsider who reaches the store can still do is what torch's store lets anyone do there: delete or
overwrite genuine values, take entries from a queue, or break the process group (a denial of service). The
counters ``released`` and ``left`` (how long rank 0 keeps its store open at the end) are unsigned: a forged
count only lets rank 0 close its store early, which the other ranks survive.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable

from dask_ddp.wire.messages import Events
from dask_ddp.wire.notices import Notice, Seal, forged_item

__all__ = ["KEY", "END", "NoticeBoard", "Forgeries"]

KEY = "dask_ddp/pre/"
END = "end"  # the last entry of a rank's queue, its own, once every rank has finished: its watcher returns


class Forgeries:
    """Counts the store values that failed their signature check and tells the job: an event item
    (:func:`~dask_ddp.wire.notices.forged_item`, one line of ``job.history``) at once for the first, then one
    with what came meanwhile after ``interval`` seconds (a timer thread), twice as long after each (up to
    :data:`MAX_GAP`: a flood of forgeries makes a few lines an hour), and the rest at :meth:`flush` (the rank's
    end). Thread-safe.

    A value read again (a posted step checked at every report) counts once.
    """

    MAX_GAP = 300.0

    def __init__(self, rank: int, attempt: int, send: Callable, interval: float = 5.0) -> None:
        self.rank, self.attempt, self.send, self.gap = rank, attempt, send, interval
        self.total = 0
        self._pending: dict[str, int] = {}
        self._known: set[tuple[str, bytes]] = set()  # (key, digest) of values counted already
        self._sent = float("-inf")
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def add(self, what: str, key: str | None = None, value: bytes = b"") -> None:
        """One forged value of ``what`` (``notice``, ``seen``, ``stopped``); ``key``: where it was read, when it
        may be read again (then the same value at the same key counts once)."""
        with self._lock:
            if key is not None:
                known = (key, hashlib.sha256(value).digest())
                if known in self._known:
                    return
                if len(self._known) < 10_000:
                    self._known.add(known)
            self._pending[what] = self._pending.get(what, 0) + 1
            self.total += 1
            wait = self._sent + self.gap - time.monotonic()
            if 0 < wait and self._timer is None:  # what comes meanwhile goes when the gap has passed
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()
        if wait <= 0:
            self.flush()

    def flush(self) -> None:
        """Tell the job what was counted and not told yet. Raises nothing (the rank may be ending)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if pending:
                self._sent, self.gap = time.monotonic(), min(2 * self.gap, self.MAX_GAP)
            total = self.total
        for what, count in pending.items():
            try:
                self.send(Events([forged_item(self.rank, self.attempt, what, count, total)]))
            except Exception:  # noqa: BLE001 - the supervisor hung up: the rank is being stopped
                return


class NoticeBoard:
    """One rank's side of the protocol's store keys (see the module docstring), on one store connection.

    ``store``: the job's store under the attempt's prefix; ``seal``: the attempt's key. The store may raise
    whatever torch raises when it is gone: the callers (:mod:`dask_ddp.rank.preemption`) decide.
    """

    def __init__(self, store, seal: Seal, rank: int, world_size: int, forgeries: Forgeries) -> None:
        self.store, self.seal, self.rank, self.world_size = store, seal, rank, world_size
        self.forgeries = forgeries

    # ---- notices -------------------------------------------------------------------------------------------
    def publish(self, note: Notice) -> None:
        """Put ``note`` in every rank's queue (this rank's too: its watcher then returns), unless another rank
        has put a genuine notice there already (the first notice wins, as it reaches every rank first)."""
        signed, expected = self.seal.sign("notice", note.to_json()), ""
        for _ in range(3):  # a forged value there is replaced (a forger racing us makes every rank fan out)
            held = self.store.compare_set(KEY + "notice", expected, signed)
            if held == signed.encode():
                break
            if self.seal.open("notice", held) is not None:
                return  # a genuine notice is on its way to every rank
            self.forgeries.add("notice", KEY + "notice", held)  # a forged first notice holds back no genuine one
            expected = held
        text = note.to_json()
        for r in range(self.world_size):
            self.store.queue_push(f"{KEY}q/{r}", self.seal.sign(f"q/{r}", text))

    def next_notice(self) -> Notice | None:
        """Wait for the next genuine entry of this rank's queue: a notice, or None for :meth:`end`. A forged
        entry is counted and skipped: the wait goes on."""
        name = f"q/{self.rank}"
        while True:
            value = self.store.queue_pop(KEY + name)
            text = self.seal.open(name, value)
            if text is None:
                self.forgeries.add("notice")
                continue
            if text == END:
                return None
            return Notice.from_json(text)

    def end(self) -> None:
        """Let this rank's watcher return (:meth:`next_notice` gives None): the job's end."""
        name = f"q/{self.rank}"
        self.store.queue_push(KEY + name, self.seal.sign(name, END))

    # ---- the agreed step and the commit barrier ----------------------------------------------------------------
    def post(self, phase: str, value: int | str) -> None:
        """Post this rank's ``value`` for ``phase`` (``seen``: the step it is at; ``stopped``: it has stopped)."""
        name = f"{phase}/{self.rank}"
        self.store.set(KEY + name, self.seal.sign(name, str(value)))
        self.store.add(KEY + phase, 1)

    def posted(self, phase: str) -> list[str] | None:
        """Every rank's genuine value for ``phase``, in rank order, or None while some rank has posted none (a
        forged value, counted, is no value: the rank's own post replaces it)."""
        if int(self.store.add(KEY + phase, 0)) < self.world_size:
            return None
        names = [f"{phase}/{r}" for r in range(self.world_size)]
        keys = [KEY + n for n in names]
        if not self.store.check(keys):  # the count was forged: nothing to wait for
            return None
        values: list[str] = []
        for name, key, value in zip(names, keys, self.store.multi_get(keys)):
            text = self.seal.open(name, value)
            if text is None:
                self.forgeries.add(phase, key, value)
            else:
                values.append(text)
        return values if len(values) == self.world_size else None
