"""Goodput: where a rank's and a job's wall time went, the categories and the checks of what a rank sends.

Runs in: every process that reads a rank's ``"telemetry"`` item (the client's record, the scheduler's page).
The rank keeps its own ledger (:mod:`dask_ddp.rank.goodput`); each telemetry item carries it as the flat
fields ``goodput_<category>_s`` (items are flat dicts, :func:`fields`): the seconds of the rank process, since
its task started, in each of :data:`RANK_CATEGORIES`. They add up to the process's time so far:

- ``startup``: from the task's start to the first step (the first batch asked of a ``DataLoader`` or of
  :func:`~dask_ddp.timed`, the first forward of a ``DistributedDataParallel`` model, ``live_steps``' start, or,
  failing all of these, the first ``report()``, which counts the first step as start-up): imports, the
  rendezvous, building the model;
- ``data``: waiting for batches (the telemetry's input wait);
- ``checkpoint``: the training thread inside ``save_checkpoint`` and ``save_sharded`` (an async save's upload
  runs behind the training and is not counted);
- ``recovery``: a live recovery (re-forming the group, healing a replacement, taking one in), and the wait of
  a rolled-back step past a committed step's typical time (a collective blocked until the loss was heard);
- ``redone``: steps run again: a live step rolled back (its time up to a committed step's typical time, an
  average of the latest); after a restart, the steps up to the highest one reported before it (counted by the
  client, which knows the earlier attempts);
- ``productive``: the rest of the time after the first step.

The client adds :data:`OTHER` for the time no rank process accounts for (before a process started, between
attempts, after a process ended while others ran); see :mod:`dask_ddp.client.goodput`.
"""

from __future__ import annotations

import math

__all__ = ["RANK_CATEGORIES", "CATEGORIES", "OTHER", "fields", "checked", "ratio", "total"]

RANK_CATEGORIES = ("productive", "startup", "data", "checkpoint", "recovery", "redone")
OTHER = "other"
CATEGORIES = (*RANK_CATEGORIES, OTHER)
MAX_SECONDS = 10 * 365 * 86400.0  # a value past ten years is no process's time: rank code sent something else


def fields(split: dict[str, float]) -> dict[str, float]:
    """A rank's ledger ``{category: seconds}`` as the telemetry item's fields ``goodput_<category>_s``."""
    return {f"goodput_{k}_s": float(split[k]) for k in RANK_CATEGORIES}


def checked(item: dict) -> dict[str, float] | None:
    """The ledger a telemetry item carries as ``{category: seconds}`` (every rank category), or None when it
    carries none (a field missing, another type, a value negative, not finite or absurd): rank code can send
    anything, a reader must not fail on it."""
    out = {}
    for name in RANK_CATEGORIES:
        v = item.get(f"goodput_{name}_s")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_SECONDS:
            return None
        out[name] = float(v)
    return out


def total(split: dict[str, float]) -> float:
    """The seconds ``split`` accounts for, all categories."""
    return float(sum(split.values()))


def ratio(split: dict[str, float] | None) -> float | None:
    """The productive share of ``split`` (0..1); None for no split or no time."""
    if not split:
        return None
    whole = total(split)
    return split.get("productive", 0.0) / whole if whole > 0 else None
