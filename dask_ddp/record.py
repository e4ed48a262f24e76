"""What the notebook knows of a job: its state and history, its events and metrics, its end.

Runs in: the client. The controller writes a :class:`JobRecord` (from the
watcher thread); the :class:`~dask_ddp.job.Job` handle reads it (from the
user's thread). One condition variable guards it and wakes the readers.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["JobRecord", "format_log", "STATES"]

logger = logging.getLogger("dask_ddp")

#: A job's states; every transition is logged with its cause and kept in ``history``.
STATES = ("PENDING", "RUNNING", "RESTARTING", "FINISHED", "FAILED", "CANCELLED")


def format_log(item: dict) -> str:
    """``[rank N] line``; after a restart ``[rank N, attempt K] line`` (K counts from 1, as in ``job.history``)."""
    attempt = item.get("attempt", 0)
    where = f"rank {item['rank']}, attempt {attempt + 1}" if attempt else f"rank {item['rank']}"
    return f"[{where}] {item['line']}"


class JobRecord:
    """A job's state, history, events and outcome; thread-safe (``cond`` guards everything)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.cond = threading.Condition()
        self.state = "PENDING"
        self.history: list[tuple[float, str, str, str]] = []  # (time, old, new, cause)
        self.events: list[dict] = []  # metrics and log records, in arrival order
        self.metric_rows: list[dict] = []
        self.error: BaseException | None = None
        self.values: list | None = None
        self.settled = False  # True once the end state is set and on_finish callbacks have run

    def add(self, items: list[dict]) -> None:
        """Keep a delivered batch's items and wake the readers (once per batch: they redraw on each wake)."""
        with self.cond:
            for item in items:
                self.events.append(item)
                if item.get("kind") == "metric":
                    self.metric_rows.append(item)
            self.cond.notify_all()

    def transition(self, new: str, cause: str) -> None:
        """Move to state ``new``, keep it in ``history`` and log it with its cause."""
        with self.cond:
            old, self.state = self.state, new
            self.history.append((time.time(), old, new, cause))
            self.cond.notify_all()
        logger.info("job %s: %s -> %s (%s)", self.run_id, old, new, cause)

    def settle(self) -> None:
        """The end state is set and its callbacks have run: wake ``result()``."""
        with self.cond:
            self.settled = True
            self.cond.notify_all()
