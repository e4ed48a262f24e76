"""Lightning's sharded (FSDP2) checkpoints through dask-ddp's DCP path: the route ``DaskDDPCallback`` takes for a
``ModelParallelStrategy`` that saves distributed checkpoints (its default).

Runs in: the rank process (inside ``trainer.fit``: the callback's ``setup`` installs the route, its saves and
Lightning's resume go through it).

Lightning's own sharded save writes torch DCP's ``FileSystemWriter`` folder on a local path, with its loops' and
callbacks' state in a ``meta.pt`` that its resume reads with ``torch.load(weights_only=False)``: a checkpoint that
whoever can write the folder can make run code. The route has the same trainer calls save and load through
:func:`dask_ddp.save_sharded` / :func:`dask_ddp.load_sharded` instead, in ``lightning-sharded/`` of the job's
checkpoint folder (any fsspec URL, S3 too): each rank writes only its shards, a step is visible once every rank's
files are verified, ``keep`` prunes, and the trainer's loops and callbacks ride as values read with
``weights_only=True`` (nothing in a checkpoint runs). The step's folder is what the callback names as Lightning's
"last" checkpoint; Lightning's resume then calls the strategy's ``load_checkpoint`` with it, which the route
answers. Paths that are not the route's go to the strategy's own methods, unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dask_ddp.checkpoint.sharded import api as sharded
from dask_ddp.rank.context import get_context

__all__ = ["ShardedRoute", "takes", "job_directory", "newest"]

log = logging.getLogger("dask_ddp")
FOLDER = "lightning-sharded"
MARK = "dask-ddp-sharded-step-"  # the save's name for a step: never a path of its own


def job_directory() -> str | None:
    """The URL of the route's folder in the job's checkpoint folder; None without one (no ``checkpoint_dir``, or
    not in a rank). Raises nothing of its own."""
    from dask_ddp.checkpoint import folder
    from dask_ddp.wire.errors import NotInRankError

    try:
        return folder.where(None, None).url_of(FOLDER)
    except (NotInRankError, ValueError):
        return None


def newest(directory: str | None) -> str:
    """The URL of the newest step committed in ``directory`` (:func:`job_directory`), "" where none."""
    steps = sharded.list_sharded(directory) if directory else []
    return steps[-1].url if steps else ""


def takes(strategy: Any) -> bool:
    """Whether ``strategy`` saves sharded (distributed) checkpoints that the route carries: Lightning's
    ``ModelParallelStrategy`` (FSDP2) with ``save_distributed_checkpoint=True`` (a module with more than one
    optimizer is refused at its first save, naming the rank)."""
    try:
        from lightning.pytorch.strategies import ModelParallelStrategy
    except ImportError:  # the older package name, or a Lightning without it
        return False
    return isinstance(strategy, ModelParallelStrategy) and bool(getattr(strategy, "_save_distributed_checkpoint",
                                                                        False))


class ShardedRoute:
    """The strategy's ``save_checkpoint``/``load_checkpoint``, for the route's names, through dask-ddp's DCP.

    Parameters
    ----------
    strategy
        The trainer's ``ModelParallelStrategy`` (see :func:`takes`).
    directory
        The URL of the job's sharded folder for this trainer (``<job folder>/lightning-sharded``).
    keep
        Committed steps kept (the newest).
    """

    def __init__(self, strategy: Any, directory: str, keep: int) -> None:
        self.strategy, self.directory, self.keep = strategy, directory, keep
        self._own_save, self._own_load = strategy.save_checkpoint, strategy.load_checkpoint
        strategy.save_checkpoint, strategy.load_checkpoint = self._save, self._load  # this instance only

    @staticmethod
    def name(step: int) -> str:
        """What the callback passes to ``trainer.save_checkpoint`` for a save of ``step``."""
        return f"{MARK}{step}"

    def _state(self) -> dict:
        optimizers = [getattr(o, "_optimizer", o) for o in self.strategy.optimizers]
        if len(optimizers) > 1:
            raise ValueError(f"rank {get_context().rank}: DaskDDPCallback carries sharded checkpoints of one "
                             f"optimizer; this LightningModule has {len(optimizers)}: return one from "
                             "configure_optimizers, or save with Lightning's own checkpoints (no DaskDDPCallback)")
        return {"model": self.strategy.model, **({"optim": optimizers[0]} if optimizers else {})}

    def _save(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        if not str(filepath).startswith(MARK):
            return self._own_save(checkpoint, filepath, storage_options)
        step = int(str(filepath)[len(MARK):])
        if any(s.step == step for s in sharded.list_sharded(self.directory)):
            return None  # this step is saved already (the epoch's end after a preemption's save at it)
        rest = {k: _plain(v) for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        sharded.save_sharded({**self._state(), "lightning": rest}, step, directory=self.directory, keep=self.keep)
        return None

    def _load(self, checkpoint_path: Any, weights_only: Any = None) -> dict:
        steps = {s.url: s.step for s in sharded.list_sharded(self.directory)}
        if str(checkpoint_path) not in steps:
            return self._own_load(checkpoint_path, weights_only)
        state = {**self._state(), "lightning": {}}
        sharded.load_sharded(state, directory=self.directory, step=steps[str(checkpoint_path)])
        log.info("dask-ddp: resumed Lightning from sharded step %d (%s)", steps[str(checkpoint_path)],
                 checkpoint_path)
        return dict(state["lightning"])


def _plain(value: Any) -> Any:
    """``value`` with every mapping a plain dict (Lightning's ``AttributeDict`` of hyperparameters, an
    ``OrderedDict``), lists and tuples walked: what ``weights_only=True`` reads back."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if type(value) in (list, tuple) else [_plain(v) for v in value]
    return value
