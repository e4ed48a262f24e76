"""The event batch format between ranks and the notebook, and what may travel in it.

Runs in: every process that makes or reads an event: the rank (``report()``, its log
handler), the Dask worker (the relay and the per-host hub) and the client (the job's feed).

One rank batch is ``{"run", "rank", "attempt", "seq", "items"}`` (and ``"joined"``, the ``RankTask.joined``
of a live job's replacement: its ``seq`` counts from 0 again); a host's hub publishes
several as ``{"run", "batches": [batch, ...]}`` (:func:`unpack` reads both). ``items`` are
flat dicts of plain values, packed by the worker into one msgpack ``bytes`` (:func:`pack_items`,
read back with :func:`items_of`): the scheduler keeps the last 1,000 events of a topic, and as
bytes they cost it their size, not the ~4x a tree of Python objects costs, and free at once.

What one rank may send is bounded (:class:`EventLimits`, the ``ddp.events.max-*`` settings): a
report with too many keys, a key too long or too many bytes is dropped. A rank's bytes are paced by
a token bucket (:class:`Budget`): ``report()`` waits for room rather than drop (and says so with an
item of kind ``"throttled"``, :func:`throttled_item`); what passes the worker's own budget is dropped.
Nothing is dropped silently: the count travels as an item of kind ``"dropped"`` (:func:`dropped_item`)
to ``job.dropped``, ``job.history`` and the dashboard.

Dask's wire is msgpack: ints in [:data:`INT_MIN`, :data:`INT_MAX`] and text that encodes as
UTF-8. Dask's ``log_event`` checks neither, and a value outside breaks the worker's batched stream, so the
scheduler drops the worker.
Nothing leaves a rank unchecked: numbers are refused at ``report()``, text is escaped
(:func:`safe_text`, :func:`clip_line`), and a batch that still would not encode is escaped
whole (:func:`escaped`) as the last guard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack

__all__ = ["RESERVED_KEYS", "INT_MIN", "INT_MAX", "MAX_LINE", "safe_text", "clip_line", "wire_safe", "escaped",
           "unpack", "chunked", "item_size", "flat_size", "batch_size", "pack_items", "items_of", "EventLimits",
           "Budget", "DROP_REASONS", "dropped_item", "throttled_item", "preloaded_item"]

#: Keys every event carries; a metric may not use them.
RESERVED_KEYS = frozenset({"kind", "rank", "attempt", "time", "step", "worker", "stream", "line", "level"})

INT_MIN, INT_MAX = -(2**63), 2**64 - 1
MAX_LINE = 10_000  # characters of one output line or log record kept; longer ones are cut with a marker


def safe_text(text: str) -> str:
    """``text`` as valid UTF-8: lone surrogates (``os.listdir``'s non-UTF-8 names) become ``\\udcXX`` escapes."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def clip_line(line: str) -> str:
    """One output line or log record, escaped and cut to ``MAX_LINE`` characters with a marker."""
    if len(line) > MAX_LINE:
        line = line[:MAX_LINE] + f" ... [{len(line) - MAX_LINE} characters cut]"
    return safe_text(line)


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


def unpack(msg) -> list:
    """The rank batches in one event of a job's topic: a hub's ``{"batches": [...]}``, or one rank's batch."""
    if isinstance(msg, dict) and isinstance(msg.get("batches"), (list, tuple)):  # Dask's msgpack gives tuples
        return list(msg["batches"])
    return [msg]


def chunked(things: list, size_of, limit: int):
    """``things`` in order, in runs of at most ``limit`` bytes by ``size_of`` (a larger thing goes alone)."""
    group: list = []
    size = 0
    for thing in things:
        n = size_of(thing)
        if group and size + n > limit:
            yield group
            group, size = [], 0
        group.append(thing)
        size += n
    if group:
        yield group


def item_size(item: dict) -> int:
    """About how many bytes one event item takes packed (at least its msgpack size for plain values: what
    ``ddp.events.max-batch-bytes`` and the per-interval budget count)."""
    return 16 + sum(_text_size(k) + 2 + (_text_size(v) + 5 if isinstance(v, str) else 9) for k, v in item.items())


def flat_size(item) -> int | None:
    """:func:`item_size` of ``item`` if it is a flat dict of text keys and plain values (``str``, ``int``,
    ``float``, ``bool``, ``None``: what every item dask-ddp makes is), else None. The worker's check: a value
    of any other type (a list, a dict, bytes) would travel at a size :func:`item_size` does not count."""
    if type(item) is not dict:
        return None
    size = 16
    for key, value in item.items():
        if type(key) is not str:
            return None
        if type(value) is str:
            size += _text_size(key) + _text_size(value) + 7
        elif value is None or type(value) in _NUMBERS:
            size += _text_size(key) + 11
        else:
            return None
    return size


_NUMBERS = (int, float, bool)


def _text_size(text: str) -> int:
    """At least the UTF-8 size of ``text`` (4 bytes a character unless it is ASCII)."""
    return len(text) if text.isascii() else 4 * len(text)


def batch_size(batch: dict) -> int:
    """About how many bytes one rank batch takes: its items (packed: their exact size) and its header."""
    items = batch.get("items")
    if isinstance(items, bytes):
        return 64 + len(items)
    return 64 + sum(item_size(item) for item in items or [])


def pack_items(items: list[dict]) -> bytes:
    """``items`` as one msgpack ``bytes`` (escaped first if msgpack refuses them as they are: see :func:`escaped`)."""
    try:
        return msgpack.packb(items, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):  # the last guard; UnicodeEncodeError is a ValueError
        return msgpack.packb(escaped(items), use_bin_type=True)


def items_of(batch: dict) -> list[dict]:
    """The items of one rank batch, unpacked when the worker packed them (:func:`pack_items`); those that are
    no dicts are left out (a batch that does not unpack gives ``[]``: events are never a reason to fail)."""
    items = batch.get("items") if isinstance(batch, dict) else None
    if isinstance(items, (bytes, bytearray, memoryview)):
        try:
            items = msgpack.unpackb(items, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001 - corrupt bytes: nothing to show
            return []
    if not isinstance(items, (list, tuple)):
        return []
    return [item for item in items if isinstance(item, dict)]


#: Why a report or line was dropped: the reason's key in a ``"dropped"`` item, and the setting that decides.
DROP_REASONS = {
    "rate": "more than {interval_bytes} bytes in one flush interval (ddp.events.max-bytes-per-interval)",
    "size": "a report of more than {report_bytes} bytes (ddp.events.max-report-bytes)",
    "keys": "a report of more than {report_keys} keys (ddp.events.max-report-keys)",
    "key-length": "a metric name longer than {key_length} characters (ddp.events.max-key-length)",
    "count": "more than {control_items} small items (telemetry, counts) in one flush interval",
    "shape": "an item that is not a flat dict of plain values (text, numbers, booleans, None)",
}


@dataclass(frozen=True)
class EventLimits:
    """What one rank may send to the notebook: the ``ddp.events.max-*`` settings, read on the client.

    A report over ``report_keys`` keys, with a name over ``key_length`` characters or over ``report_bytes``
    bytes (:func:`item_size`) is dropped whole. A rank's bytes are paced (:class:`Budget`): up to
    :attr:`burst_bytes` at once, then ``interval_bytes`` a flush interval; ``report()`` waits for room, a log
    record past it is dropped. The rank's worker checks again, with twice the rank's budget for what the
    rank sends and a budget of ``interval_bytes`` a flush interval for its output lines. One rank batch is at
    most ``batch_bytes``. The scheduler holds the last 1,000 events of a job's topic: at most about
    ``1000 * batch_bytes`` a job.
    """

    batch_bytes: int = 65536
    interval_bytes: int = 262144
    report_bytes: int = 16384
    report_keys: int = 256
    key_length: int = 256
    control_items: int = 32  # telemetry items, drop counts and waits one rank may send per flush interval
    control_bytes: int = 2048  # one such item

    @property
    def burst_bytes(self) -> int:
        """What a rank may send at once, before its budget paces it: four flush intervals' worth."""
        return 4 * self.interval_bytes

    def why(self, reason: str) -> str:
        """The text of a drop reason, with this limit's value (a reason it does not know, as it is: a rank's code
        could send any text)."""
        text = DROP_REASONS.get(reason)
        return str(reason) if text is None else text.format(**self.__dict__)

    def report_fault(self, values: dict, size: int) -> str | None:
        """Why a report of ``values`` (``size`` bytes by :func:`item_size`) is dropped whole, or None."""
        if len(values) > self.report_keys:
            return "keys"
        if values and max(map(len, values)) > self.key_length:
            return "key-length"
        if size > self.report_bytes:
            return "size"
        return None


class Budget:
    """A token bucket of bytes: up to ``burst`` at once, refilled at ``rate`` bytes a second (``inf``: no bound).

    Two counters that only grow, ``used`` (bytes taken) and ``granted`` (bytes that may be taken so far), so
    that the fast path of a caller in a hurry (``report()``) is one comparison, ``used + size <= granted``,
    and one addition, without a call or a clock. :meth:`take` and :meth:`reserve` refill first. A refill
    credits the time since the last one but never more than ``burst`` past what was used at the last one:
    bytes taken on the fast path meanwhile may have been taken from a full bucket, so over any window of
    ``t`` seconds at most ``burst + rate * t`` bytes pass, whoever refills when; whoever takes on the fast
    path refills often (the rank's flusher, every tick) so that the bucket is not left short. Not locked: the
    rank serialises its slow path, the worker calls it under the relay's lock; an addition lost to a race on
    the fast path lets a few bytes more through, which the worker's twice-as-large burst absorbs.
    """

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.used, self.granted = 0, burst
        self._refilled, self._used_then = clock(), 0  # the last refill: when, and what was used by then

    @classmethod
    def per_interval(cls, per_interval: int, interval: float, burst: float, clock=time.monotonic) -> "Budget":
        """``per_interval`` bytes every ``interval`` seconds, ``burst`` at once (an interval of 0: no bound)."""
        return cls(per_interval / interval if interval > 0 else float("inf"), burst, clock)

    def refill(self) -> None:
        """Add what the time since the last refill earned, up to ``burst`` past what was used by then."""
        now = self.clock()
        if self.rate == float("inf"):  # no bound: a burst past what is used now
            self.granted = max(self.granted, self.used + self.burst)
        else:
            self.granted = min(self._used_then + self.burst, self.granted + (now - self._refilled) * self.rate)
        self._refilled, self._used_then = now, self.used

    def take(self, size: int) -> bool:
        """Take ``size`` bytes if the bucket holds them now (refilled first); False (nothing taken) if not."""
        self.refill()
        if self.used + size > self.granted:
            return False
        self.used += size
        return True

    def reserve(self, size: int) -> float:
        """Take ``size`` bytes, in debt if need be; the seconds until the bucket will have earned them (0 when it
        held them): the caller waits that long before it sends, and the next caller's debt comes after it."""
        self.refill()
        self.used += size
        debt = self.used - self.granted
        return debt / self.rate if debt > 0 else 0.0


def dropped_item(rank: int, attempt: int, what: str, reason: str, count: int) -> dict:
    """The item that tells the client ``count`` reports (``what="report"``) or output lines (``"line"``) of
    ``rank`` were dropped for ``reason`` (a key of :data:`DROP_REASONS`)."""
    return {"kind": "dropped", "rank": rank, "attempt": attempt, "time": time.time(), "what": what,
            "reason": reason, "count": int(count)}


def preloaded_item(rank: int, attempt: int, modules: list[str], failed: dict[str, str]) -> dict:
    """The item that tells the client which modules of ``ddp.zygote-preload`` ``rank``'s warm process imported
    before the job (``modules``), and which failed to import and why (``failed``)."""
    return {"kind": "preloaded", "rank": rank, "attempt": attempt, "time": time.time(),  # flat, as every item
            "modules": ", ".join(map(str, modules)), "failed": "; ".join(f"{k} ({v})" for k, v in failed.items())}


def throttled_item(rank: int, attempt: int, seconds: float, calls: int) -> dict:
    """The item that tells the client ``calls`` reports of ``rank`` waited ``seconds`` in all for room in the
    rank's budget (none was dropped: :class:`Budget`)."""
    return {"kind": "throttled", "rank": rank, "attempt": attempt, "time": time.time(), "seconds": float(seconds),
            "calls": int(calls)}
