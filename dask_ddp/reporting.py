"""``report()``: metrics from a rank to the notebook, batched, never blocking.

Inside a rank, :func:`report` validates and converts the values, stamps them
with rank, attempt, step and time, and appends them to an in-memory buffer.
A background thread of the rank process ships the buffer to its Dask task
(the supervisor) every ``ddp.events.flush-interval``; the supervisor publishes
one Dask event per batch. The training thread never waits on the network.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from typing import Any, Callable

from .context import get_context
from .errors import NotInRankError

__all__ = ["report", "RESERVED_KEYS"]

#: Keys every event carries; a metric may not use them.
RESERVED_KEYS = frozenset({"kind", "rank", "attempt", "time", "step", "worker", "stream", "line", "level"})

_BUFFER: "EventBuffer | None" = None  # set by the rank process
_FORKED = False  # True in a process forked from a rank (a DataLoader worker): it has no flusher, so no _BUFFER


def _plain(key: str, value: Any) -> float | int | bool:
    """Convert a Python/NumPy number or a one-element tensor/array to a plain Python number."""
    if not isinstance(value, (bool, int, float)) and callable(getattr(value, "item", None)):
        size = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
        if size == 1:
            value = value.item()
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = float(value)
    if isinstance(value, (bool, int, float)):
        return value
    raise TypeError(f"report({key}=...): a metric must be a number (Python, NumPy scalar or one-element tensor); "
                    f"got {type(value).__name__}. Log text with print() or logging instead.")


class EventBuffer:
    """Thread-safe list of events, drained by the rank process's flusher thread."""

    def __init__(self, rank: int, attempt: int):
        self.rank, self.attempt = rank, attempt
        self._items: list[dict] = []
        self._lock = threading.Lock()
        self._step = -1

    def add(self, item: dict) -> None:
        with self._lock:
            self._items.append(item)

    def next_step(self, step: int | None) -> int:
        with self._lock:
            self._step = self._step + 1 if step is None else int(step)
            return self._step

    def drain(self) -> list[dict]:
        with self._lock:
            items, self._items = self._items, []
        return items


def report(metrics: dict | None = None, /, *, step: int | None = None, **values: Any) -> None:
    """Send metrics from this rank to the client: ``dask_ddp.report(loss=0.3, epoch=1)``.

    Values may be Python numbers, NumPy scalars or one-element tensors (a CUDA
    tensor's ``.item()`` waits for the GPU, as anywhere). ``step`` defaults to
    a per-rank counter of calls (0, 1, 2, ...). The call only appends to a
    buffer (a few microseconds); a background thread ships the buffer about
    ten times a second, so every report reaches ``job.metrics``, in order.

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    TypeError
        When a key is not a string or a value is not a number (names the key).
    ValueError
        When a key is one of the reserved names (``rank``, ``step``, ``time``, ...).
    """
    buf = _BUFFER
    if buf is None:
        where = ("in a process with no channel to the client (a DataLoader worker?): call it from the rank's main "
                 "process, e.g. once per batch in the training loop" if _FORKED or _in_rank() else
                 "outside a dask-ddp rank: call it inside the function you pass to dask_ddp.dispatch.run(client, "
                 "fn, ...)")
        raise NotInRankError(f"report() was called {where}")
    items = dict(metrics or {}, **values)
    event: dict[str, Any] = {}
    for key, value in items.items():
        if not isinstance(key, str):
            raise TypeError(f"report(): metric names must be strings, got {key!r} ({type(key).__name__})")
        if key in RESERVED_KEYS:
            raise ValueError(f"report(): {key!r} is a reserved name ({', '.join(sorted(RESERVED_KEYS))}); "
                             "rename the metric")
        event[key] = _plain(key, value)
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
        raise TypeError(f"report(step=...) takes an int, got {type(step).__name__}")
    event.update(kind="metric", rank=buf.rank, attempt=buf.attempt, step=buf.next_step(step), time=time.time())
    buf.add(event)


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


class _LogHandler(logging.Handler):
    """Forwards a rank's ``logging`` records as log events (kept with level and logger name)."""

    def __init__(self, buf: EventBuffer):
        super().__init__(level=logging.NOTSET)
        self.buf = buf
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.buf.add({"kind": "log", "rank": self.buf.rank, "attempt": self.buf.attempt, "time": record.created,
                          "stream": "logging", "level": record.levelname, "line": self.format(record)})
        except Exception:  # a broken log record must never break training
            self.handleError(record)


class Flusher(threading.Thread):
    """Ships the buffer through ``send(items)`` every ``interval`` seconds until stopped."""

    def __init__(self, buf: EventBuffer, send: Callable[[list], None], interval: float):
        super().__init__(name="dask-ddp-flusher", daemon=True)
        self.buf, self.send, self.interval = buf, send, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.flush()

    def flush(self) -> None:
        items = self.buf.drain()
        if items:
            self.send(items)

    def stop(self) -> None:
        self._stop_event.set()
        self.flush()


def install(buf: EventBuffer, send: Callable[[list], None], interval: float) -> Flusher:
    """Make ``buf`` this process's report buffer, forward logging records into it, start the flusher."""
    global _BUFFER
    _BUFFER = buf
    os.register_at_fork(after_in_child=_forget_buffer)  # once per rank process: it runs one job
    root = logging.getLogger()
    root.addHandler(_LogHandler(buf))
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    flusher = Flusher(buf, send, interval)
    flusher.start()
    return flusher
