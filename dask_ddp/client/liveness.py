"""Workers that go silent: a machine that vanished says nothing for minutes.

Runs in: the client (the job's controller feeds it the scheduler's view of the workers).

A killed or closed worker is reported at once by the scheduler (``remove-worker``),
but a machine that loses power or network sends nothing: the scheduler drops
such a worker only after ``distributed.scheduler.worker-ttl`` (5 minutes by
default), and the other ranks wait inside their collective meanwhile. So a job
reads its workers' ``last_seen`` (the scheduler's time of each worker's last
heartbeat, every 0.5 s on small clusters) about once a second, and counts a
worker whose value has not moved for ``ddp.worker-timeout`` seconds (at least
four heartbeat intervals) as lost. Values are only compared with themselves,
on the client's clock, so the two clocks need not agree; and nothing counts as
silent while no worker's heartbeat moves (a stalled scheduler or client).
"""

from __future__ import annotations

from typing import Iterable, Mapping

try:
    from distributed.scheduler import heartbeat_interval as _heartbeat_interval
except ImportError:  # not public API: fall back to its current rule's slowest small-cluster value
    def _heartbeat_interval(n_workers: int) -> float:
        return 1.0

__all__ = ["SilenceWatch"]


class SilenceWatch:
    """Finds workers whose heartbeats to the scheduler stopped; ``timeout`` None or 0 turns it off.

    No I/O: the controller asks :meth:`due` and, when it is, passes the
    scheduler's workers (:func:`dask_ddp.client.cluster.scheduler_workers`) to :meth:`check`.
    """

    def __init__(self, timeout: float | None, every: float = 1.0):
        self.timeout, self.every = timeout, every
        self._changed: dict[str, tuple[float, float]] = {}  # address -> (last_seen, local time it changed)
        self._checked = float("-inf")
        self.silent: dict[str, float] = {}  # address -> seconds of silence when it was declared lost
        self.quiet: set[str] = set()  # every worker (a rank's or a free one) silent past the limit at the last check

    def due(self, now: float) -> bool:
        """Whether a check is due at ``now`` (``time.monotonic()``): at most once per ``every`` seconds."""
        return bool(self.timeout) and now - self._checked >= self.every

    def check(self, workers: Mapping[str, Mapping], addresses: Iterable[str], now: float) -> dict[str, float]:
        """Newly silent workers among ``addresses``, with their seconds of silence."""
        self._checked = now
        for address, info in workers.items():
            seen = info.get("last_seen")
            if seen is not None and self._changed.get(address, (None,))[0] != seen:
                self._changed[address] = (seen, now)
        limit = max(self.timeout, 4 * _heartbeat_interval(len(workers)))
        # the scheduler still hears some worker (a silent one is never among them): else nobody counts as silent
        if not any(now - t < limit / 2 for a, (_, t) in self._changed.items() if a in workers):
            self.quiet = set()
            return {}
        self.quiet = {a for a, (_, t) in self._changed.items() if a in workers and now - t > limit}
        found = {}
        for address in addresses:
            if address in self.silent or address not in workers or address not in self._changed:
                continue
            quiet = now - self._changed[address][1]
            if quiet > limit:
                self.silent[address] = found[address] = quiet
        return found

    def heard(self, address: str) -> bool:
        """Whether ``address`` may be given work: never declared lost, and not silent at the last check (a free
        worker on a host cut off is as silent as the ranks' own: no replacement goes there)."""
        return address not in self.silent and address not in self.quiet
