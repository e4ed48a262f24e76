"""The non-tensor items of a sharded checkpoint: written with ``torch.save``, read only with ``weights_only=True``.

Runs in: the rank process (and one process exporting a checkpoint).

torch DCP keeps every value that is not a tensor (an optimizer's ``param_groups``,
a scheduler's counters, ``epoch``) as a small ``torch.save`` pickle, and its
default load planner reads it back with ``torch.load(weights_only=False)``:
whoever can write the checkpoint folder (a shared bucket, a checkpoint handed
over for ``dask-ddp export``) could replace an item and its CRC-32 (which lives
in ``.metadata``, also theirs to write) and run code in every rank that loads it.
Here every such item is unpickled with ``weights_only=True`` (torch's
allow-list: tensors, numbers, strings, lists, tuples, dicts, and the types
registered with ``torch.serialization.add_safe_globals``):

- :func:`load` reads one item, raising :class:`Refused` (with the reason, and
  the unsafe globals named) instead of running anything; the reader turns it
  into a ``ShardError`` naming the rank, the URL and the key;
- :func:`load_planner` is DCP's load planner with its ``load_bytes`` replaced, and
  :func:`hand_over` gives it a value the reader already read safely (a planner
  of any other kind is refused: it would unpickle unsafely);
- :func:`check_items` refuses at save time, on the rank that writes it, a value
  that ``weights_only=True`` could not read back, so that a checkpoint saved
  here always loads here.
"""

from __future__ import annotations

import functools
import io
from typing import Any

__all__ = ["Refused", "load", "load_planner", "hand_over", "check_items", "HOW_TO_ALLOW"]

HOW_TO_ALLOW = "torch.serialization.add_safe_globals([...]), in the saving process and in every loading one"


class Refused(Exception):
    """An item that ``torch.load(weights_only=True)`` refuses; ``reason`` says why, ``unsafe`` names its globals."""

    def __init__(self, reason: str, unsafe: list[str]):
        super().__init__(reason)
        self.reason, self.unsafe = reason, unsafe


def load(raw: bytes) -> Any:
    """The value of one non-tensor item, unpickled with ``torch.load(weights_only=True)``.

    Raises
    ------
    Refused
        The bytes hold objects the safe loader refuses (named), or are not a ``torch.save`` file.
    """
    import torch

    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every refusal of the safe loader is named
        unsafe = _unsafe_globals(raw)
        if unsafe:
            reason = f"holds objects that torch.load(weights_only=True) refuses to load: {', '.join(unsafe)}"
        else:
            reason = f"cannot be read by torch.load(weights_only=True): {type(exc).__name__}: {str(exc)[:300]!r}"
        raise Refused(reason, unsafe) from None


def _unsafe_globals(raw: bytes) -> list[str]:
    """The globals of a ``torch.save`` pickle the safe loader does not allow, read without running it (repr'd: the
    names come from the file)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        return [repr(name) for name in get_unsafe_globals_in_checkpoint(io.BytesIO(raw))][:8]
    except Exception:  # noqa: BLE001 - unreadable: the loader's own error is reported instead
        return []


def _set(planner, read_item, value) -> None:
    """Put ``value`` where DCP's ``DefaultLoadPlanner.load_bytes`` puts what it unpickled (torch 2.14)."""
    from torch.distributed.checkpoint._traverse import set_element

    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], value)
    else:
        planner.state_dict[read_item.dest_index.fqn] = value


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    _set(self, read_item, load(value.getvalue()))


@functools.cache
def _classes() -> tuple[type, type]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    methods = {"load_bytes": _load_bytes, "__module__": __name__,
               "__doc__": "DCP's load planner, non-tensor items unpickled with weights_only=True (see dcp_values)."}
    return (type("SafeLoadPlanner", (DefaultLoadPlanner,), dict(methods)),
            type("SafeRebuildingLoadPlanner", (_EmptyStateDictLoadPlanner,), dict(methods)))


def load_planner(*, rebuild: bool = False, keys: set[str] | None = None):
    """A DCP load planner whose non-tensor items are read with ``weights_only=True``.

    ``rebuild=False``: DCP's ``DefaultLoadPlanner`` (loads into the given state dict); ``rebuild=True``: the
    planner of ``dcp_to_torch_save``, which rebuilds the state (the entries ``keys``, or all) from the metadata.
    Raises nothing.
    """
    plain, rebuilding = _classes()
    return rebuilding(keys=keys) if rebuild else plain()


def hand_over(planner, read_item, value) -> None:
    """Give ``planner`` a non-tensor ``value`` that :func:`load` read.

    Raises
    ------
    TypeError
        ``planner`` is not one of :func:`load_planner`'s (torch's own would unpickle with weights_only=False).
    """
    if not isinstance(planner, _classes()):
        raise TypeError("a dask-ddp sharded checkpoint is read with the planners of "
                        "dask_ddp.checkpoint.sharded.values.load_planner(), got "
                        f"{type(planner).__name__}: torch's default planner unpickles non-tensor items with "
                        "weights_only=False, which can run code")
    _set(planner, read_item, value)


def check_items(planner, items: list, rank: int) -> None:
    """Raise TypeError unless each non-tensor item of ``items`` reads back with ``weights_only=True``.

    Raises
    ------
    TypeError
        Names the key, the refused types and what to do; raised by the rank that writes the item, DCP hands it
        to every rank (nothing is committed).
    """
    from torch.distributed.checkpoint.planner import WriteItemType

    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            continue
        try:
            load(planner.resolve_data(item).getvalue())
        except Refused as exc:
            raise TypeError(
                f"rank {rank}: the value at {item.index.fqn!r} of the state to save {exc.reason}. A sharded "
                "checkpoint loads every value that is not a tensor with weights_only=True (an unpickled value could "
                "run code in every rank that loads it), so it would not load: save plain values instead (numbers, "
                "strings, lists, dicts, tensors, state_dict(); a numpy value as .item() or .tolist()), or register "
                f"the type with {HOW_TO_ALLOW}. Nothing of this step is committed") from None
