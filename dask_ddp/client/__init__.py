"""The client wing: one job, as the notebook runs it (or a detached job's driver on the scheduler).

Runs in: the client process: ``run()`` and its launch rules (:mod:`.dispatch`), the job
handle (:mod:`.job`) and its local or remote control (:mod:`.control`, :mod:`.detach`), the
controller that owns a job's live state and acts on failures (:mod:`.controller`, deciding
through the pure :mod:`.policy` and :mod:`.elastic`; its stop and growth notices in
:mod:`.notices`), its port to the Dask cluster (:mod:`.cluster`), the job's record
(:mod:`.record`), the event feed and its ordering (:mod:`.events`), silence and straggler
watches (:mod:`.liveness`, :mod:`.stragglers`), detached jobs (:mod:`.detach`; its and
detached sweeps' drivers held on the scheduler by :mod:`.registry`) and SLURM's cluster
options (:mod:`.slurm`). Sweeps, many jobs searched by Optuna, are the layer above:
:mod:`dask_ddp.sweeps`.

May import: :mod:`dask_ddp.worker` (its tasks are submitted by reference),
:mod:`dask_ddp.observe`, :mod:`dask_ddp.dashboard`, :mod:`dask_ddp.data`,
:mod:`dask_ddp.checkpoint`, :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire`. Never
:mod:`dask_ddp.rank`: what the client and a rank share is wire; never :mod:`dask_ddp.sweeps`.
"""
