"""Streaming positions carried by dask-ddp's checkpoints: the live loaders of this process, saved and restored.

Runs in: the rank process (and any process that saves or loads checkpoints).

Every :class:`~.loader.StreamingLoader` registers here (weakly), and this module
rides in every checkpoint under the reserved key :data:`KEY` (:mod:`dask_ddp.checkpoint.riders`):
``save_checkpoint`` and ``save_sharded`` (and so preemption saves) add the positions of the live loaders;
``load_checkpoint`` and ``load_sharded`` hand them back, restored into the loader of the same name, or held
until that loader is made. The user saves nothing by hand.
"""

from __future__ import annotations

import weakref
from typing import Any

from dask_ddp.checkpoint import riders

__all__ = ["KEY", "register", "snapshot", "restore", "pending"]

KEY = "__dask_ddp_streams__"
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # name -> StreamingLoader
_PENDING: dict[str, dict] = {}  # name -> a state loaded before its loader was made


def register(loader: Any) -> None:
    """Track ``loader`` (by its ``name``); give it a position loaded earlier for that name, if any."""
    _LIVE[loader.name] = loader
    state = _PENDING.pop(loader.name, None)
    if state is not None:
        loader.load_state_dict(state)


def snapshot() -> dict[str, dict]:
    """``{name: state_dict}`` of the live loaders (plain values); empty when there are none. Raises nothing."""
    return {name: loader.state_dict() for name, loader in list(_LIVE.items())}


def restore(saved: dict | None) -> None:
    """Give each live loader its saved position; hold the others until their loader is made."""
    for name, state in (saved or {}).items():
        loader = _LIVE.get(name)
        if loader is not None:
            loader.load_state_dict(state)
        else:
            _PENDING[name] = state


def pending() -> dict[str, dict]:
    """The positions loaded and not yet claimed by a loader (a copy). Raises nothing."""
    return dict(_PENDING)


riders.register(KEY, snapshot, restore)  # the checkpoints call back; they never import streaming
