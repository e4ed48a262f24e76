"""The exceptions dask-ddp raises.

Runs in: everywhere; raised in the rank process or the Dask worker, re-raised on the client.

Every class pickles with its fields (they travel from Dask workers to the
client). A user's own exception raised inside a rank is re-raised on the
client with its own type, the rank and the worker added as a note
(:pep:`678`), so ``pytest.raises(ValueError)`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "DaskDDPError",
    "PlanError",
    "SerializationError",
    "RankFailedError",
    "WorkerLostError",
    "StallError",
    "JobCancelledError",
    "RendezvousError",
    "NotInRankError",
    "ClientClosedError",
]


def _rebuild(cls, args, state):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class DaskDDPError(Exception):
    """Base class of dask-ddp's errors; ``rank`` and ``worker`` say where, when known."""

    def __init__(self, message: str, *, rank: int | None = None, worker: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.worker = worker

    def __reduce__(self):
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class PlanError(DaskDDPError, ValueError):
    """Bad launch input found on the client before anything started (workers, backend, ...)."""


class SerializationError(DaskDDPError, TypeError):
    """The training function or one of its arguments cannot be pickled to ship to the workers."""


class RankFailedError(DaskDDPError):
    """A rank ended without a Python exception of its own (killed by a signal, exited, crashed)."""


class WorkerLostError(RankFailedError):
    """The Dask worker of a rank left the cluster while the job ran."""


class StallError(DaskDDPError):
    """No rank reported progress within ``stall_timeout``; ``stacks`` maps rank to its Python stack dump."""

    def __init__(self, message: str, *, stacks: dict | None = None, **kw):
        super().__init__(message, **kw)
        self.stacks = dict(stacks or {})


class JobCancelledError(DaskDDPError):
    """The job was cancelled with :meth:`Job.cancel` before it finished."""


class RendezvousError(DaskDDPError):
    """The ranks could not meet: the store did not come up or a rank never arrived."""


class NotInRankError(DaskDDPError, RuntimeError):
    """A rank-only helper (get_context, report, save_checkpoint, ...) was called outside a dask-ddp rank."""


class ClientClosedError(DaskDDPError, RuntimeError):
    """The Dask client given to ``run`` is closed or not connected."""
