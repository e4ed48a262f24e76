"""The observe wing: where a job's metrics and state go for people to see.

Runs in: the client (the notebook, or the job's watcher thread): the ready metric
sinks and :meth:`Job.plot` (:mod:`.sinks`), MLflow (:mod:`.mlflow_sink`), the per-rank
table and widget (:mod:`.display`) and the progress bar (:mod:`.progress`).

May import: :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire`.
"""
