"""The controller's hands on a real Dask cluster: submit, watch and stop a job's rank tasks.

Runs in: the client. :class:`DaskCluster` is everything the controller
(:mod:`dask_ddp.client.controller`) does to or asks of the cluster, behind a few
methods, so that the controller can be stepped against a fake in tests
(``tests/test_controller.py``). Nothing here decides anything.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import cloudpickle
from distributed import Event

from dask_ddp.client.events import TopicFeed, WorkerWatch
from dask_ddp.wire.errors import ClientClosedError, RankFailedError
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.task import RankTask
from dask_ddp.worker import plugin
from dask_ddp.worker.supervisor import forget_attempt, supervise

__all__ = ["DaskCluster", "check_client", "scheduler_workers"]


def scheduler_workers(client) -> dict[str, dict]:
    """Every worker the scheduler knows, ``{address: info}``, fetched for this call alone.

    Not ``client.scheduler_info(n_workers=-1)``: that fetches into the client's shared cached identity and
    returns the cache, which the client's own refresh (``distributed.client.scheduler-info-interval``, 2 s)
    overwrites with an identity that lists no workers (distributed 2026.7). A refresh landing between the fetch
    and the return made a plan see an empty cluster (measured: 68 of 500 calls at a 2 ms refresh).

    Raises
    ------
    OSError
        The scheduler cannot be reached (the client is closing or lost its connection).
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def check_client(client) -> None:
    """Raises ClientClosedError for a client that is not connected, TypeError for one called from inside its own
    event loop (``Client(asynchronous=True)`` in async code: its calls return coroutines that run() cannot await)."""
    if getattr(client, "status", None) != "running":
        raise ClientClosedError(f"the Dask client is not connected (status {getattr(client, 'status', None)!r}): "
                                "create a new Client(...) for the cluster")
    if getattr(client, "asynchronous", False):
        raise TypeError("dask-ddp's run(), warm_up() and attach() block and need the client's answers at once, but "
                        "this client was made with asynchronous=True and is called from its event loop: call them "
                        "in a thread, e.g. job = await asyncio.to_thread(dask_ddp.dispatch.run, client, fn), then "
                        "await asyncio.to_thread(job.result)")


logger = logging.getLogger("dask_ddp")


class DaskCluster:
    """One job's view of a Dask cluster through ``client``: its rank tasks, its event topic, its workers."""

    def __init__(self, client, topic: str):
        self.client = client
        self.feed = TopicFeed(client, topic)
        self._removed: list[str] = []
        self._leaving: list[str] = []  # retired by the scheduler: their ranks may be saving for a preemption
        self._lock = threading.Lock()
        self._watch = WorkerWatch.of(client)
        self._token = self._watch.add(self._on_removed)

    def _on_removed(self, address: str, expected: bool = False) -> None:  # on the client's event loop: only record
        with self._lock:
            (self._leaving if expected else self._removed).append(address)

    # ---- rank tasks ----------------------------------------------------------------------------------------
    def submit(self, tasks: list[RankTask]) -> list:
        """Submit one pinned :func:`~dask_ddp.worker.supervisor.supervise` task per rank; return their futures. The
        end of each wakes :meth:`events` (the job's end then waits for no poll)."""
        plugin.register(self.client)
        futures = [self.client.submit(supervise, t, key=t.key, workers=[t.rank.address], allow_other_workers=False,
                                      pure=False, retries=0) for t in tasks]
        for fut in futures:  # the controller looks at once when a rank's task ends, not at its next event wait
            fut.add_done_callback(self.feed.wake)
        return futures

    def outcome(self, future, task: RankTask) -> RankOutcome | None:
        """The rank's outcome once its task is done, else None. A task that failed becomes an ERROR outcome (a
        ClientClosedError when the client was closed under it)."""
        if not future.done():
            return None
        try:
            return future.result(timeout=5)
        except BaseException as exc:  # noqa: BLE001 - the supervisor never raises: this is Dask's own failure
            r = task.rank
            if self.client_closed():  # the user's own client.close(): no rank failed
                where = f" (rank {r.rank} on worker {r.address})"
                err = ClientClosedError.of_job(task.run_id, where, rank=r.rank, worker=r.address)
            else:
                err = RankFailedError(f"the task of rank {r.rank} on worker {r.address} failed: {exc!r}",
                                      rank=r.rank, worker=r.address)
            return RankOutcome(r.rank, r.address, Status.ERROR, error=cloudpickle.dumps(err), message=str(err))

    def cancel(self, future) -> None:
        """Forget a task pinned to a worker that is gone (it would wait forever)."""
        future.cancel()

    def release(self, futures: list) -> None:
        for fut in futures:
            fut.release()

    def abort(self, task: RankTask, cancel: bool = False) -> None:
        """Set the attempt's abort flag: every supervisor of the attempt stops its rank within a poll interval;
        ``cancel``: the job's cancel() flag too, which also stops ranks that save for a preemption notice."""
        try:
            if cancel:
                Event(task.cancel_event, client=self.client).set()
            Event(task.abort_event, client=self.client).set()
        except Exception:  # noqa: BLE001 - the client may be closing; the tasks then fail on their own
            logger.warning("dask-ddp could not set the abort flag of %s", task.attempt_id)

    def cleanup(self, task: RankTask) -> None:
        """Remove the attempt's abort flag and rendezvous port from the scheduler."""
        forget_attempt(task, self.client)

    # ---- the cluster ---------------------------------------------------------------------------------------
    def queued(self, tasks: list[RankTask]) -> dict[str, dict]:
        """What :func:`~dask_ddp.worker.plugin.queued_tasks` says on each worker of ``tasks`` (one ``client.run``);
        a worker that does not answer is left out."""
        keys = [t.key for t in tasks]
        return self.client.run(plugin.queued_tasks, keys, workers=sorted({t.rank.address for t in tasks}),
                               on_error="ignore")

    def client_closed(self) -> bool:
        """Whether the client was closed (or lost its scheduler) under the job."""
        return getattr(self.client, "status", None) != "running"

    def workers(self) -> dict[str, dict]:
        """The scheduler's workers: ``{address: info}``, every one (see :func:`scheduler_workers`)."""
        return scheduler_workers(self.client)

    def removed(self) -> list[str]:
        """Addresses of workers that left the cluster since the last call."""
        with self._lock:
            out, self._removed = self._removed, []
        return out

    def leaving(self) -> list[str]:
        """Addresses of workers the scheduler retired (gracefully removed) since the last call."""
        with self._lock:
            out, self._leaving = self._leaving, []
        return out

    def notify(self, task: RankTask, addresses: list[str], cause: str, grace: float, kind: str = "grow") -> None:
        """Ask every rank of ``task``'s attempt to save at an agreed step and stop (``kind``: ``grow``, the job
        grows; ``stop``, it ends there)."""
        from dask_ddp.worker.leaving import notify

        try:
            notify(self.client, task.attempt_id, addresses, cause, grace, kind)
        except Exception:  # noqa: BLE001 - a worker left meanwhile: the job goes on, growth is tried again
            logger.warning("dask-ddp could not ask the ranks of %s to stop (%s)", task.attempt_id, kind,
                           exc_info=True)

    def peer_lost(self, task: RankTask, addresses: list[str], ranks: list[int], cause: str,
                  replaced: Sequence = (), joined: Sequence = ()) -> None:
        """Tell the ranks of ``task``'s attempt on ``addresses`` that ``ranks`` were lost (a live job's survivors
        re-form their group without them, or with the replacements ``replaced``: ``(rank, n)`` pairs; ``joined``:
        the n of each lost process, 0 for one started with the attempt)."""
        from dask_ddp.worker.live import tell_peer_lost

        try:
            tell_peer_lost(self.client, task.attempt_id, addresses, ranks, cause, replaced, joined)
        except Exception:  # noqa: BLE001 - the scheduler is gone: the ranks fail their collectives, the job restarts
            logger.warning("dask-ddp could not tell the ranks of %s that ranks %s were lost", task.attempt_id, ranks,
                           exc_info=True)

    def stacks(self, attempt_id: str, addresses: list[str]) -> dict[int, str]:
        """Every rank's Python stack dump, by rank (``-1``: why none could be had)."""
        try:
            per_worker = self.client.run(plugin.dump_stacks, attempt_id, workers=addresses, on_error="return")
        except Exception as exc:  # noqa: BLE001
            return {-1: f"(could not collect stacks: {exc!r})"}
        return {rk: text for got in per_worker.values() if isinstance(got, dict) for rk, text in got.items()}

    # ---- events --------------------------------------------------------------------------------------------
    def events(self, wait: float) -> list[dict]:
        """The batches that arrived on the job's topic, waiting up to ``wait`` s for the first."""
        return self.feed.get(wait)

    def backfill(self) -> list[dict]:
        """The batches the scheduler holds for the topic (subscribing does not replay the past)."""
        return self.feed.backfill()

    def close(self) -> None:
        """Stop watching the cluster and drop the job's topic (idempotent)."""
        if self._token is None:
            return
        self._watch.remove(self._token)
        self._token = None
        self.feed.close()
