"""The scheduler plugin behind the DDP page and the ``dask_ddp_`` gauges.

Runs in: the scheduler's process (:class:`DDPDashboard`); :func:`install` runs in the client, called by
``dispatch.run`` before each job. A cluster that never runs a dask-ddp job never gets the plugin.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import dask
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_ddp.dashboard import prometheus
from dask_ddp.dashboard.state import DashboardState

if TYPE_CHECKING:
    from distributed import Client, Scheduler

__all__ = ["DDPDashboard", "install", "NAME"]

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
