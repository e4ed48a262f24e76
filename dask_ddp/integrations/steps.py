"""What both trainer callbacks do at a step: report, take part in preemption, find the job's checkpoint folder.

Runs in: the rank process (inside a trainer's callback hooks).
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Mapping

from dask_ddp.checkpoint import folder
from dask_ddp.rank import preemption
from dask_ddp.rank.context import get_context
from dask_ddp.rank.reporting import report
from dask_ddp.wire.errors import NotInRankError

__all__ = ["numbers_of", "StepPoint", "job_subfolder", "by_step", "newest"]


def numbers_of(logs: Mapping[str, Any]) -> dict[str, float | int]:
    """The entries of a trainer's logged metrics that ``report()`` carries: numbers and one-element tensors (the
    rest, strings and lists, is left out); keys made strings."""
    out: dict[str, float | int] = {}
    for key, value in logs.items():
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        out[str(key)] = int(value) if isinstance(value, numbers.Integral) else float(value)
    return out


class StepPoint:
    """One trainer's step boundary on this rank: the report of the metrics at logging steps, the preemption
    protocol's point at every step (every rank passes the same steps), the due :class:`Preempted`.

    Outside a rank (the trainer run by hand or under torchrun) it does nothing.
    """

    def __init__(self) -> None:
        try:
            get_context()
            self.in_rank = True
        except NotInRankError:
            self.in_rank = False
        self.last: int | None = None

    def at(self, step: int, metrics: Mapping[str, Any] | None = None) -> preemption.Preempted | None:
        """Pass step ``step`` (once per step: a second call at the same step does nothing), reporting ``metrics``
        when given; return the preemption due here (the trainer saves, then raises it), else None."""
        if not self.in_rank or step == self.last:
            return None
        self.last = step
        values = numbers_of(metrics or {})
        if values:
            report(step=step, **values)  # also the preemption point
        else:
            preemption.at_report(step)
        return preemption.preempted()


def job_subfolder(name: str) -> tuple[Any, str] | None:
    """``(fsspec filesystem, path)`` of the folder ``name`` in the job's checkpoint folder, None when the job has
    none (started without ``checkpoint_dir``) or this is no rank. Raises what the storage raises for a bad URL."""
    try:
        where = folder.where(None, None)
    except (NotInRankError, ValueError):
        return None
    return where.fs, f"{where.root}/{name}"


def by_step(fs: Any, path: str, prefix: str, suffix: str = "") -> list[tuple[int, str]]:
    """The ``(step, path)`` of every entry ``<prefix><step><suffix>`` in ``path``, oldest step first ([] where the
    folder does not exist)."""
    try:
        names = [os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        middle = name[len(prefix):len(name) - len(suffix)] if suffix else name[len(prefix):]
        if name.startswith(prefix) and name.endswith(suffix) and middle.isdigit():
            found.append((int(middle), f"{path}/{name}"))
    return sorted(found)


def newest(fs: Any, path: str, prefix: str, suffix: str = "") -> tuple[int, str] | None:
    """The ``(step, path)`` of the entry ``<prefix><step><suffix>`` in ``path`` with the largest step, or None."""
    found = by_step(fs, path, prefix, suffix)
    return found[-1] if found else None
