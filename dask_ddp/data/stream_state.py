"""Streaming positions carried by dask-ddp's checkpoints: the live loaders of this process, saved and restored.

Runs in: the rank process (and any process that saves or loads checkpoints).

Every :class:`~dask_ddp.data.stream_loader.StreamingLoader` registers here (weakly). ``save_checkpoint`` and
``save_sharded`` (and so preemption saves) add the positions of the live loaders to what they save under
the reserved key :data:`KEY`; ``load_checkpoint`` and ``load_sharded`` take it out again and restore it into
the loader of the same name, or hold it until that loader is made. The user saves nothing by hand.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["KEY", "register", "snapshot", "with_streams", "restore", "take", "pending"]

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


def with_streams(state: dict) -> dict:
    """``state`` with the live loaders' positions added under :data:`KEY` (``state`` itself when none)."""
    found = snapshot()
    return {**state, KEY: found} if found and isinstance(state, dict) and KEY not in state else state


def restore(saved: dict | None) -> None:
    """Give each live loader its saved position; hold the others until their loader is made."""
    for name, state in (saved or {}).items():
        loader = _LIVE.get(name)
        if loader is not None:
            loader.load_state_dict(state)
        else:
            _PENDING[name] = state


def take(state: Any) -> Any:
    """Remove :data:`KEY` from a loaded state dict (in place) and :func:`restore` it; return ``state``."""
    if isinstance(state, dict) and KEY in state:
        restore(state.pop(KEY))
    return state


def pending() -> dict[str, dict]:
    """The positions loaded and not yet claimed by a loader (a copy). Raises nothing."""
    return dict(_PENDING)


def add_slot(state: dict, metadata: Any) -> bool:
    """Before a sharded load: add :data:`KEY` to ``state`` when the checkpoint (its DCP metadata) has it."""
    tops = {str((metadata.planner_data or {}).get(k, (k,))[0]) for k in metadata.state_dict_metadata}
    if KEY in tops and KEY not in state:
        state[KEY] = {}
        return True
    return False
