"""``report()``: metrics from a rank to the notebook, batched, complete, in order.

Runs in: the rank process (``report()`` and its flusher thread).

Inside a rank, :func:`report` validates and converts the values, stamps them
with rank, attempt, step and time, and appends them to an in-memory buffer.
A background thread of the rank process ships the buffer to its Dask task
(the supervisor), at most once per ``ddp.events.flush-interval`` (1 s); the
supervisor publishes each batch at once, as one Dask event. The training
thread never waits on the network.

What a rank may send is bounded (:class:`~dask_ddp.wire.events.EventLimits`):
a report past a limit of its own (keys, a name's length, its bytes) is dropped
(the step still counts, and preemption still stops at it), and the next batch
carries the count of what was dropped, and why. The rank's bytes are paced by
a token bucket (:class:`~dask_ddp.wire.events.Budget`): four flush intervals'
worth at once (``4 x ddp.events.max-bytes-per-interval``, 8,000-10,000 small
reports), then one interval's worth per interval. A report past it is not
dropped: ``report()`` waits until the bucket has earned its bytes (at most
``size / rate``, under 0.1 s at the defaults; the wait reads the clock, never
the event pipe, so it always ends), and the next batch says how long it waited
(a ``"throttled"`` item: ``job.history`` names it). A log record past it is
dropped and counted: logging never waits.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
import threading
import time
from collections import deque
from typing import Any, Callable

from dask_ddp.checkpoint.sharded import background as _sharded_async
from dask_ddp.rank import goodput
from dask_ddp.rank import preemption as _preemption
from dask_ddp.rank.context import get_context
from dask_ddp.wire.errors import NotInRankError
from dask_ddp.wire.events import (
    INT_MAX,
    INT_MIN,
    RESERVED_KEYS,
    Budget,
    EventLimits,
    clip_line,
    dropped_item,
    item_size,
    safe_text,
    throttled_item,
)

__all__ = ["report", "RESERVED_KEYS", "safe_text", "clip_line"]

_PLAIN = (bool, int, float)
_BUFFER: "EventBuffer | None" = None  # set by the rank process
_FORKED = False  # True in a process forked from a rank (a DataLoader worker): it has no flusher, so no _BUFFER


def _plain(key: str, value: Any) -> float | int | bool:
    """Convert a Python/NumPy number or a one-element tensor/array to a plain Python number.

    Exactly ``bool``, ``int`` or ``float``: a subclass such as ``numpy.float64`` would fail
    Dask's msgpack check on the worker, far from this call.
    """
    if type(value) in _PLAIN:
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()  # a tensor or array of more than one element raises
        except (RuntimeError, ValueError, TypeError):
            pass
    elif isinstance(value, numbers.Integral):
        value = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
    if type(value) is int:
        return _in_range(key, value)
    if type(value) in _PLAIN:
        return value
    raise TypeError(f"report({key}=...): a metric must be a number (Python, NumPy scalar or one-element tensor); "
                    f"got {type(value).__name__}. Log text with print() or logging instead.")


def _in_range(key: str, value: int) -> int:
    if INT_MIN <= value <= INT_MAX:
        return value
    raise ValueError(f"report({key}={value}): an integer metric must lie in [-2**63, 2**64 - 1] to travel to "
                     f"the client; report float({key}) instead, or a smaller unit")


class EventBuffer:
    """The rank's events waiting for the flusher thread; safe to add to from several threads.

    Lock-free on the fast path on purpose: ``report()`` runs between two
    training steps, when the CPU caches hold the step's tensors, and every
    object it touches costs cache misses (a lock pair alone cost ~6 us there).
    ``deque.append``, ``deque.popleft`` and ``next(itertools.count)`` are
    atomic under the GIL; the budget's fast path is one comparison and one
    addition (:class:`~dask_ddp.wire.events.Budget`), its slow path is locked.
    ``interval``: the rank's flush interval, which paces the budget.
    """

    def __init__(self, rank: int, attempt: int, limits: EventLimits | None = None, interval: float = 1.0):
        self.rank, self.attempt = rank, attempt
        self.limits = EventLimits() if limits is None else limits
        self.items: deque[dict] = deque()
        self.steps = itertools.count()
        self.budget = self._budget(interval)
        self.dropped: dict[tuple[str, str], int] = {}  # (what, reason) -> count, since the last drain
        self.waited, self.waits = 0.0, 0  # seconds report() waited for room, and how many calls, since the drain
        self._drop_lock = threading.Lock()  # the slow path only: drops, waits and their hand-over in drain()
        self._room_lock = threading.Lock()  # the budget's slow path: one refill at a time, debts in call order

    def _budget(self, interval: float) -> Budget:
        return Budget.per_interval(self.limits.interval_bytes, interval, self.limits.burst_bytes)

    def pace(self, interval: float) -> None:
        """Pace the budget by ``interval`` (the rank's flush interval), full again: before the job's code runs."""
        self.budget = self._budget(interval)

    def refill(self) -> None:
        """Credit the budget with the time since its last refill: the flusher does, every tick, since the fast
        path never reads the clock (a bucket refilled only when short would credit less than it earned)."""
        with self._room_lock:
            self.budget.refill()

    def add(self, item: dict, size: int | None = None, what: str = "line") -> bool:
        """Queue ``item`` if the budget has room for it now (else count it dropped); True if queued."""
        size = item_size(item) if size is None else size
        budget = self.budget
        if budget.used + size <= budget.granted:
            budget.used += size
        else:
            with self._room_lock:
                room = budget.take(size)
            if not room:
                self.drop(what, "rate")
                return False
        self.items.append(item)
        return True

    def put(self, item: dict, size: int) -> None:
        """Queue a report: when the budget is short, first wait until it has earned the report's bytes."""
        budget = self.budget
        if budget.used + size <= budget.granted:  # the fast path: a comparison and an addition
            budget.used += size
        else:
            with self._room_lock:
                wait = budget.reserve(size)
            if wait > 0:
                start = time.monotonic()
                time.sleep(wait)
                with self._drop_lock:
                    self.waited += time.monotonic() - start  # what it cost the loop: a sleep runs over
                    self.waits += 1
        self.items.append(item)

    def drop(self, what: str, reason: str) -> None:
        """Count one report (``what="report"``) or log record (``"line"``) dropped for ``reason``."""
        with self._drop_lock:
            self.dropped[what, reason] = self.dropped.get((what, reason), 0) + 1

    def next_step(self, step: int | None) -> int:
        if step is None:
            return next(self.steps)
        self.steps = itertools.count(step + 1)
        return step

    def drain(self) -> list[dict]:
        """What is queued, then one ``"dropped"`` item per reason something was dropped since the last drain and
        a ``"throttled"`` item if reports waited for room."""
        out, pop = [], self.items.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            pass
        if self.dropped or self.waits:
            with self._drop_lock:
                dropped, self.dropped = self.dropped, {}
                (waited, waits), self.waited, self.waits = (self.waited, self.waits), 0.0, 0
            out += [dropped_item(self.rank, self.attempt, what, reason, n) for (what, reason), n in dropped.items()]
            if waits:
                out.append(throttled_item(self.rank, self.attempt, waited, waits))
        return out


def report(metrics: dict | None = None, /, *, step: int | None = None, **values: Any) -> None:
    """Send metrics from this rank to the client: ``dask_ddp.report(loss=0.3, epoch=1)``.

    Values may be Python numbers, NumPy scalars or one-element tensors (a CUDA
    tensor's ``.item()`` waits for the GPU, as anywhere). ``step`` defaults to
    a per-rank counter of calls (0, 1, 2, ...). The call only appends to a
    buffer (a few microseconds); a background thread ships it within 0.1 s,
    or, while the rank reports often, as one batch every
    ``ddp.events.flush-interval`` (1 s). Every report reaches
    ``job.metrics`` and the sinks, in order. A rank's reports are paced:
    up to ``4 x ddp.events.max-bytes-per-interval`` (1 MiB, 8,000 to 10,000
    small reports) at once, then ``max-bytes-per-interval`` (256 KiB, about 2,000
    to 3,000 small reports) a flush interval; past that a call waits until the
    rank's budget has room for it (at most ``size / rate``: under 0.1 s at the
    defaults), and ``job.history`` says how long the reports waited. A report
    with more than ``ddp.events.max-report-keys`` (256) keys, a name longer than
    ``max-key-length`` (256) or more than ``max-report-bytes`` (16 KiB) is
    dropped and counted in ``job.dropped`` and ``job.history``, never raised.
    It is the step boundary of preemption: when a
    worker of the job is leaving, every rank stops at one agreed report (see
    :func:`dask_ddp.on_preemption`).

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    TypeError
        When a key is not a string or a value is not a number (names the key).
    ValueError
        When a key is one of the reserved names (``rank``, ``step``, ``time``, ...), or an integer lies
        outside [-2**63, 2**64 - 1], what the wire to the client can carry (names the key).
    Preempted
        At the step every rank agreed to stop at for a preemption, after saving what
        :func:`dask_ddp.on_preemption` registered (a ``BaseException``: the job restarts from there).
    ShardError
        A ``save_sharded(..., async_save=True)`` of this rank failed or stalled in the background (names the
        rank and the key); raised once, by the first report() after it ended.
    """
    if _sharded_async.FAILED[0] is not None:
        _sharded_async.raise_failed()
    buf = _BUFFER
    if buf is None:
        where = ("in a process with no channel to the client (a DataLoader worker?): call it from the rank's main "
                 "process, e.g. once per batch in the training loop" if _FORKED or _in_rank() else
                 "outside a dask-ddp rank: call it inside the function you pass to dask_ddp.dispatch.run(client, "
                 "fn, ...)")
        raise NotInRankError(f"report() was called {where}")
    goodput.began()  # a loop with no loader or DDP model: its first report ends start-up
    if metrics:
        for key in metrics:
            if not isinstance(key, str):
                raise TypeError(f"report(): metric names must be strings, got {key!r} ({type(key).__name__})")
        values = {**metrics, **values}
        if not all(key.isascii() for key in values):  # a name with lone surrogates cannot travel: escape it
            values = {safe_text(key): value for key, value in values.items()}
    if not RESERVED_KEYS.isdisjoint(values):
        key = sorted(RESERVED_KEYS.intersection(values))[0]
        raise ValueError(f"report(): {key!r} is a reserved name ({', '.join(sorted(RESERVED_KEYS))}); "
                         "rename the metric")
    for key, value in values.items():
        if type(value) is not float:  # the common case, fast
            if type(value) is int:
                if not INT_MIN <= value <= INT_MAX:
                    _in_range(key, value)
            else:
                values[key] = _plain(key, value)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"report(step=...) takes an int, got {type(step).__name__}")
        _in_range("step", int(step))
    step = buf.next_step(None if step is None else int(step))
    size = _STAMP + 11 * len(values) + sum(map(len, values))  # item_size of the item below: its values are numbers
    fault = buf.limits.report_fault(values, size)
    if fault is not None:
        buf.drop("report", fault)
    else:
        buf.put({"kind": "metric", "rank": buf.rank, "attempt": buf.attempt, "step": step, "time": time.time(),
                 **values}, size)
    _preemption.at_report(step)  # once a worker of the job leaves: agree on a step, save, stop there


_STAMP = item_size({"kind": "metric", "rank": 0, "attempt": 0, "step": 0, "time": 0.0})


def current_buffer() -> EventBuffer | None:
    """This process's report buffer (made by :func:`install` in a rank's main process), or None: outside a rank,
    or in a process forked from one (a DataLoader worker), which has no channel to the client. Raises nothing."""
    return _BUFFER


def _forget_buffer() -> None:
    """In a forked child (a DataLoader worker) the inherited buffer would fill up unsent: drop it."""
    global _BUFFER, _FORKED
    _BUFFER, _FORKED = None, True


def _in_rank() -> bool:
    try:
        get_context()
    except NotInRankError:
        return False
    return True


def _printed_on_the_way(record: logging.LogRecord) -> bool:
    """Whether a handler between the record's logger and the root already writes it to the rank's stdout or stderr
    (a library's own console handler: Lightning's, huggingface_hub's, torchmetrics'), which reach the client as
    output lines: the record is then shown once, as under torchrun, not twice."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    root = logging.getLogger()
    while logger is not None and logger is not root:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and record.levelno >= handler.level:
                try:
                    if handler.stream.fileno() in (1, 2):
                        return True
                except (AttributeError, OSError, ValueError):  # a stream of its own (a file, a StringIO)
                    continue
        logger = logger.parent if logger.propagate else None
    return False


class _LogHandler(logging.Handler):
    """Forwards a rank's ``logging`` records as log events (kept with level and logger name)."""

    def __init__(self, buf: EventBuffer):
        super().__init__(level=logging.NOTSET)
        self.buf = buf
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if _printed_on_the_way(record):
                return
            self.buf.add({"kind": "log", "rank": self.buf.rank, "attempt": self.buf.attempt, "time": record.created,
                          "stream": "logging", "level": safe_text(str(record.levelname)),
                          "line": clip_line(self.format(record))})
        except Exception:  # a broken log record must never break training
            self.handleError(record)


TICK = 0.1  # seconds between the flusher's looks at the buffer


class Flusher(threading.Thread):
    """Ships the buffer through ``send(items)`` until stopped: at most once per ``interval`` seconds.

    Items after a quiet spell go within a tick (0.1 s); while a rank reports
    often they go as one batch per ``interval``. Each batch costs the worker,
    scheduler and client about the same whatever its size, so this bounds what
    reporting every step costs, and a rare report still arrives at once. Each
    tick it also refills the buffer's budget (``report()`` never reads the clock
    on its fast path).
    """

    def __init__(self, buf: EventBuffer, send: Callable[[list], None], interval: float, sampler=None):
        super().__init__(name="dask-ddp-flusher", daemon=True)
        self.buf, self.send, self.interval = buf, send, interval
        self.sampler = sampler  # a telemetry.Sampler: adds a telemetry item to a batch when one is due
        self._stop_event = threading.Event()
        self._send_lock = threading.Lock()  # stop() flushes from another thread: batches must not overtake
        self._sent = float("-inf")  # the last batch that carried reports or logs
        self._any = float("-inf")  # the last batch of any kind

    def run(self) -> None:
        while not self._stop_event.wait(min(TICK, self.interval)):
            self.buf.refill()
            now = time.monotonic()
            if self.buf.items or self.buf.dropped:
                if now - self._sent >= self.interval:
                    self.flush()
            elif self.sampler is not None and self.sampler.due(now) and now - self._any >= self.interval:
                self.flush(quiet=True)  # a quiet rank still sends its telemetry, at most once per interval

    def flush(self, final: bool = False, quiet: bool = False) -> None:
        """Send what the buffer holds (and a telemetry item when due). ``quiet``: a telemetry-only batch, which
        does not hold back the next report (a report after a quiet spell still goes within a tick)."""
        with self._send_lock:
            items = self.buf.drain()
            if self.sampler is not None:  # telemetry rides in the batch that goes anyway
                items = self.sampler.observe(items, force=final)
            if items:
                self._any = time.monotonic()
                if not quiet:
                    self._sent = self._any
                self.send(items)

    def stop(self) -> None:
        self._stop_event.set()
        self.flush(final=True)


def install(buf: EventBuffer, send: Callable[[list], None], interval: float, sampler=None) -> Flusher:
    """Make ``buf`` this process's report buffer, forward logging records into it, start the flusher
    (which adds ``sampler``'s telemetry items to its batches); ``buf``'s budget is paced by ``interval``."""
    global _BUFFER
    buf.pace(interval)
    _BUFFER = buf
    os.register_at_fork(after_in_child=_forget_buffer)  # once per rank process: it runs one job
    root = logging.getLogger()
    root.addHandler(_LogHandler(buf))
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    flusher = Flusher(buf, send, interval, sampler)
    flusher.start()
    return flusher
