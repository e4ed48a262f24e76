"""What a job tells the scheduler's dashboard about itself: the ``dask-ddp-jobs`` topic.

Runs in: the client (the job's controller publishes; the scheduler's
:class:`~dask_ddp.dashboard.plugin.DDPDashboard` reads). No Bokeh here: the client needs none.

At every state transition the controller publishes ``{"kind": "job", "run", "name", "state", "attempt",
"time", "ranks": [{"rank", "worker", "host", "device"}]}``; straggler detection publishes
``{"kind": "straggler", "run", "rank", "worker", "host", "cause", "time", "message"}``. :func:`publish`
sends without waiting and never raises: the dashboard is never a reason for a job to fail or wait.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dask_ddp.wire.task import topic_of

if TYPE_CHECKING:
    from distributed import Client

    from dask_ddp.wire.plan import RankPlan

__all__ = ["JOBS_TOPIC", "JOB_TOPIC_PREFIX", "job_message", "publish"]

logger = logging.getLogger("dask_ddp")

#: Every job's own event topic starts with this (``dask-ddp-<run_id>``, :func:`dask_ddp.wire.task.topic_of`).
JOB_TOPIC_PREFIX = topic_of("")
#: The topic of job-level messages (states, stragglers); a run id always ends in 8 hex digits, so no job's
#: own topic is ever this one.
JOBS_TOPIC = JOB_TOPIC_PREFIX + "jobs"


def _device(backend: str) -> str | None:
    # the client knows a rank's device only when the backend fixes it: ranks pick their GPU themselves
    return "cpu" if backend == "gloo" else None


def job_message(run_id: str, name: str, state: str, attempt: int, plan: RankPlan | None, backend: str = "auto") -> dict:
    """The ``{"kind": "job", ...}`` message of a job in ``state`` during ``attempt`` (0 first) on ``plan``.

    ``plan`` is the attempt's :class:`~dask_ddp.wire.plan.RankPlan` (None: no ranks known yet).
    """
    ranks = [] if plan is None else [{"rank": r.rank, "worker": r.address, "host": r.host,
                                      "device": _device(backend)} for r in plan.ranks]
    return {"kind": "job", "run": run_id, "name": name, "state": state, "attempt": int(attempt),
            "time": time.time(), "ranks": ranks}


def publish(client: Client, msg: dict) -> None:
    """Log ``msg`` on ``dask-ddp-jobs`` through ``client``, without waiting; never raises.

    The message goes from the client's event loop (a blocking ``client.log_event`` from the job's watcher
    thread could wait on a slow scheduler). Without a running client it is dropped.
    """
    if client is None or getattr(client, "status", None) != "running":
        return
    try:
        client.loop.add_callback(_send, client, msg)
    except Exception:  # noqa: BLE001 - the loop is closing: the dashboard misses one message
        logger.debug("dask-ddp could not publish %s on %s", msg.get("kind"), JOBS_TOPIC, exc_info=True)


async def _send(client, msg: dict) -> None:
    try:
        await client.scheduler.log_event(topic=JOBS_TOPIC, msg=msg)
    except Exception:  # noqa: BLE001 - the scheduler is gone or closing: nothing to show it to
        logger.debug("dask-ddp could not publish %s on %s", msg.get("kind"), JOBS_TOPIC, exc_info=True)
