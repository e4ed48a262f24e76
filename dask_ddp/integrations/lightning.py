"""Lightning in a dask-ddp job, one line: ``L.Trainer(..., callbacks=[DaskDDPCallback()])``.

Runs in: the rank process (the callback's hooks, inside ``trainer.fit``). Importing this module imports Lightning
(``lightning``, else ``pytorch_lightning``); importing dask-ddp does not.

What the callback does, with ``trainer.fit(model, ...)`` unchanged:

- **metrics**: at each of Lightning's logging steps (``log_every_n_steps``) every rank reports
  ``trainer.logged_metrics`` (numbers and one-element tensors) to ``report()``, at ``step=trainer.global_step``:
  rows in ``job.metrics``, the live view and the sinks;
- **checkpoints**: at the end of every ``every_n_epochs`` epoch (and every ``every_n_train_steps`` steps, if
  set), the trainer's own checkpoint (``trainer.save_checkpoint``) goes to ``lightning/step-<N>.ckpt`` in the job's
  checkpoint folder (``run(..., checkpoint_dir=...)``), written under a temporary name and renamed once whole; the
  newest ``keep`` stay. A sharded (FSDP2) ``ModelParallelStrategy``'s go through dask-ddp's DCP path instead
  (:mod:`~dask_ddp.integrations.lightning_sharded`);
- **resume**: after a restart (the same job's next attempt, or an elastic resize) the first ``fit()`` resumes from
  the newest of them. The callback is an ``OnExceptionCheckpoint``: Lightning's ``fit(ckpt_path=None)`` then
  takes its "last" checkpoint, which this callback names (``ckpt_path``);
- **preemption**: at the step every rank agreed to stop at (see :func:`dask_ddp.on_preemption`), the trainer saves
  its checkpoint there, and the job restarts from it: no step lost. Every rank passes each step's point
  (Lightning's ``on_train_batch_end``), as the protocol needs. Lightning restores its loop's place in the epoch
  but not a plain ``DataLoader``'s: the callback has each one skip the batches the epoch had done (:class:`SkipOnce`
  around its batch sampler's sampler), so the resumed epoch goes on at the right sample.

A job started without ``checkpoint_dir`` gets the metrics and no checkpoints (a warning says so once).
Outside a dask-ddp rank the callback does nothing.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
import warnings
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.loggers import Logger as FabricLogger
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
except ImportError:  # the older package names
    import pytorch_lightning as pl  # type: ignore[no-redef]
    from lightning_fabric.loggers import Logger as FabricLogger  # type: ignore[no-redef,assignment]
    from pytorch_lightning.callbacks import OnExceptionCheckpoint  # type: ignore[no-redef,assignment]

from dask_ddp.checkpoint.folder import check_int
from dask_ddp.integrations import lightning_sharded
from dask_ddp.integrations.steps import StepPoint, by_step, job_subfolder, newest, numbers_of
from dask_ddp.rank.context import get_context
from dask_ddp.rank.reporting import report

__all__ = ["DaskDDPCallback", "DaskDDPLogger"]

log = logging.getLogger("dask_ddp")
PREFIX, SUFFIX = "step-", ".ckpt"


class SkipOnce:
    """A sampler that leaves out the first ``skip`` indices of ``inner``'s next pass, then is ``inner``; every
    other attribute (``set_epoch``) is ``inner``'s."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Any:
        indices = iter(self.inner)
        skip, self.skip = self.skip, 0
        for _ in itertools.islice(indices, skip):
            pass
        return indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DaskDDPCallback(OnExceptionCheckpoint):
    """Metrics to ``report()``, checkpoints in the job's folder, resume after a restart, the save at a preemption.

    Parameters
    ----------
    every_n_epochs
        Save at the end of every this many epochs (0: never at an epoch's end).
    every_n_train_steps
        Also save every this many optimizer steps (None: not by steps).
    keep
        How many checkpoints stay (the newest).

    Raises
    ------
    TypeError, ValueError
        A setting that is not an int, or below its least (1 for ``keep``, 0 for the others).
    """

    def __init__(self, *, every_n_epochs: int = 1, every_n_train_steps: int | None = None, keep: int = 2) -> None:
        check_int("every_n_epochs", every_n_epochs, 0)
        if every_n_train_steps is not None:
            check_int("every_n_train_steps", every_n_train_steps, 1)
        check_int("keep", keep, 1)
        self.folder = job_subfolder("lightning")
        super().__init__(dirpath=self.folder[1] if self.folder else os.getcwd(), filename="dask-ddp-none")
        self.every_n_epochs, self.every_n_train_steps, self.keep = every_n_epochs, every_n_train_steps, keep
        self.point = StepPoint()
        self._warned = False
        self._resume = self.folder is not None and get_context().restart_count > 0  # a later attempt's first fit
        self._sharded = lightning_sharded.job_directory() if self.folder is not None else None
        self._route: lightning_sharded.ShardedRoute | None = None  # FSDP2's checkpoints: set up in setup()
        # Lightning's words for fit(ckpt_path=None) with an OnExceptionCheckpoint ("the last model of the previous
        # fit call will be used", "no last checkpoint available") fit its own use of it, not this resume
        warnings.filterwarnings("ignore", message=r".*\.fit\(ckpt_path=(None|\"last\")\)")

    @property
    def ckpt_path(self) -> str:
        """The newest checkpoint in the job's folder, for a later attempt's first ``fit()`` ("" where none, and for
        a first attempt or a second ``fit()``: Lightning then starts as it would without the callback)."""
        if not (self.folder and self._resume):
            return ""
        sharded = lightning_sharded.newest(self._sharded)  # a job's checkpoints are all of one kind
        if sharded:
            return sharded
        found = newest(*self.folder, PREFIX, SUFFIX)
        return found[1] if found else ""

    def setup(self, trainer: "pl.Trainer", pl_module: Any, stage: str) -> None:
        """Route a sharded (FSDP2) strategy's checkpoints through dask-ddp's DCP path
        (:mod:`~dask_ddp.integrations.lightning_sharded`), before Lightning resumes from one."""
        self._resume = False  # Lightning chose its checkpoint before this hook: the next fit() starts afresh
        if self._sharded and self._route is None and lightning_sharded.takes(trainer.strategy):
            self._route = lightning_sharded.ShardedRoute(trainer.strategy, self._sharded, self.keep)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        logging_step = step % max(1, getattr(trainer, "log_every_n_steps", 1)) == 0  # (a property Lightning adds)
        due = self.point.at(step, trainer.logged_metrics if logging_step else None)
        if due is not None:
            self._save(trainer)
            raise due
        if self.every_n_train_steps and step % self.every_n_train_steps == 0:
            self._save(trainer)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        """After a resume mid-epoch (a preemption's save): have each plain ``DataLoader`` skip the batches of the
        epoch done before the save, once, so the rest of the epoch is its rest (Lightning restores its loop's
        position, not a plain loader's: it would take them from the start of the epoch)."""
        done = getattr(trainer.fit_loop.epoch_loop.batch_progress.current, "processed", 0)  # (a _ProcessedTracker)
        if not 0 < done < trainer.num_training_batches:
            return
        loaders = trainer.train_dataloader
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            batches = getattr(loader, "batch_sampler", None)
            if hasattr(loader, "state_dict") or batches is None or not hasattr(batches, "batch_size"):
                continue  # resumable (Lightning restores it), or no batch sampler to skip in
            batches.sampler = SkipOnce(batches.sampler, done * batches.batch_size)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: Any) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer)

    def on_exception(self, trainer: "pl.Trainer", *_: Any, **__: Any) -> None:
        """Nothing: a failing rank alone must not enter the save's collectives (the others would wait there);
        a preemption saves at its agreed step, before it raises."""

    def teardown(self, trainer: "pl.Trainer", *_: Any, **__: Any) -> None:
        """Nothing: the checkpoints stay for the next attempt."""

    def _save(self, trainer: "pl.Trainer") -> None:
        """The trainer's checkpoint at its step, whole or not at all; every rank calls it (Lightning's save is a
        collective); rank 0 renames it into place and removes the oldest past ``keep``."""
        if self.folder is None:
            if not self._warned and trainer.global_rank == 0:
                log.warning("dask-ddp: DaskDDPCallback saves no checkpoints: this job was started without "
                            "run(..., checkpoint_dir=...), so a restart starts training again from the beginning")
            self._warned = True
            return
        fs, path = self.folder
        step = trainer.global_step
        if self._route is not None:  # every rank its shards, committed once all are verified, keep-N pruned
            trainer.save_checkpoint(self._route.name(step))
            return
        final = f"{path}/{PREFIX}{step}{SUFFIX}"
        token = trainer.strategy.broadcast(uuid.uuid4().hex[:8])
        tmp = f"{path}/.{PREFIX}{step}{SUFFIX}.{token}.tmp"
        if trainer.global_rank == 0:
            fs.makedirs(path, exist_ok=True)
        trainer.save_checkpoint(tmp)  # rank 0 writes; every rank waits at its barrier
        if trainer.global_rank == 0:
            fs.mv(tmp, final)
            for _, old in by_step(fs, path, PREFIX, SUFFIX)[:-self.keep]:
                fs.rm(old)
        trainer.strategy.barrier("dask-ddp-checkpoint")


class DaskDDPLogger(FabricLogger):
    """Lightning Fabric's metrics to ``report()``, one line: ``Fabric(loggers=[DaskDDPLogger()])``.

    Every ``fabric.log(...)`` / ``fabric.log_dict(...)`` of the loop becomes a report of this rank (numbers and
    one-element tensors; at ``step`` when given, else ``report()``'s own count): rows in ``job.metrics``, the live
    view and the sinks. Fabric calls it on every rank, so each such call is also the preemption protocol's point:
    with :class:`~dask_ddp.integrations.fabric.DaskDDPCheckpoints` in the loop, its ``step`` saves at the agreed
    step (and raises :class:`dask_ddp.Preempted` there); without it, the agreed step runs a save registered by
    :func:`dask_ddp.on_preemption`, if any, and raises. Outside a dask-ddp rank it does nothing.

    Raises
    ------
    Preempted
        From ``log`` at the step every rank agreed to stop at, as ``report()`` does.
    """

    def __init__(self) -> None:
        super().__init__()
        self._in_rank = StepPoint().in_rank

    @property
    def name(self) -> str:
        return "dask-ddp"

    @property
    def version(self) -> str:
        return get_context().run_id if self._in_rank else ""

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        values = numbers_of(metrics)
        if self._in_rank and values:
            report(step=step, **values)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: a job's parameters are its function's arguments (``job.history`` names the function)."""
