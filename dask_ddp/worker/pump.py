"""A rank's stdout and stderr, line by line, to its relay: two threads per rank.

Runs in: the Dask worker (the pump threads of one rank supervisor).

One thing is left out: the warning torch prints with a stack of C++ frames when
the rendezvous store closes under a rank's wait (the notice watcher's,
:mod:`dask_ddp.rank.preemption`), if the rank is being stopped by then. Rank 0
hosts the store, so every other rank printed it (15 lines) whenever rank 0
failed or was stopped first: a consequence of the stop, whose cause the job
reports. Outside a stop (code of the rank's own that uses a store) the warning
is relayed whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

__all__ = ["OutputPump", "PUMP_WAIT"]

logger = logging.getLogger("dask_ddp")

# torch's C++ warning when the store closes under a rank's wait (rank 0 has ended): its first line holds both
# marks, the frames follow (checked on torch 2.14)
_STORE_GONE = ("TCPStore.cpp", "Connection was likely closed")
_STACK_LINES = ("Exception raised from ", "frame #", "<omitting python frames>")
PUMP_WAIT = 1.0  # seconds a finished rank's output relays may take to reach the end of its pipes
MAX_READ = 64 * 1024  # bytes of one output line kept; the rest of a longer line is read in pieces and dropped


def lines(stream, limit: int = MAX_READ):
    """``(first bytes of a line, bytes dropped from it)`` for each line of ``stream``, holding at most ``limit``
    bytes at a time: a rank that prints 300 MiB without a newline costs its worker 64 KiB, not the line."""
    while raw := stream.readline(limit):
        cut = 0
        if not raw.endswith(b"\n"):
            while more := stream.readline(limit):
                if more.endswith(b"\n"):
                    cut += len(more) - 1
                    break
                cut += len(more)
        yield raw, cut


class OutputPump:
    """Relays ``streams`` (name -> binary pipe) to ``log(name, line)``; keeps the last 30 lines of stderr.

    ``stopping_within(wait)``: whether the rank is being stopped (waiting up to ``wait`` s), which decides
    whether a store warning is left out. Each stream is closed at its end of file.
    """

    def __init__(self, streams: dict, log: Callable[[str, str], None], stopping_within: Callable[[float], bool],
                 rank: int):
        self.log, self.stopping_within, self.rank = log, stopping_within, rank
        self.stderr_tail: deque = deque(maxlen=30)
        self._threads = [threading.Thread(target=self._pump, args=(stream, name), name=f"dask-ddp-{name}",
                                          daemon=True) for name, stream in streams.items()]

    def start(self) -> "OutputPump":
        for thread in self._threads:
            thread.start()
        return self

    def join(self, wait: float = PUMP_WAIT) -> None:
        """Wait up to ``wait`` s in all for the rank's last lines to reach the relay."""
        deadline = time.monotonic() + wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def tail(self) -> str:
        """The last lines of the rank's stderr."""
        return "\n".join(self.stderr_tail)

    def _forward(self, name: str, line: str) -> None:
        if name == "stderr":
            self.stderr_tail.append(line)
        self.log(name, line)

    def _settle(self, name: str, held: list[str], ended: bool = False) -> None:
        if self.stopping_within(0.25 if ended else 0.5):
            logger.debug("dask-ddp: rank %d: left out torch's store warning during the stop: %s", self.rank,
                         held[0])
            return
        for line in held:
            self._forward(name, line)

    def _pump(self, stream, name: str) -> None:
        held: list[str] = []  # a store warning and its frames, until the block ends
        with stream:  # closed here, at EOF: when the rank and whatever inherited the pipe have ended
            for raw, cut in lines(stream):
                line = raw.decode(errors="replace").rstrip("\n")
                if cut:
                    line += f" ... [{cut} more bytes of this line dropped]"
                if held and (line.startswith(_STACK_LINES) or not line.strip()):
                    held.append(line)
                    continue
                if held:
                    self._settle(name, held)
                    held = []
                if all(mark in line for mark in _STORE_GONE):
                    held = [line]
                    continue
                self._forward(name, line)
            if held:
                self._settle(name, held, ended=True)
