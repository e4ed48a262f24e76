"""Seconds the training thread of this process spent saving checkpoints: the rank's goodput reads them.

Runs in: the rank process (any process that saves). ``save_checkpoint`` adds the time of its call,
``save_sharded`` its stall (an async save's upload runs behind the training and is not counted); the rank's
goodput ledger (:mod:`dask_ddp.rank.goodput`) reads :func:`total`. A running total, never reset: a reader
takes differences.
"""

from __future__ import annotations

import threading

__all__ = ["count", "total"]

_LOCK = threading.Lock()
_TOTAL = [0.0]


def count(seconds: float) -> None:
    """Add ``seconds`` (negative counts as 0) of a save that held the training thread; raises nothing."""
    with _LOCK:
        _TOTAL[0] += max(0.0, float(seconds))


def total() -> float:
    """The seconds counted so far in this process."""
    return _TOTAL[0]
