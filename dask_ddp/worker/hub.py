"""Per-host aggregation of event batches: one Dask event per host and interval instead of one per rank.

Runs in: the Dask worker (its event loop: :class:`Hubs`, the ``dask_ddp_events`` handler; and the rank
supervisor's :class:`~dask_ddp.worker.relay.Relay` thread: :func:`forward`).

Each event batch costs the scheduler about the same CPU whatever its size
(``benchmarks/RESULTS_events_scale.md``), so a job bounds its batch rate
(``ddp.events.max-batches-per-second``); at 1,000 ranks one batch per rank
would leave each rank one batch every 17 s. When a job aggregates
(``ddp.events.per-host``, see :func:`dask_ddp.client.launch.hub_plan`), each rank's
Relay still flushes every ``flush-interval`` (1 s), but to its host's hub: the
worker of the host's local rank 0, over a worker RPC. The hub publishes what
all its host's ranks sent as one event, ``{"run", "batches": [batch, ...]}``
(``batches``: the ranks' own batches, unchanged), every host interval; the
client unpacks it (:func:`dask_ddp.wire.events.unpack`). With 8 ranks a host, 1,000 ranks are 125
hosts: every 3 s (a hub's event is weighted by what it costs, see
:func:`dask_ddp.client.launch.hub_plan`).

Nothing is lost to a hub: the RPC answers once the hub has published the
batches (handed them to its worker's stream to the scheduler). A hub whose
worker died, or that does not answer in time, fails the RPC, and the rank's
worker publishes the batch itself (and every later one: it stops forwarding).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from distributed.utils import sync

from dask_ddp.wire.events import batch_size, chunked

__all__ = ["HANDLER", "Hubs", "forward"]

logger = logging.getLogger("dask_ddp")

HANDLER = "dask_ddp_events"  # the worker RPC a hub answers
TICK = 0.1  # seconds between a hub's looks at what is due
IDLE = 10.0  # seconds a hub with nothing to send lives on (its last ranks may still flush once more)


class _Hub:
    """One topic's batches from one host's ranks, waiting for the next publication (``run`` and ``interval``:
    as the latest forward said)."""

    def __init__(self, topic: str):
        self.topic, self.run, self.interval = topic, "", 1.0
        self.pending: list[dict] = []
        self.waiters: list[asyncio.Future] = []
        self.published = time.monotonic()
        self.touched = time.monotonic()


class Hubs:
    """The hubs of one worker, one per topic (job) whose ranks forward here; lives on the worker's event loop.

    :class:`~dask_ddp.worker.plugin.RankHost` makes one per worker and installs :meth:`receive` as the worker's
    ``dask_ddp_events`` handler.
    """

    def __init__(self, worker, max_bytes: int):
        self.worker, self.max_bytes = worker, max_bytes
        self._hubs: dict[str, _Hub] = {}
        self._ticker: asyncio.Task | None = None

    async def receive(self, comm=None, topic: str = "", run: str = "", interval: float = 1.0,
                      batches: list | None = None, now: bool = False) -> str:
        """Take ``batches`` (rank batches of ``topic``) and answer once they are published: within ``interval``
        seconds of the hub's last publication, or at once with ``now``."""
        hub = self._hubs.get(topic)
        if hub is None:
            hub = self._hubs[topic] = _Hub(topic)
        hub.run, hub.interval = run, max(float(interval), TICK)  # a restart's plan may have other hosts
        hub.pending.extend(batches or [])
        hub.touched = time.monotonic()
        done = asyncio.get_running_loop().create_future()
        hub.waiters.append(done)
        if now or time.monotonic() - hub.published >= hub.interval:
            self._publish(hub)
        if self._ticker is None or self._ticker.done():  # it publishes what is due and forgets idle hubs
            self._ticker = asyncio.ensure_future(self._tick())
        await done
        return "published"

    def _publish(self, hub: _Hub) -> None:
        hub.published = time.monotonic()
        batches, waiters, hub.pending, hub.waiters = hub.pending, hub.waiters, [], []
        for group in chunked(batches, batch_size, self.max_bytes):  # at most max-batch-bytes an event, as a rank's own
            self.worker.log_event(hub.topic, {"run": hub.run, "batches": group})
        for done in waiters:
            if not done.done():
                done.set_result(None)

    async def _tick(self) -> None:
        while self._hubs:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            for topic, hub in list(self._hubs.items()):
                if hub.pending and now - hub.published >= hub.interval:
                    self._publish(hub)
                elif not hub.pending and now - hub.touched > max(IDLE, 3 * hub.interval):
                    del self._hubs[topic]

    def close(self) -> None:
        """Publish what every hub holds (the worker is closing)."""
        for hub in list(self._hubs.values()):
            if hub.pending:
                self._publish(hub)
        self._hubs.clear()


def forward(worker, via: str, topic: str, run: str, interval: float, msgs: list[dict], now: bool) -> None:
    """From a thread of ``worker``: hand ``msgs`` (rank batches) to the hub on worker ``via``; return once it has
    published them.

    Raises
    ------
    Exception
        Whatever stopped it (the hub's worker is gone, does not answer within ``interval`` + 30 s, or runs a
        dask-ddp without hubs): the caller publishes the batches itself.
    """
    if threading.get_ident() == worker.thread_id:
        raise RuntimeError("forward() was called on the worker's event loop")
    kwargs = {"topic": topic, "run": run, "interval": interval, "batches": msgs, "now": now}

    async def send():
        if via == worker.address:  # the hub is this worker's own: no connection
            return await worker.handlers[HANDLER](**kwargs)
        return await getattr(worker.rpc(via), HANDLER)(**kwargs)

    sync(worker.loop, send, callback_timeout=interval + 30)
