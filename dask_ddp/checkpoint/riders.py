"""What else rides in every checkpoint: state that is not the user's, saved and restored with theirs.

Runs in: any process that saves or loads checkpoints (the rank process, mostly).

A rider (today the streaming loaders' positions, :mod:`dask_ddp.data.streaming.state`) registers a reserved
key (``__dask_ddp_<name>__``), a function that gives what to save under it and one that takes it back.
``save_checkpoint`` and ``save_sharded`` (and so preemption saves) add what the riders give
(:func:`with_riders`); ``load_checkpoint`` and ``load_sharded`` take every reserved key out of the loaded state
and hand it to its rider (:func:`take`). A value loaded before its rider registered (its module not imported
yet in this process) is held and handed over when it registers. So the checkpoints never import what rides on
them, and the user saves nothing by hand.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

__all__ = ["register", "with_riders", "take", "reserved_keys"]

_RESERVED = re.compile(r"^__dask_ddp_\w+__$")


class Rider(NamedTuple):
    """A registered rider: ``snapshot()`` gives what to save (empty or None: nothing), ``restore(value)``
    takes a loaded value back."""

    snapshot: Callable[[], Any]
    restore: Callable[[Any], None]


_RIDERS: dict[str, Rider] = {}
_HELD: dict[str, Any] = {}  # key -> a value loaded before its rider registered


def register(key: str, snapshot: Callable[[], Any], restore: Callable[[Any], None]) -> None:
    """Make ``key`` ride in every save of this process; hand it a value loaded earlier, if any.

    Raises ValueError for a key not of the reserved form ``__dask_ddp_<name>__`` (a user's own key must never
    be taken out of their state).
    """
    if not isinstance(key, str) or not _RESERVED.match(key):
        raise ValueError(f"a checkpoint rider's key must look like '__dask_ddp_<name>__', got {key!r}")
    _RIDERS[key] = Rider(snapshot, restore)
    if key in _HELD:
        restore(_HELD.pop(key))


def with_riders(state: Any) -> Any:
    """``state`` with what each rider gives added under its key (``state`` itself when none gives anything, when
    it is not a dict, or for a key the state already has). Raises what a rider's ``snapshot`` raises."""
    if not isinstance(state, dict):
        return state
    extra = {}
    for key, rider in list(_RIDERS.items()):
        if key not in state:
            value = rider.snapshot()
            if value:
                extra[key] = value
    return {**state, **extra} if extra else state


def take(state: Any) -> Any:
    """Remove every reserved key from a loaded state dict (in place), hand each value to its rider or hold it
    until the rider registers; return ``state``. Raises what a rider's ``restore`` raises."""
    if isinstance(state, dict):
        for key in reserved_keys(state):
            value = state.pop(key)
            rider = _RIDERS.get(key)
            if rider is not None:
                rider.restore(value)
            else:
                _HELD[key] = value
    return state


def reserved_keys(keys: Any) -> list[str]:
    """The reserved (rider) keys among ``keys`` (any iterable of top-level keys). Raises nothing."""
    return [k for k in keys if isinstance(k, str) and _RESERVED.match(k)]

