"""Preemption as it crosses processes: the notice a rank gets, and the record of how its ranks stopped.

Runs in: every process: a leaving worker's supervisor makes a :class:`Notice`, the
rank process publishes it in the job's store (:meth:`Notice.to_json`) and answers
with a :class:`Stopped` at the end, which its supervisor puts in the rank's
outcome and the client's controller reads (:mod:`dask_ddp.client.elastic`). One
frozen type each, end to end: no string-keyed dicts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

import dask

__all__ = ["Notice", "Stopped", "KINDS", "grace_period"]

KINDS = ("leave", "grow", "signal", "stop")


def grace_period() -> float:
    """``ddp.preemption.grace-period`` (seconds), as this process's config says: how long a leaving worker waits
    for its ranks' save, and what a rank process that receives SIGTERM gives the job."""
    return float(dask.config.get("ddp.preemption.grace-period", 25))


@dataclass(frozen=True)
class Notice:
    """Save and stop by ``deadline`` (``time.time()``): a worker of the job leaves, or the job grows.

    ``worker``: the address of the worker that leaves; ``kind``: ``leave`` (a worker leaves), ``grow`` (workers
    joined an elastic job), ``signal`` (a rank process received SIGTERM) or ``stop`` (``Job.stop()``: the job
    ends at the agreed step, no restart; a sweep's pruned trial)."""

    deadline: float
    cause: str
    worker: str = ""
    kind: str = "leave"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a preemption notice's kind is one of {KINDS}, got {self.kind!r}")

    def to_json(self) -> str:
        """The notice as the job's rendezvous store holds it."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Notice":
        """The notice :meth:`to_json` wrote.

        Raises
        ------
        ValueError
            ``text`` is not such a notice (bad JSON, a missing or unknown field, a kind not in :data:`KINDS`).
        """
        try:
            fields = json.loads(text)
            return cls(float(fields["deadline"]), str(fields["cause"]), str(fields.get("worker", "")),
                       str(fields.get("kind", "leave")))
        except (TypeError, KeyError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"not a dask-ddp preemption notice: {text[:200]!r} ({exc!r})") from None


@dataclass(frozen=True)
class Stopped:
    """What a notice did to a rank: the notice, and (once its ranks stopped at the agreed step) how.

    Attributes
    ----------
    notice : the :class:`Notice` that reached the rank.
    step : the step every rank agreed to stop at; None when the ranks did not stop at one (the notice came,
        then the rank ended otherwise).
    saved : the rank's state was saved at ``step``.
    committed : every rank passed the commit barrier before the deadline.
    heard : when the notice reached the rank (``time.time()``).
    save_took : seconds from the agreed step to the end of the save.
    commit_time : when the commit barrier was passed (``time.time()``).
    phases : ``(phase, seconds after heard)`` pairs, for ``job.history`` and tests.
    """

    notice: Notice
    step: int | None = None
    saved: bool = False
    committed: bool = False
    heard: float = 0.0
    save_took: float = 0.0
    commit_time: float = 0.0
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def safe(self) -> bool:
        """The job can resume from ``step`` without loss: saved there and committed by every rank."""
        return self.step is not None and self.saved and self.committed

    def heard_first(self, heard: float) -> "Stopped":
        """This record with ``heard`` (e.g. the earliest of several ranks')."""
        return replace(self, heard=heard)
