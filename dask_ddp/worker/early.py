"""Start a Dask worker's zygote as the worker starts: ``dask worker --preload dask_ddp.worker.early``.

Runs in: the Dask worker process, at its start (Dask calls :func:`dask_setup` of a preload module).

A worker starts its zygote (the warm process that imports torch and forks each job's rank) at its first job, or
when :func:`dask_ddp.warm_up` asks. With this preload it starts as the worker starts, so that ``import torch``
runs while the rest of the cluster starts and the client connects: the first job of a fresh cluster waits less.
``dask-ddp run`` and ``dask-ddp demo`` start their local clusters with it. On a long-lived cluster it costs a warm
process per worker (or one per host, with the zygote host) before any job asks for one.
"""

from __future__ import annotations

from dask_ddp.worker import launcher

__all__ = ["dask_setup"]


def dask_setup(worker) -> None:
    """Dask's preload hook: start this worker's zygote in the background (:func:`launcher.start_early
    <dask_ddp.worker.launcher.start_early>`). Raises nothing of its own; with ``ddp.zygote: false`` it does nothing."""
    launcher.start_early()
