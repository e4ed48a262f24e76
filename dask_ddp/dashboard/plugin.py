"""The scheduler plugin behind the DDP page and the ``dask_ddp_`` gauges.

Runs in: the scheduler's process (:class:`DDPDashboard`, :func:`orphaned_topics`); :func:`install` runs in the
client, called by ``dispatch.run`` before each job. A cluster that never runs a dask-ddp job never gets the
plugin. Besides the page and the gauges, the plugin drops the event topic of a job whose client left without
ending it (a killed kernel), which nothing else would.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import dask
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_ddp.dashboard import prometheus
from dask_ddp.dashboard.jobs import JOB_TOPIC_PREFIX, JOBS_TOPIC
from dask_ddp.dashboard.state import DashboardState

if TYPE_CHECKING:
    from distributed import Client, Scheduler

__all__ = ["DDPDashboard", "install", "NAME", "orphaned_topics"]

logger = logging.getLogger("dask_ddp")

NAME = "dask-ddp-dashboard"
_WARNED: set[str] = set()  # schedulers whose refusal was logged: once each, not at every job


class DDPDashboard(SchedulerPlugin):
    """Keeps the latest dask-ddp jobs and rank telemetry (:class:`DashboardState`) from the events the
    scheduler relays, and serves them as the dashboard's DDP page and on ``/metrics``.

    Installed once per scheduler (idempotent); ``keep_jobs`` and ``history`` come from
    ``ddp.dashboard.keep-jobs`` and ``ddp.dashboard.history`` on the client that installed it.
    """

    idempotent = True
    name = NAME

    def __init__(self, keep_jobs: int = 20, history: int = 120) -> None:
        self.keep_jobs, self.history = keep_jobs, history
        self.state: DashboardState | None = None
        self.page = False

    def __getstate__(self):
        return {"keep_jobs": self.keep_jobs, "history": self.history, "state": None, "page": False}

    async def start(self, scheduler: Scheduler) -> None:
        """Attach the page to the scheduler's dashboard (if it has one) and the gauges to ``/metrics``."""
        self.state = DashboardState(self.keep_jobs, self.history)
        try:
            from dask_ddp.dashboard.page import attach

            self.page = attach(scheduler, self.state)
        except ImportError:  # no bokeh where the scheduler runs: no dashboard pages at all there
            self.page = False
        except Exception:  # noqa: BLE001 - a changed Bokeh: no page, but the job and the gauges go on
            logger.warning("dask-ddp could not add its page to the Dask dashboard", exc_info=True)
        prometheus.register(self.state)

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event the scheduler relays; dask-ddp's are kept (the others cost a prefix check)."""
        if self.state is not None:
            self.state.feed(topic, msg)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """A client left: drop the topics of the dask-ddp jobs it followed and no other client does (see
        :func:`orphaned_topics`), and show those jobs CANCELLED (their ranks stop with their client)."""
        runs = orphaned_topics(scheduler, client)
        if runs and self.state is not None:
            self.state.orphaned(runs)

    async def close(self) -> None:
        if self.state is not None:
            prometheus.unregister(self.state)


def install(client: Client) -> bool:
    """Install :class:`DDPDashboard` on ``client``'s scheduler (once; later calls cost one round trip).

    Never raises: a scheduler that cannot load dask-ddp (not installed where it runs) or refuses the plugin
    leaves the job without a dashboard page, with a warning (once per scheduler). ``ddp.dashboard.enabled: false``
    skips it.
    Returns True when the plugin is there.
    """
    cfg = dask.config.get("ddp.dashboard", default={}) or {}
    if not cfg.get("enabled", True):
        return False
    try:
        client.register_plugin(DDPDashboard(cfg.get("keep-jobs", 20), cfg.get("history", 120)), name=NAME)
        return True
    except Exception as exc:  # noqa: BLE001 - the dashboard never stops a job
        where = str(getattr(getattr(client, "scheduler", None), "address", ""))
        if where in _WARNED:
            return False
        _WARNED.add(where)
        logger.warning("dask-ddp: no DDP page or dask_ddp_ gauges on this cluster's scheduler: installing its "
                       "plugin failed (%r). Install dask-ddp where the scheduler runs (the docker/ images have "
                       "it), or set ddp.dashboard.enabled: false to skip it", exc)
        return False


def orphaned_topics(scheduler: Scheduler, client: str) -> list[str]:
    """On the scheduler, when ``client`` has left: drop the event topics of dask-ddp jobs (``dask-ddp-<run_id>``)
    that it subscribed to and no other client does; the run ids of those dropped. Raises nothing.

    A job's controller drops its topic at the job's end; a client that dies (a killed kernel) or closes while
    its job runs never does, and Dask keeps a topic (up to ``distributed.admin.low-level-log-length`` events,
    as bytes up to ``ddp.events.max-batch-bytes`` each) and its subscriber for good. ``Broker._topics`` is private
    (distributed 2026.8): guarded, as ``worker.relay.drop_topic`` is.
    """
    topics = getattr(getattr(scheduler, "_broker", None), "_topics", None)
    if not isinstance(topics, dict):
        return []
    dropped = []
    for name, topic in list(topics.items()):
        if not isinstance(name, str) or not name.startswith(JOB_TOPIC_PREFIX) or name == JOBS_TOPIC:
            continue
        subscribers = getattr(topic, "subscribers", None)
        if not isinstance(subscribers, set) or client not in subscribers:
            continue
        subscribers.discard(client)
        if not subscribers:
            topics.pop(name, None)
            dropped.append(name[len(JOB_TOPIC_PREFIX):])
    return dropped
