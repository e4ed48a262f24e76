"""A rank's stdout and stderr, line by line, to its relay: two threads per rank; a progress bar's redraws (lines
ending with a lone ``\\r``) relayed as lines of their own, at most two a second.

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
REDRAW_EVERY = 0.5  # seconds between two relayed redraws of a progress bar (a line that ends with a lone \r)
MAX_READ = 64 * 1024  # bytes of one output line kept; the rest of a longer line is read in pieces and dropped


def lines(stream, limit: int = MAX_READ):
    """``(first bytes of a line, bytes dropped from it, redraw)`` for each line of ``stream``, holding at most
    ``limit`` bytes of a line: a rank that prints 300 MiB without a newline costs its worker 64 KiB, not the line.

    A line ends at ``\\n`` (or ``\\r\\n``), or at a lone ``\\r``: a progress bar's redraw (tqdm, rich), ``redraw``
    True, so that the bar is seen while it moves, not as one line when it ends. Line ends are not in the bytes.
    """
    held, kept, cut, dropping = b"", b"", 0, False
    while chunk := stream.read1(limit):
        held += chunk
        while True:
            ends = [i for i in (held.find(b"\n"), held.find(b"\r")) if i >= 0]
            if not ends:
                break
            i = min(ends)
            if held[i:i + 1] == b"\r" and i + 1 == len(held):
                break  # a \r\n cut between two reads: wait for the next byte
            crlf = held[i:i + 2] == b"\r\n"
            line, redraw = held[:i], held[i:i + 1] == b"\r" and not crlf
            held = held[i + (2 if crlf else 1):]
            if dropping:  # the end of a line cut at limit: its kept start goes
                cut, line, dropping = cut + len(line), kept, False
            elif len(line) > limit:
                cut, line = len(line) - limit, line[:limit]
            yield line, cut, redraw
            cut = 0
        if not dropping and len(held) > limit:  # no end yet: keep the first limit bytes, count the rest
            kept, cut, held, dropping = held[:limit], len(held) - limit, b"", True
        elif dropping:
            cut, held = cut + len(held), b""
    if dropping:
        yield kept, cut, False
    elif held:
        yield held, cut, False


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
        shown = float("-inf")  # when a progress bar's redraw was last relayed
        with stream:  # closed here, at EOF: when the rank and whatever inherited the pipe have ended
            for raw, cut, redraw in lines(stream):
                if redraw:  # a progress bar's: at most one a REDRAW_EVERY seconds, the one drawn last so far
                    now = time.monotonic()
                    if now - shown < REDRAW_EVERY:
                        continue
                    shown = now
                line = raw.decode(errors="replace")
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
