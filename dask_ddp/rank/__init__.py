"""The rank wing: the rank process (one per rank per job) and its zygote.

Runs in: the rank process, forked from its worker's warm zygote (:mod:`.zygote`) or started
fresh: its main loop (:mod:`.main`), its rendezvous (:mod:`.rendezvous`), how its call
ends (:mod:`.outcome`), ``get_context()`` and the per-rank
helpers (:mod:`.context`), ``report()`` (:mod:`.reporting`), telemetry (:mod:`.telemetry`,
:mod:`.collectives`), preemption inside a rank (:mod:`.preemption`, its signed store keys in
:mod:`.notice_board`), GPU placement
(:mod:`.devices`), where its store and collectives listen (:mod:`.network`) and FSDP2/HSDP's
device mesh and ``fully_shard`` in one call (:mod:`.fsdp`).

May import: :mod:`dask_ddp.data`, :mod:`dask_ddp.checkpoint`, :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire` (and
:mod:`dask_ddp.config`).
"""
