"""dask-ddp in the Dask dashboard: a DDP page and ``dask_ddp_`` gauges on ``/metrics``.

Runs in: the scheduler's process (:mod:`.plugin`, :mod:`.state`, :mod:`.page`, :mod:`.prometheus`) and the
client (:mod:`.jobs`: what a job tells the scheduler; :func:`install`).

May import: :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`). Never Bokeh at import time (below).

``dispatch.run`` installs :class:`~dask_ddp.dashboard.plugin.DDPDashboard` on the scheduler before a job
starts. The plugin reads the ranks' event batches (telemetry items, one a second per rank) and the
``dask-ddp-jobs`` topic (state transitions, stragglers) as the scheduler relays them, keeps the latest
per job and rank (bounded), and serves them as the dashboard's DDP page (``/ddp``, a tab of the top bar,
and ``/individual-ddp``) and as Prometheus gauges. Nothing here imports Bokeh until the scheduler needs it.
"""

from dask_ddp.dashboard.jobs import JOBS_TOPIC, job_message, publish
from dask_ddp.dashboard.plugin import DDPDashboard, install

__all__ = ["DDPDashboard", "install", "JOBS_TOPIC", "job_message", "publish"]
