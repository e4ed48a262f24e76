"""Should this rank stop? The rank supervisor's one place that answers, and why.

Runs in: the Dask worker (the rank supervisor's thread, and its output pumps).

A rank stops when its job's abort flag (a Dask ``Event`` on the scheduler) is
set, when its worker stops it (:meth:`StopRule.stop`: the worker closes), or
when nobody wants its task any more (its client released it: closed,
disconnected or died). While a preemption notice's deadline has not passed, the
job's abort waits: the ranks are saving. Two things win over a notice: the
job's ``cancel()`` (its own flag, set with the abort flag) and a client that
went away. The flags live on the scheduler, so they are read at most once per
``poll_interval``; an unreachable scheduler counts as set (a lone rank cannot
finish a job).
"""

from __future__ import annotations

import time
from typing import Callable

from dask_ddp.wire.notices import Notice

__all__ = ["StopRule", "STOPPED", "ORPHANED"]

STOPPED = "stopped because another rank failed or the job was cancelled"
ORPHANED = ("stopped because the job's client went away (closed, disconnected or died): a job lives as long as "
            "the client that started it; run(..., detach=True) keeps it running without one")


class StopRule:
    """Whether one rank should stop now, and the reason it stopped (:attr:`reason`; None: not told to).

    ``abort``: the attempt's abort flag (``is_set()``, ``set()``); ``cancel``: the flag ``cancel()`` sets too
    (``is_set()``); ``orphaned()``: whether the rank's task is unwanted; ``notice()``: the preemption notice the
    rank saves for, or None; ``alone``: an orphaned rank stops alone, without the attempt's abort (a live job's
    rank: the controller cancels the task of a rank it went on without, and that rank's worker, back from a cut,
    must not stop the group that left it behind).
    """

    def __init__(self, abort, cancel, poll_interval: float, orphaned: Callable[[], bool],
                 notice: Callable[[], Notice | None], clock: Callable[[], float] = time.monotonic,
                 alone: bool = False):
        self.abort, self.cancel, self.poll_interval, self.alone = abort, cancel, poll_interval, alone
        self._orphaned, self._notice, self._clock = orphaned, notice, clock
        self.reason: str | None = None
        self.abort_seen = False
        self._last_check = float("-inf")

    def stop(self, reason: str) -> None:
        """Stop for ``reason`` (from any thread): :meth:`aborted` answers True from now on."""
        self.reason = reason

    def aborted(self) -> bool:
        """Whether the rank should stop now (reads the scheduler's flag at most once per ``poll_interval``)."""
        if self.reason is not None:
            return True
        now = self._clock()
        if now - self._last_check < self.poll_interval:
            return False
        self._last_check = now
        if self._orphaned():
            self.reason = ORPHANED
            if not self.alone:
                self.set_abort()
            return True
        notice = self._notice()
        if notice is not None and time.time() < notice.deadline + 1:
            # the ranks save for a preemption: the job's abort (its worker left) waits for them; cancel() does not
            self.abort_seen = self.flag(self.cancel)
        else:
            self.abort_seen = self.flag()
        return self.abort_seen

    def stopping_within(self, wait: float) -> bool:
        """Whether the job is being stopped (its abort flag is set, or :meth:`stop` was called), waiting up to
        ``wait`` s for it. Asks the flag itself: a rank that has returned no longer watches it."""
        deadline = self._clock() + wait
        while not (self.abort_seen or self.reason is not None or self.flag()):
            if self._clock() > deadline:
                return False
            time.sleep(0.1)
        return True

    def flag(self, which=None) -> bool:
        """The job's abort flag (or ``which``); an unreachable scheduler counts as set."""
        try:
            return bool((self.abort if which is None else which).is_set())
        except Exception:  # noqa: BLE001 - scheduler unreachable
            return True

    def set_abort(self) -> None:
        """Set the job's abort flag, so every rank stops (best effort: the client's controller decides then)."""
        try:
            self.abort.set()
        except Exception:  # noqa: BLE001 - the scheduler is gone
            pass
