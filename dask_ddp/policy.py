"""The failure policy: pure decisions about an ended attempt, no cluster, no side effects.

The job (:mod:`dask_ddp.job`) is the one place that acts on a
:class:`Decision`: it raises, or tears the group down and starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Decision", "root_cause", "decide"]

# Which failure explains the others: a lost worker explains its peers' broken collectives,
# a killed process likewise, then a rank's own exception; collective errors seen by the
# survivors (torch's DistError) only when nothing else is known.
_PRIORITY = {"lost": 0, "stalled": 0, "died": 1, "error": 2}


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt: ``finish``, ``fail`` or ``restart``, and why."""

    action: str
    reason: str
    root: object = None


def root_cause(outcomes: Sequence) -> object | None:
    """The outcome that explains the failure: by kind (see ``_PRIORITY``), first-hand before
    secondary collective errors, then the earliest; None when every rank succeeded."""
    failed = [o for o in outcomes if o.status in _PRIORITY]
    if not failed:
        return None
    return min(failed, key=lambda o: (_PRIORITY[o.status], bool(getattr(o, "secondary", False)), o.time))


def decide(outcomes: Sequence, *, cancelled: bool, attempt: int, max_restarts: int) -> Decision:
    """Decide what follows an attempt whose ranks have all ended.

    ``attempt`` counts from 0; a failed attempt is restarted while
    ``attempt < max_restarts``. Cancellation is never restarted.
    """
    if cancelled:
        return Decision("fail", "cancelled by the user")
    root = root_cause(outcomes)
    if root is None:
        if all(o.status == "ok" for o in outcomes):
            return Decision("finish", "every rank returned")
        return Decision("fail", "ranks were stopped without a failure of their own", None)
    where = f"rank {root.rank} on {root.worker}"
    what = {"lost": "lost its worker", "stalled": "stalled", "died": "died", "error": "raised"}[root.status]
    if attempt < max_restarts:
        return Decision("restart", f"{where} {what}; attempt {attempt + 2}/{max_restarts + 1}", root)
    tail = f" after {attempt + 1} attempts" if max_restarts else ""
    return Decision("fail", f"{where} {what}{tail}", root)
