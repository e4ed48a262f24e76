"""The event batch format between ranks and the notebook, and what may travel in it.

Runs in: every process that makes or reads an event: the rank (``report()``, its log
handler), the Dask worker (the relay and the per-host hub) and the client (the job's feed).

One rank batch is ``{"run", "rank", "attempt", "seq", "items"}``; a host's hub publishes
several as ``{"run", "batches": [batch, ...]}`` (:func:`unpack` reads both). ``items`` are
flat dicts of plain values. Dask's wire is msgpack: ints in [:data:`INT_MIN`,
:data:`INT_MAX`] and text that encodes as UTF-8. Dask's ``log_event`` checks neither, and a
value outside breaks the worker's batched stream, so the scheduler drops the worker.
Nothing leaves a rank unchecked: numbers are refused at ``report()``, text is escaped
(:func:`safe_text`, :func:`clip_line`), and a batch that still would not encode is escaped
whole (:func:`escaped`) as the last guard.
"""

from __future__ import annotations

import msgpack

__all__ = ["RESERVED_KEYS", "INT_MIN", "INT_MAX", "MAX_LINE", "safe_text", "clip_line", "wire_safe", "escaped",
           "unpack", "chunked", "item_size", "batch_size"]

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
    """About how many bytes one event item takes (what ``ddp.events.max-batch-bytes`` bounds)."""
    return 16 + sum(len(k) + (len(v) if isinstance(v, str) else 8) for k, v in item.items())


def batch_size(batch: dict) -> int:
    """About how many bytes one rank batch takes: its items and a little for its header."""
    return 32 + sum(item_size(item) for item in batch.get("items") or [])
