"""A job's callbacks (``run(..., callbacks=[...])``): called by hook name, never able to change the outcome.

Runs in: the client, in the job's watcher thread (the controller calls them).

A callback is an object with one or more of the methods in :data:`HOOKS`, or a
plain callable (it gets every metric and log item, as ``on_metrics`` and
``on_log`` would).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Callbacks", "HOOKS"]

logger = logging.getLogger("dask_ddp")

HOOKS = ("on_start", "on_metrics", "on_log", "on_telemetry", "on_straggler", "on_failure", "on_restart", "on_finish")


class Callbacks:
    """The job's callbacks; a broken one is logged, disabled for the job, and never changes its outcome."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)
        self._broken: set[int] = set()

    def __call__(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            if id(cb) in self._broken:
                continue
            plain = callable(cb) and not any(hasattr(cb, h) for h in HOOKS)
            fn = (cb if hook in ("on_metrics", "on_log") else None) if plain else getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a broken callback never changes the training outcome
                self._broken.add(id(cb))
                logger.exception("dask-ddp callback %r failed in %s; it is disabled for this job", cb, hook)
