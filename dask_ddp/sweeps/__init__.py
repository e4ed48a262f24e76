"""The sweeps wing: many DDP trials on one cluster, searched and early-stopped by Optuna (``dask_ddp.sweep``).

Runs in: the client (the notebook), or the scheduler's process for a detached sweep. A layer above the job,
the way Ray Tune sits above Ray Train: each trial is a job of :mod:`dask_ddp.client`. The call and its handle
(:mod:`.handle`), the checks before anything ships (:mod:`.checks`), the driver's thread (:mod:`.driver`) with
its asked trials (:mod:`.queue`), the Optuna glue (:mod:`.search`), gang placement (:mod:`.placement`), a
trial's record (:mod:`.trial`), one running sweep per name (:mod:`.names`), detached sweeps (:mod:`.detach`),
a sweep picked up after its notebook died (:mod:`.pickup`), a trial started from another trial's checkpoint
(:mod:`.inherit`), and what a sweep shows outside the notebook (:mod:`.view`, with MLflow runs in
:mod:`.mlflow_runs`).

May import: :mod:`dask_ddp.client`, :mod:`dask_ddp.worker`, :mod:`dask_ddp.observe`, :mod:`dask_ddp.dashboard`,
:mod:`dask_ddp.checkpoint`, :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire`. Only the package's front door
(``dask_ddp.sweep``, ``dask_ddp.attach_sweep``) and the CLI import it.
"""
