"""The exceptions dask-ddp raises.

Runs in: everywhere; raised in the rank process or the Dask worker, re-raised on the client.

Every class pickles with its fields (they travel from Dask workers to the
client). A user's own exception raised inside a rank is re-raised on the
client with its own type, the rank and the worker added as a note
(:pep:`678`), so ``pytest.raises(ValueError)`` keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DaskDDPWarning",
    "DaskDDPError",
    "PlanError",
    "SerializationError",
    "RankFailedError",
    "PickledRankError",
    "RankExitError",
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


class DaskDDPWarning(UserWarning):
    """dask-ddp's warnings about how it is used: something to change in the code or a setting (a sink to
    attach, a limit a rank passes). Shown once per place by Python's default filter; silence them with
    ``warnings.filterwarnings("ignore", category=dask_ddp.DaskDDPWarning)``. What happens to a running job
    (restarts, stragglers, lost workers) is logged on the ``dask_ddp`` logger and kept in ``job.history``."""


class DaskDDPError(Exception):
    """Base class of dask-ddp's errors; ``rank`` and ``worker`` say where, when known."""

    def __init__(self, message: str, *, rank: int | None = None, worker: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.worker = worker

    def __reduce__(self):
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class PlanError(DaskDDPError, ValueError):
    """Bad launch input found on the client before anything started (workers, backend, ...)."""


class SerializationError(DaskDDPError, TypeError):
    """The training function or one of its arguments cannot be pickled to ship to the workers, or a rank's
    return value cannot be pickled back to the client."""


class RankFailedError(DaskDDPError):
    """A rank ended without a Python exception of its own (killed by a signal, exited, crashed)."""


class PickledRankError(RankFailedError):
    """A rank's exception kept pickled (``blob``) where it must not be unpickled: in the scheduler's process, where
    the drivers of detached jobs and sweeps run (unpickling runs whatever the exception's ``__reduce__`` names).
    The client that reads the job calls :meth:`load` for the rank's own exception; ``detail`` is the rank's
    one-line description of its failure, if any."""

    def __init__(self, message: str, *, blob: bytes = b"", detail: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.blob, self.detail = blob, detail

    def load(self) -> BaseException:
        """The rank's own exception, unpickled in this process, with this error's notes; a :class:`RankFailedError`
        saying why when it cannot be unpickled here (its class is not importable, say). Raises nothing."""
        import cloudpickle

        try:
            err = cloudpickle.loads(self.blob)
            if not isinstance(err, BaseException):
                raise TypeError(f"it unpickled to a {type(err).__name__}, not an exception")
        except Exception as exc:  # noqa: BLE001 - e.g. the exception's class is not importable here
            err = RankFailedError(f"rank {self.rank} on worker {self.worker} failed; its error could not be "
                                  f"unpickled on the client ({exc!r}): {self.detail}", rank=self.rank,
                                  worker=self.worker)
        for note in getattr(self, "__notes__", ()):
            err.add_note(note)
        return err


class RankExitError(RankFailedError):
    """A rank's function called ``sys.exit`` with a non-zero code or a message; ``code`` keeps it.

    ``sys.exit()`` and ``sys.exit(0)`` are no failure: the rank returns None, as torchrun counts exit code 0.
    """

    def __init__(self, message: str, *, code: object = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.code = code

    @staticmethod
    def describe(code: object) -> str | None:
        """How an error names ``sys.exit(code)``: ``"code 3"``, ``"message 'bye' (exit code 1)"``; None for an
        exit that is a success (``sys.exit()``, ``sys.exit(0)``)."""
        if code is None or code == 0:
            return None
        return f"code {code}" if isinstance(code, int) else f"message {code!r} (exit code 1)"


class WorkerLostError(RankFailedError):
    """The Dask worker of a rank left the cluster while the job ran."""


class StallError(DaskDDPError):
    """No rank reported progress within ``stall_timeout``; ``stacks`` maps rank to its Python stack dump."""

    def __init__(self, message: str, *, stacks: dict | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.stacks = dict(stacks or {})


class JobCancelledError(DaskDDPError):
    """The job was cancelled with :meth:`Job.cancel` before it finished."""


class RendezvousError(DaskDDPError):
    """The ranks could not meet: the store did not come up or a rank never arrived."""


class NotInRankError(DaskDDPError, RuntimeError):
    """A rank-only helper (get_context, report, save_checkpoint, ...) was called outside a dask-ddp rank."""


class ClientClosedError(DaskDDPError, RuntimeError):
    """The Dask client given to ``run`` is closed or not connected, or was closed while its job ran."""

    @classmethod
    def of_job(cls, run_id: str, where: str = "", **kw: Any) -> ClientClosedError:
        """The error of job ``run_id`` whose client was closed under it (``where``: which rank saw it)."""
        return cls(f"the Dask client closed while job {run_id} ran: its ranks were stopped{where}. A job lives as "
                   "long as the client that started it; run(..., detach=True) keeps it running without one", **kw)
