"""Hugging Face's ``Trainer`` in a dask-ddp job, one line: ``Trainer(..., callbacks=[DaskDDPCallback()])``.

Runs in: the rank process (the callback's hooks, inside ``trainer.train()``). Importing this module imports
Transformers; importing dask-ddp does not.

What the callback does, with ``trainer.train()`` unchanged:

- **metrics**: every ``logs`` the trainer logs (``logging_steps``: loss, learning rate, grad norm, eval metrics)
  goes to ``report()`` at ``step=state.global_step`` from every rank (the trainer averages the loss over the
  ranks first): rows in ``job.metrics``, the live view and the sinks;
- **checkpoints**: the trainer writes its own ``checkpoint-<N>`` folders in ``output_dir`` (``save_steps``,
  ``save_total_limit`` as set; nothing is copied). Once every rank has written its part, rank 0 registers the
  folder in the job (one small file written atomically: ``transformers.json`` in the job's checkpoint folder,
  or ``.dask-ddp-<run id>.json`` in ``output_dir`` for a job without ``checkpoint_dir``): a folder a crash left
  half-written is never registered;
- **resume**: in the job's next attempt (a restart, an elastic resize) the first ``trainer.train()`` resumes from
  the registered checkpoint: the callback passes it as ``resume_from_checkpoint`` where the call gives none (the
  trainer's weights, optimizer, scheduler, RNG states, step and data position); a first attempt, and a second
  ``train()`` in one attempt, start as they would without it;
- **preemption**: at the step every rank agreed to stop at (see :func:`dask_ddp.on_preemption`) the trainer saves
  a checkpoint there, registered as above, and the job restarts from it: no step lost.

``output_dir`` must be a folder every worker can read (a shared filesystem) for a rank restarted on another host
to resume. Outside a dask-ddp rank the callback does nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import transformers
from transformers import TrainerCallback

from dask_ddp.checkpoint.folder import atomic_write, put, where
from dask_ddp.integrations.steps import StepPoint, job_subfolder
from dask_ddp.rank.context import get_context

__all__ = ["DaskDDPCallback"]


class DaskDDPCallback(TrainerCallback):
    """Metrics to ``report()``, checkpoints registered in the job, resume after a restart, a save at a preemption.

    Raises nothing of its own: what the trainer's save raises, and :class:`dask_ddp.Preempted` at the agreed
    step of a preemption (after the save).
    """

    def __init__(self) -> None:
        self.point = StepPoint()
        self.due: Any = None

    # ---- the registry: which checkpoint-N of output_dir this job resumes from ------------------------------
    def _registry(self, args: Any) -> tuple[Any, str] | None:
        if not self.point.in_rank:
            return None
        found = job_subfolder("transformers.json")
        if found is not None:
            return found
        return None, os.path.join(args.output_dir, f".dask-ddp-{get_context().run_id}.json")

    def registered(self, args: Any) -> str | None:
        """The checkpoint this job's next ``train()`` resumes from, None where none was registered."""
        registry = self._registry(args)
        if registry is None:
            return None
        fs, path = registry
        try:
            if fs is not None:
                data = fs.cat_file(path)
            else:
                with open(path, "rb") as f:
                    data = f.read()
        except OSError:  # none registered yet (FileNotFoundError), or unreadable: start afresh
            return None
        found = json.loads(data)["checkpoint"]
        return found if os.path.isdir(found) else None

    def _register(self, args: Any, state: Any) -> None:
        registry = self._registry(args)
        if registry is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank's part of the checkpoint (its RNG state) is written
        if not state.is_world_process_zero:
            return
        checkpoint = os.path.abspath(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        data = json.dumps({"checkpoint": checkpoint, "step": state.global_step}).encode()
        fs, path = registry
        if fs is None:
            atomic_write(path, data)
        else:  # the job's folder: a local file atomically, an object in one PUT
            put(where(None, None), "transformers.json", data)

    # ---- the hooks ----------------------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is None or not self.point.in_rank:
            return
        train = trainer.train

        first = [get_context().restart_count > 0]  # a later attempt's first train() resumes; no other call does

        @functools.wraps(train)
        def train_resumed(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
            if resume_from_checkpoint is None and first[0]:
                resume_from_checkpoint = self.registered(trainer.args)
            first[0] = False
            return train(resume_from_checkpoint, *a, **kw)

        trainer.train = train_resumed  # this trainer only: its class is left as it was

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if control.should_log:  # on_log reports this step (and passes its preemption point)
            return control
        return self._passed(state.global_step, None, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        return self._passed(state.global_step, logs or {}, control)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._register(args, state)
        if self.due is not None:
            raise self.due
        return control

    def _passed(self, step: int, logs: Any, control: Any) -> Any:
        due = self.point.at(step, logs)
        if due is not None and self.due is None:
            self.due = due
            control.should_save = True  # the trainer saves at this step; on_save then raises
        return control


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` calls this hook (``on_init_end`` is called from it)."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None
