"""One line for what dask-ddp adds to the trainers people use: a callback each.

Runs in: the rank process (a trainer's callback hooks). May import: :mod:`dask_ddp.rank`, :mod:`dask_ddp.data`,
:mod:`dask_ddp.checkpoint`, :mod:`dask_ddp.storage`, :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`).

- :mod:`dask_ddp.integrations.lightning`: ``DaskDDPCallback`` for ``lightning.Trainer``, ``DaskDDPLogger`` for
  Lightning Fabric's metrics; its FSDP2 (``ModelParallelStrategy``) checkpoints go through dask-ddp's sharded
  checkpoints (:mod:`dask_ddp.integrations.lightning_sharded`);
- :mod:`dask_ddp.integrations.fabric`: ``DaskDDPCheckpoints``, Lightning Fabric's checkpoints (its loop calls it);
- :mod:`dask_ddp.integrations.transformers`: ``DaskDDPCallback`` for Hugging Face's ``Trainer``.

Each streams the trainer's metrics to ``report()``, writes and resumes the trainer's own checkpoints in the job's
checkpoint folder, and turns a preemption notice into the trainer's own save at the agreed step. Importing
dask-ddp imports neither library; importing one of these modules imports its library (the extras
``dask-ddp[lightning]`` and ``dask-ddp[transformers]``). The environment that makes the trainers distributed with
their defaults needs no callback (:mod:`dask_ddp.rank.trainers`).
"""
