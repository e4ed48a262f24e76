"""The scheduler's registry of detached drivers: detached jobs' (:mod:`.detach`) and detached sweeps'
(:mod:`dask_ddp.sweeps.detach`) alike.

Runs in: the scheduler's process (a driver's own thread, and the functions a client calls there through
``client.run_on_scheduler``); a unit test anywhere (it imports nothing of dask_ddp).

A :class:`DriverRegistry` holds drivers by key (a job's run id, a sweep's name) under one lock, and of those that
have ended keeps the last ``ddp.detached.keep`` for a client to attach to: each end past that forgets the oldest
ended one. Its lock is public on purpose: it also guards what a driver's thread and the clients' calls share of one
driver (its handle once started, a cancel or stop asked before that), so that they read or change it together.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Callable, Generic, Iterator, TypeVar

import dask

__all__ = ["DriverRegistry"]

D = TypeVar("D")


class DriverRegistry(Generic[D]):
    """Drivers by key in the scheduler's process, the last ``ddp.detached.keep`` ended ones kept.

    ``forgettable(driver)`` says whether an ended key's driver may go when its turn comes (a sweep's name can be
    taken again by a new sweep while the old one waits its turn: that new one stays); None: always.
    ``drivers`` and ``ended`` are read and changed only under ``lock``.
    """

    def __init__(self, forgettable: Callable[[D], bool] | None = None) -> None:
        self.lock = threading.Lock()
        self.drivers: dict[str, D] = {}  # key -> its driver
        self.ended: deque[str] = deque()  # the keys of ended drivers, oldest first
        self._forgettable = forgettable

    def add(self, key: str, driver: D) -> D:
        """Hold ``driver`` under ``key`` (in place of any driver held there); return it. Raises nothing."""
        with self.lock:
            self.drivers[key] = driver
        return driver

    def get(self, key: str) -> D | None:
        """The driver held under ``key``, or None. Raises nothing."""
        with self.lock:
            return self.drivers.get(key)

    def values(self) -> list[D]:
        """Every driver held now, running or ended, in the order they were added. Raises nothing."""
        with self.lock:
            return list(self.drivers.values())

    @contextlib.contextmanager
    def ending(self, key: str) -> Iterator[None]:
        """Under the lock: the caller's body (what it keeps of its ended driver), then ``key`` counts as ended and
        the oldest ended drivers past ``ddp.detached.keep`` are forgotten. Raises what the body raises (and then
        ``key`` does not count as ended)."""
        with self.lock:
            yield
            self.ended.append(key)
            keep = dask.config.get("ddp.detached.keep")
            while len(self.ended) > keep:
                old = self.ended.popleft()
                driver = self.drivers.get(old)
                if driver is not None and (self._forgettable is None or self._forgettable(driver)):
                    del self.drivers[old]

    def end(self, key: str) -> None:
        """``key``'s driver has ended: count it, and forget the oldest ended ones past ``ddp.detached.keep``.
        Raises nothing."""
        with self.ending(key):
            pass
