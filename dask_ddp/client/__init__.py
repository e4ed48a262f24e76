"""The client wing: what runs in the notebook (or a detached job's driver on the scheduler).

Runs in: the client process: ``run()`` and its launch rules (:mod:`.dispatch`), the job
handle (:mod:`.job`) and its local or remote control (:mod:`.control`, :mod:`.detach`), the
controller that owns a job's live state and acts on failures (:mod:`.controller`, deciding
through the pure :mod:`.policy` and :mod:`.elastic`), its port to the Dask cluster
(:mod:`.cluster`), the job's record (:mod:`.record`), the event feed and its ordering
(:mod:`.events`), silence and straggler watches (:mod:`.liveness`, :mod:`.stragglers`),
detached jobs (:mod:`.detach`; its and detached sweeps' drivers held on the scheduler by
:mod:`.registry`), and sweeps: many jobs searched and pruned by Optuna
(:mod:`.sweep` the call and handle, :mod:`.sweep_driver` its thread, :mod:`.search` the
Optuna glue, :mod:`.placement` gang placement, :mod:`.trial` a trial's record,
:mod:`.trial_queue` the asked trials and their line).

May import: :mod:`dask_ddp.worker` (its tasks are submitted by reference),
:mod:`dask_ddp.observe`, :mod:`dask_ddp.dashboard`, :mod:`dask_ddp.data` and
:mod:`dask_ddp.wire`. Never :mod:`dask_ddp.rank`: what the client and a rank share is wire.
"""
