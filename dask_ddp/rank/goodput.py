"""The rank's goodput ledger: the seconds of this rank process in each category of :mod:`dask_ddp.wire.goodput`.

Runs in: the rank process. The training thread only marks the first step and adds the seconds it measured
(a live recovery, a rolled-back step): a few attribute updates. Checkpoint saves count themselves
(:mod:`dask_ddp.checkpoint.stalls`). The flusher thread's
telemetry sampler (:mod:`dask_ddp.rank.telemetry`) asks :meth:`Ledger.split` once a second and ships the
answer as the telemetry item's ``"goodput"``. Input wait is the telemetry's own counter, so the two never
disagree.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from dask_ddp.checkpoint import stalls

__all__ = ["Ledger", "LEDGER", "began", "add", "counting"]


class Ledger:
    """Seconds since the rank's task started, by category; :meth:`reset` at each task's start."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, input_wait: float = 0.0) -> None:
        """Start counting now (the rank's task started); ``input_wait``: the input-wait counter's value now."""
        self.started = time.perf_counter()
        self.since = time.time()  # the same moment on the wall clock, for the client's accounting
        self.first: float | None = None  # perf_counter() when the first step began
        self.input_base, self.saves_base = input_wait, stalls.total()
        self.seconds = {"recovery": 0.0, "redone": 0.0}

    def began(self, at: float | None = None) -> None:
        """The first step begins (at ``at``, a ``perf_counter()`` value; default now): start-up ends. Later calls
        change nothing."""
        if self.first is None:
            self.first = time.perf_counter() if at is None else at

    def add(self, category: str, seconds: float) -> None:
        """Count ``seconds`` (>= 0) as ``category``: ``"recovery"`` or ``"redone"``. Raises KeyError for another
        category."""
        self.seconds[category] += max(0.0, float(seconds))

    def split(self, input_wait: float, now: float | None = None) -> dict[str, float]:
        """The ledger as ``{category: seconds}`` up to ``now`` (default: now); ``input_wait``: the input-wait
        counter's value now. The categories add up to the time since :meth:`reset`: productive is what the
        others leave of the time since the first step (never below 0)."""
        now = time.perf_counter() if now is None else now
        first = now if self.first is None else min(self.first, now)
        after = now - first
        data = min(after, max(0.0, input_wait - self.input_base))
        spent = {k: min(v, after) for k, v in self.seconds.items()}
        spent["checkpoint"] = min(after, max(0.0, stalls.total() - self.saves_base))
        productive = max(0.0, after - data - sum(spent.values()))
        return {"productive": productive, "startup": first - self.started, "data": data, **spent}


LEDGER = Ledger()


def began(at: float | None = None) -> None:
    """Mark the first step's start on this process's ledger (see :meth:`Ledger.began`); raises nothing."""
    LEDGER.began(at)


def add(category: str, seconds: float) -> None:
    """Add ``seconds`` of ``category`` to this process's ledger (see :meth:`Ledger.add`)."""
    LEDGER.add(category, seconds)


@contextlib.contextmanager
def counting(category: str) -> Iterator[None]:
    """Add the time the block takes to ``category`` of this process's ledger (see :func:`add`), once it has
    completed (a block that raises ends the rank's work: nothing is added)."""
    started = time.perf_counter()
    yield
    LEDGER.add(category, time.perf_counter() - started)
