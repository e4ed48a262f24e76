"""The messages between a rank supervisor and its rank process, one small frozen type each.

Runs in: the Dask worker (the supervisor) and the rank process, at both ends
of a socket pair (``multiprocessing.connection.Connection``, pickled)::

    rank process -> supervisor        supervisor -> rank process
    Ready      torch imported         WarmCuda       (before Start, optional) start CUDA while you wait
                                      Start          the job: a RankTask and rank 0's store port
    Port       rank 0 bound its store StacksRequest  dump your Python stacks
    Events     a batch of reports and FlushRequest   send the events you hold (about to be stopped)
               log records
    Result     the function returned (pickled value)
    Failed     the function raised (pickled exception)
    Stacks     the stack dump asked for
    Flushed    every event held went out before this
    NoticeSeen a preemption notice     Notice         this job must save and stop: a worker leaves
               reached this rank                      (or the job grows) by ``deadline``
    Saved      stopped at the agreed
               step for a preemption

A rank process runs one job and exits; closing the socket kills it (and its
DataLoader workers), so a dead supervisor never leaves a rank behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dask_ddp.wire.notices import Notice, Stopped
from dask_ddp.wire.task import RankTask

__all__ = ["Ready", "Port", "Events", "Result", "Failed", "Stacks", "Start", "WarmCuda", "StacksRequest",
           "FlushRequest", "Flushed", "Notice", "NoticeSeen", "PeerLost", "Saved"]


@dataclass(frozen=True)
class Ready:
    """The rank process has imported torch and waits for a :class:`Start`."""

    pid: int


@dataclass(frozen=True)
class Port:
    """Rank 0 bound the rendezvous store on this port (chosen by the OS)."""

    port: int


@dataclass(frozen=True)
class Events:
    """Reports and log records gathered for a flush interval (plain dicts, see :mod:`dask_ddp.rank.reporting`)."""

    items: list


@dataclass(frozen=True)
class Result:
    """The training function returned: its value, pickled with cloudpickle."""

    value: bytes = field(repr=False)


@dataclass(frozen=True)
class Failed:
    """The training function (or the rank's start) raised: the exception pickled, when, and whether it is a
    broken collective seen by a survivor (``secondary``), a consequence of another rank's failure; ``summary``:
    a line for ``job.history`` where dask-ddp's own error says why the job goes on as it does (live recovery
    that could not go on), else empty."""

    error: bytes = field(repr=False)
    time: float
    secondary: bool = False
    summary: str = ""


@dataclass(frozen=True)
class Stacks:
    """The rank's Python stacks, as text, answering a :class:`StacksRequest`."""

    text: str


@dataclass(frozen=True)
class Start:
    """Run this rank; ``master_port`` is rank 0's store port (None for rank 0, which binds it)."""

    task: RankTask
    master_port: int | None = None
    tmpdir: str | None = None  # the rank's TMPDIR, made and removed by its supervisor


@dataclass(frozen=True)
class WarmCuda:
    """Sent to a rank forked ahead of its job, before its :class:`Start`: start CUDA on device 0 meanwhile (the
    next job then starts without CUDA's start; see ``ddp.warm-cuda``)."""


@dataclass(frozen=True)
class StacksRequest:
    """Send a :class:`Stacks` with every thread's Python stack."""


@dataclass(frozen=True)
class FlushRequest:
    """Send every report and log record held now, then a :class:`Flushed` (the rank is about to be stopped)."""


@dataclass(frozen=True)
class Flushed:
    """Every event held when the :class:`FlushRequest` came has been sent before this message."""


@dataclass(frozen=True)
class NoticeSeen:
    """The rank learned of a preemption notice (from its supervisor, a peer, or a SIGTERM of its own).

    ``can_save``: its code registered a save (``on_preemption``) or polls ``preempted()``; if not, it cannot
    stop at an agreed step and its worker need not wait for it."""

    notice: Notice
    can_save: bool = True


@dataclass(frozen=True)
class PeerLost:
    """Ranks of the job were lost (their processes died, their workers left): a rank of a live-recovered job
    (``recovery="live"``, :mod:`dask_ddp.rank.live`) re-forms its group without them."""

    ranks: tuple[int, ...]
    cause: str = ""
    # (rank, n) of those of ``ranks`` whose replacements are starting (``RankTask.joined`` n): the group waits for them
    replaced: tuple[tuple[int, int], ...] = ()
    joined: tuple[int, ...] = ()  # each lost process's RankTask.joined (0: started with the attempt); () all 0


@dataclass(frozen=True)
class Saved:
    """The rank stopped at the step every rank agreed on (``saved``: its state was saved there) and every
    rank passed the commit barrier; see :mod:`dask_ddp.rank.preemption`."""

    stopped: Stopped
