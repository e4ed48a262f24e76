"""The worker wing: what runs inside a Dask worker (and its nanny) for dask-ddp.

Runs in: the Dask worker process: the rank supervisor task (:mod:`.supervisor`, with its
output pump :mod:`.pump` and its stop rules :mod:`.stopping`), the worker plugin that owns
the zygote and the running ranks (:mod:`.plugin`), the rank processes as the worker sees
them (:mod:`.process`; their process groups, ended without naming a reused pid:
:mod:`.groups`), their private temporary folders (:mod:`.tmpdirs`), the per-host
event hub (:mod:`.hub`), the relay of a rank's events to Dask (:mod:`.relay`), the bounded best-effort call to the
scheduler (:mod:`.scheduler_call`), a leaving
worker's grace period (:mod:`.leaving`), and the preload that starts a worker's zygote as the worker starts
(:mod:`.early`, ``--preload dask_ddp.worker.early``).

May import: :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`). Never torch at import time:
the worker's event loop must not stall for seconds.
"""
