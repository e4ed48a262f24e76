"""How a rank's call ends, as the message its supervisor gets: a result, a save for a preemption, or a failure.

Runs in: the rank process (called by :func:`dask_ddp.rank.main.run_job` around the user's function).

:func:`outcome` runs the call and turns every way it can end into one message
of :mod:`dask_ddp.wire.messages`: :class:`~dask_ddp.wire.messages.Result` (the
value pickled; ``sys.exit(0)`` counts as success, as under torchrun),
:class:`~dask_ddp.wire.messages.Saved` (stopped at the agreed step of a
preemption) or :class:`~dask_ddp.wire.messages.Failed` (the exception pickled
with rank and worker noted, and whether it is a broken collective: a
consequence of another rank's failure, not a root cause).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import cloudpickle
from tblib import pickling_support

from dask_ddp.rank import preemption
from dask_ddp.rank.live_group import LiveRecoveryError
from dask_ddp.wire.errors import RankExitError, RankFailedError, SerializationError
from dask_ddp.wire.messages import Failed, Result, Saved

__all__ = ["outcome"]

# Text of gloo's and NCCL's plain RuntimeErrors for a broken connection: the last resort of
# _is_collective_error, for the errors torch gives no type of their own (gloo raises RuntimeError)
_COLLECTIVE_TEXT = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                    "ProcessGroupNCCL", "ProcessGroupGloo")


def outcome(call: Callable[[], Any], rank: int, worker: str, finish: Callable[[], None] = lambda: None):
    """Run ``call()`` and return the message that says how it ended; ``finish()`` runs after a return, before
    the result is sent (rank 0 keeps the store up for the others). Raises nothing."""
    try:
        try:
            value = call()
        except SystemExit as exc:
            value = _exit_value(exc, rank, worker)  # type: ignore[func-returns-value]  # None, or it raises
        blob = _pickle_value(value, rank, worker)
        finish()
        return Result(blob)
    except preemption.Preempted as exc:  # stopped at the agreed step: wait until the save is committed
        return Saved(preemption.stopped(exc))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the client
        exc = _as_exception(exc, rank, worker)
        _add_hint(exc)
        # a broken collective on a survivor is a consequence, not a root cause
        summary = (f"live recovery could not go on: {str(exc).splitlines()[0][:300]}"
                   if isinstance(exc, LiveRecoveryError) and str(exc) else "")
        return Failed(_serialize_error(exc, rank, worker), time.time(), _is_collective_error(exc), summary)


def _serialize_error(exc: BaseException, rank: int, worker: str) -> bytes:
    exc.add_note(f"[dask-ddp] raised on rank {rank}, worker {worker}; the other ranks were stopped")
    pickling_support.install(exc)
    try:
        return cloudpickle.dumps(exc)
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return cloudpickle.dumps(RankFailedError(f"rank {rank} on worker {worker} raised an exception that cannot "
                                                 f"be pickled back to the client:\n{text}", rank=rank, worker=worker))


def _exit_value(exc: SystemExit, rank: int, worker: str) -> None:
    """The value of a rank whose function called ``sys.exit``: None for ``sys.exit()`` and ``sys.exit(0)``
    (torchrun counts exit code 0 as success).

    Raises
    ------
    RankExitError
        Any other code, or a message (Python exits with code 1 for it); the ``SystemExit`` is its cause.
    """
    what = RankExitError.describe(exc.code)
    if what is None:
        return None
    raise RankExitError(f"the function called sys.exit with {what} on rank {rank} (worker {worker})",
                        code=exc.code, rank=rank, worker=worker) from exc


def _as_exception(exc: BaseException, rank: int, worker: str) -> BaseException:
    """``exc``, or for a ``BaseException`` that is no ``Exception`` (``KeyboardInterrupt``, ``GeneratorExit``,
    a ``SystemExit`` from outside the function) a :class:`RankFailedError` caused by it: re-raised as such in
    the notebook, it would read as the user's own Ctrl-C or end a script, and pass ``except Exception``."""
    if isinstance(exc, Exception):
        return exc
    err = RankFailedError(f"rank {rank} on worker {worker} raised {type(exc).__name__}: {exc}", rank=rank,
                          worker=worker)
    err.__cause__ = exc
    return err


def _add_hint(exc: BaseException) -> None:
    """Add a note saying what to do to a rank's error that has a known cause in how the function was written."""
    if isinstance(exc, ValueError) and "initialize the default process group twice" in str(exc):
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else "?"
        exc.add_note(f"[dask-ddp] dask-ddp initialises the process group before it calls your function (backend "
                     f"{backend}, torchrun's environment set): remove the function's own "
                     "dist.init_process_group(...), or call it only `if not dist.is_initialized()`. An unchanged "
                     "torchrun script runs with `dask-ddp run script.py`.")


def _pickle_value(value, rank: int, worker: str) -> bytes:
    """The function's return value, pickled to go back to the client.

    Raises
    ------
    SerializationError
        It cannot be pickled (a lock, an open file, a generator, ...); the pickling error is its cause.
    """
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise SerializationError(
            f"rank {rank} on worker {worker}: the function's return value ({kind}) cannot be pickled back to the "
            f"client: {type(exc).__name__}: {exc}. Return plain values (numbers, tensors, dicts of them); save "
            "models and large state with dask_ddp.save_checkpoint", rank=rank, worker=worker) from exc


def _is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken collective (a peer went away) rather than the rank's own failure.

    By type first: torch's ``DistError`` family (NCCL's ``DistBackendError``, the store's
    ``DistStoreError``/``DistNetworkError``). Then by where it was raised: a ``RuntimeError`` from
    inside ``torch.distributed``'s Python API. Last, and only for the ``RuntimeError`` that gloo
    raises from C++ with no type of its own (for instance inside DDP's backward all-reduce), by its
    text (``_COLLECTIVE_TEXT``): checked on torch 2.14, gloo's "Connection reset by peer".
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and "torch/distributed/" in frames[-1].filename.replace("\\", "/"):
        return True
    return any(mark in str(exc) for mark in _COLLECTIVE_TEXT)
