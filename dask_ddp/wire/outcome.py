"""How one rank ended: the contract between the rank supervisor, the failure policy and the job.

Runs in: the Dask worker (the supervisor makes a :class:`RankOutcome`) and the
client (the controller and :mod:`dask_ddp.client.policy` read it). Plain data: it
travels as the result of the rank's Dask task.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from dask_ddp.wire.notices import Stopped

__all__ = ["Status", "RankOutcome"]


class Status(str, enum.Enum):
    """What happened to a rank. A ``str`` enum: ``Status.OK == "ok"`` holds."""

    OK = "ok"              # the function returned; ``value`` holds its pickled result
    ERROR = "error"        # the function (or dask-ddp on its behalf) raised; ``error`` holds it
    DIED = "died"          # the rank process was killed or exited without a result
    ABORTED = "aborted"    # stopped because another rank failed or the job was cancelled
    LOST = "lost"          # its Dask worker left the cluster or went silent (set by the client)
    STALLED = "stalled"    # no report within stall_timeout (set by the client)
    PREEMPTED = "preempted"  # stopped at the step the ranks agreed on for a preemption; ``preempt`` says more

    def __str__(self) -> str:
        return self.value


@dataclass
class RankOutcome:
    """How one rank ended, as its supervisor (or, for a lost worker, the client) saw it.

    Attributes
    ----------
    rank, worker : which rank, on which Dask worker address.
    status : a :class:`Status`.
    value, error : the pickled return value (OK) or exception (every other status).
    message : a one-line description of a failure (for logs; the exception has the whole story).
    time : when it ended (``time.time()`` on the machine that saw it).
    last_seq : the sequence number of the last event batch the rank published (-1: none).
    started : when the supervisor started (``time.time()``).
    secondary : the error is a broken collective seen by a survivor, a consequence of another rank's failure.
    preempt : a :class:`~dask_ddp.wire.notices.Stopped`, set when a preemption notice had reached the rank
        (see :mod:`dask_ddp.rank.preemption`); with PREEMPTED it also says at which step the ranks stopped,
        whether the save was committed, and how long it took.
    """

    rank: int
    worker: str
    status: Status
    value: bytes | None = None
    error: bytes | None = None
    message: str = ""
    time: float = field(default_factory=time.time)
    last_seq: int = -1
    started: float = 0.0
    secondary: bool = False
    preempt: Stopped | None = None

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def failed(self) -> bool:
        """True for a failure of its own (not OK, not ABORTED by another's failure)."""
        return self.status not in (Status.OK, Status.ABORTED, Status.PREEMPTED)
