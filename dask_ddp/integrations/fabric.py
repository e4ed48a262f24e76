"""Lightning Fabric's checkpoints in a dask-ddp job: ``DaskDDPCheckpoints(fabric)``, saved, kept, resumed, preempted.

Runs in: the rank process (the calls of the Fabric loop). Importing this module imports no Lightning: the helper
is handed the loop's ``Fabric`` and calls its methods; importing dask-ddp imports neither.

Fabric has no callbacks of its own loop (``DaskDDPLogger`` gives its metrics), so the loop calls the helper, twice:

.. code-block:: python

    ckpt = DaskDDPCheckpoints(fabric, every=100, keep=2)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    start = ckpt.resume(state)                 # 0 in a first attempt
    for step in range(start, total):
        ...                                    # one optimizer step
        ckpt.step(step + 1, state)             # steps done so far

- **checkpoints**: every ``every`` steps, ``fabric.save`` writes ``state`` to ``fabric/step-<N>.ckpt`` in the
  job's checkpoint folder (``run(..., checkpoint_dir=...)``), under a temporary name renamed once whole; the
  newest ``keep`` stay. Fabric's own save and load are the ones called, so a strategy keeps its own format (FSDP's
  sharded folders too);
- **resume**: in the job's next attempt (a restart, an elastic resize) ``resume`` loads the newest of them into
  ``state`` with ``fabric.load`` and returns its step; in a first attempt it loads nothing and returns 0;
- **preemption**: ``step`` is the preemption protocol's point (see :func:`dask_ddp.on_preemption`); at the step
  every rank agreed to stop at it saves there and raises :class:`dask_ddp.Preempted`, and the job restarts from
  that save: no step lost. A ``report()`` of the same step before it (``DaskDDPLogger``'s) may be the point that
  agreed; the save is then this call's.

A job started without ``checkpoint_dir`` saves nothing (a warning on rank 0 says so once) and resumes from 0.
Outside a dask-ddp rank the helper does nothing: ``resume`` returns 0 and ``step`` saves nothing.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from dask_ddp.checkpoint.folder import check_int
from dask_ddp.integrations.steps import StepPoint, by_step, job_subfolder, newest
from dask_ddp.rank import preemption
from dask_ddp.rank.context import get_context

__all__ = ["DaskDDPCheckpoints"]

log = logging.getLogger("dask_ddp")
PREFIX, SUFFIX = "step-", ".ckpt"
_FABRIC_METHODS = ("save", "load", "broadcast", "barrier")


class DaskDDPCheckpoints:
    """Fabric's checkpoints in the job's folder: every ``every`` steps, the newest ``keep``, resumed after a restart,
    saved at a preemption's agreed step. Every rank makes one with its ``Fabric`` and calls it at the same steps.

    Parameters
    ----------
    fabric
        The loop's ``lightning.Fabric`` (launched): its ``save``, ``load``, ``broadcast`` and ``barrier`` are used.
    every
        Save every this many steps (at the steps ``step`` is called with that are multiples of it).
    keep
        How many checkpoints stay (the newest).

    Raises
    ------
    TypeError
        ``fabric`` lacks Fabric's methods, or ``every``/``keep`` is not an int; the message names the rank.
    ValueError
        ``every`` or ``keep`` is below 1; the message names the rank.
    """

    def __init__(self, fabric: Any, *, every: int = 100, keep: int = 2) -> None:
        self.point = StepPoint()
        missing = [m for m in _FABRIC_METHODS if not callable(getattr(fabric, m, None))]
        if missing:
            raise TypeError(f"{self._who()}: fabric must be a lightning.Fabric, got {type(fabric).__name__} "
                            f"(without {', '.join(missing)})")
        self._check("every", every, 1)
        self._check("keep", keep, 1)
        self.fabric, self.every, self.keep = fabric, every, keep
        self.folder = job_subfolder("fabric")
        self._warned = False

    def resume(self, state: dict[str, Any]) -> int:
        """In the job's later attempts: load the newest checkpoint into ``state`` (``fabric.load(path, state)``:
        modules and optimizers in place, the other entries replaced) and return its step; else load nothing and
        return 0 (a first attempt, no checkpoint yet, a job without ``checkpoint_dir``, outside a rank). Every
        rank calls it (Fabric's load is a collective).

        Raises
        ------
        KeyError, RuntimeError
            What ``fabric.load`` raises for a checkpoint that does not fit ``state`` (Fabric loads strictly).
        """
        if self.folder is None or get_context().restart_count == 0:
            return 0
        found = newest(*self.folder, PREFIX, SUFFIX)
        if found is None:
            return 0
        step, path = found
        self.fabric.load(_url(self.folder[0], path), state)
        log.info("dask-ddp: resumed from %s (step %d)", path, step)
        return step

    def step(self, step: int, state: dict[str, Any]) -> bool:
        """Pass the end of step ``step`` (the steps done so far) with the loop's ``state``: save it when ``step``
        is a multiple of ``every``, or at the step every rank agreed to stop at for a preemption. Every rank calls
        it at every step (the save is a collective, and so is the protocol). Returns whether it saved.

        Raises
        ------
        Preempted
            At the agreed step of a preemption, after the save: let it propagate, the job restarts from the save.
        TypeError, ValueError
            ``step`` is not an int, or is negative; the message names the rank.
        """
        self._check("step", step, 0)
        due = preemption.preempted() if self.point.in_rank else None  # a report() of this step agreed already
        if due is None:
            due = self.point.at(step)
        if due is not None:
            self.save(step, state)
            raise due
        if step % self.every:
            return False
        return self.save(step, state)

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Save ``state`` now as ``step-<step>.ckpt``, whole or not at all (``fabric.save`` to a temporary name,
        then rank 0 renames it, over a checkpoint of the same step, and removes the oldest past ``keep``). Every
        rank calls it. Returns False, having saved nothing, in a job without ``checkpoint_dir`` and outside a
        rank.

        Raises
        ------
        OSError
            What ``fabric.save`` and the job's storage raise (a full disk, no permission).
        """
        if self.folder is None:
            self._warn_once()
            return False
        fs, path = self.folder
        token = self.fabric.broadcast(uuid.uuid4().hex[:8])  # one temporary name for every rank's part
        tmp = f"{path}/.{PREFIX}{step}{SUFFIX}.{token}.tmp"
        if self.fabric.global_rank == 0:
            fs.makedirs(path, exist_ok=True)
        self.fabric.save(_url(fs, tmp), state)  # a collective: every rank's part is written when it returns
        if self.fabric.global_rank == 0:
            final = f"{path}/{PREFIX}{step}{SUFFIX}"
            if fs.exists(final):  # this step saved again (the loop's own last save): a folder would take it inside
                fs.rm(final, recursive=True)
            fs.mv(tmp, final, recursive=True)
            self._prune(fs, path)
        self.fabric.barrier()
        return True

    # ---- its own parts ------------------------------------------------------------------------------------
    def _prune(self, fs: Any, path: str) -> None:
        """Remove the checkpoints past the newest ``keep``, and the temporary ones a killed attempt left (only one
        save of a job runs at a time, and this one's is renamed)."""
        for _, old in by_step(fs, path, PREFIX, SUFFIX)[:-self.keep]:
            fs.rm(old, recursive=True)
        for entry in fs.ls(path, detail=False):
            name = os.path.basename(entry.rstrip("/"))
            if name.startswith(f".{PREFIX}") and name.endswith(".tmp"):
                fs.rm(entry, recursive=True)

    def _who(self) -> str:
        return f"DaskDDPCheckpoints on rank {get_context().rank}" if self.point.in_rank else "DaskDDPCheckpoints"

    def _check(self, what: str, value: Any, low: int) -> None:
        try:
            check_int(what, value, low)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{self._who()}: {err}") from None

    def _warn_once(self) -> None:
        if not self._warned and self.point.in_rank and self.fabric.global_rank == 0:
            log.warning("dask-ddp: DaskDDPCheckpoints saves no checkpoints: this job was started without "
                        "run(..., checkpoint_dir=...), so a restart starts training again from the beginning")
        self._warned = True


def _url(fs: Any, path: str) -> str:
    """``path`` of ``fs`` as Fabric's save and load take it: a local path as it is, a remote one with its protocol
    (Fabric opens it with fsspec; without the protocol it would be a local path)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return path if "file" in protocols else fs.unstrip_protocol(path)
