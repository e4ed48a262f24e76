"""Lightning, Hugging Face Transformers and Accelerate, unchanged: their defaults train distributed in a rank.

Runs in: the rank process, once it has joined its group and before the job's function (:func:`prepare`); the rules
are pure functions (:func:`environment`, :func:`lightning_topology`).

What each library reads at start, and what a rank of dask-ddp sets so that its defaults are right (a variable the
worker's own environment already sets is left as it is):

- **Accelerate and Transformers' ``Trainer``** go distributed on CPUs only when asked (``Accelerator(cpu=True)``,
  ``TrainingArguments(use_cpu=True)``): without it, on a rank with no GPU, each rank trains alone on the same
  samples, and nothing says so (under torchrun too). Both also read ``ACCELERATE_USE_CPU``, which a rank without a
  GPU gets. A rank with a GPU needs nothing: both take ``cuda:LOCAL_RANK``, the rank's own GPU
  (:mod:`dask_ddp.rank.devices`), and find the process group already made.
- **Lightning** takes the ranks from torchrun's variables (its ``TorchElasticEnvironment``), but its own
  ``devices`` and ``num_nodes`` must say the same: with its defaults (one device, one node) it trains each rank
  alone, and a mismatch fails. ``PL_TRAINER_DEVICES`` and ``PL_TRAINER_NUM_NODES``, Lightning's defaults for
  those two arguments, say ranks per host and hosts, as under torchrun (:func:`lightning_topology`); so do
  ``LT_DEVICES`` and ``LT_NUM_NODES`` for Fabric (what its command line sets; they take the place of a
  ``Fabric(devices=...)`` of the code's own).
- **SLURM**: a Dask worker started by dask-jobqueue or ``dask-ddp slurm`` carries its allocation's task variables
  (``SLURM_NTASKS``, ``SLURM_PROCID``, ...). Lightning would take its ranks from those (its ``SLURMEnvironment``
  comes first), and they describe the Dask workers, not the job's ranks: a rank's environment has none of them
  (:data:`SLURM_TASK_VARIABLES`; the job and node variables stay).

Where a trainer still runs undistributed (Accelerate's or Transformers' world differs from the job's: a
``ACCELERATE_USE_CPU=false`` of the worker's, say), or without the FSDP it was asked for (Accelerate drops FSDP on
CPUs), rank 0 logs a warning saying what to change (:func:`watch`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable, Mapping

__all__ = ["SLURM_TASK_VARIABLES", "environment", "fsdp_dropped", "lightning_topology", "prepare", "undistributed",
           "watch"]

log = logging.getLogger("dask_ddp")

SLURM_TASK_VARIABLES = ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                        "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE",
                        "SLURM_TASKS_PER_NODE")
WATCH_EVERY = 1.0  # seconds between looks for a trainer that runs undistributed


def lightning_topology(world_size: int, local_world_size: int, num_nodes: int, gpu: bool) -> tuple[int, int] | None:
    """Lightning's ``(devices, num_nodes)`` for a rank; None where no pair is right (uneven hosts with GPUs); pure.

    Lightning checks ``devices * num_nodes == world size`` and takes the rank's device as ``devices[LOCAL_RANK]``,
    so ``devices`` must exceed every local rank. Ranks per host and hosts, as torchrun has them, where the hosts hold
    as many ranks each. On uneven hosts a CPU rank says ``(world_size, 1)`` (every device is the CPU; the sampler's
    ``num_replicas`` is the world size either way); a GPU rank cannot (Lightning checks that the host has as many
    GPUs), so there is no pair.
    """
    if local_world_size * num_nodes == world_size:
        return local_world_size, num_nodes
    return None if gpu else (world_size, 1)


def environment(world_size: int, local_world_size: int, num_nodes: int, gpu: bool,
                environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """What a rank sets and removes in its environment for the trainers: ``(put, drop)``; pure.

    ``put`` leaves out the variables ``environ`` already has (the worker's own choice stands); ``drop`` is the
    SLURM task variables ``environ`` has.
    """
    put: dict[str, str] = {}
    if not gpu:
        put["ACCELERATE_USE_CPU"] = "true"
    pair = lightning_topology(world_size, local_world_size, num_nodes, gpu)
    if pair is not None:
        put["PL_TRAINER_DEVICES"], put["PL_TRAINER_NUM_NODES"] = str(pair[0]), str(pair[1])
        put["LT_DEVICES"], put["LT_NUM_NODES"] = str(pair[0]), str(pair[1])  # Fabric's
    return ({k: v for k, v in put.items() if k not in environ}, [k for k in SLURM_TASK_VARIABLES if k in environ])


def prepare(ctx) -> None:
    """Set this rank's environment for the trainers (:func:`environment`) and start :func:`watch` on rank 0.
    ``ctx`` is the rank's :class:`~dask_ddp.rank.context.Context`. Raises nothing."""
    gpu = getattr(ctx.device, "type", str(ctx.device)) != "cpu"
    put, drop = environment(ctx.world_size, ctx.local_world_size, ctx.num_nodes, gpu, os.environ)
    os.environ.update(put)
    for name in drop:
        os.environ.pop(name, None)
    if gpu and lightning_topology(ctx.world_size, ctx.local_world_size, ctx.num_nodes, gpu) is None and ctx.rank == 0:
        log.warning("dask-ddp: the job's hosts hold unequal numbers of ranks, and Lightning on GPUs needs as many on "
                    "each (devices x num_nodes = world size): PL_TRAINER_DEVICES is not set. Choose workers with "
                    "as many per host (workers=[...]) for a Lightning job.")
    if ctx.rank == 0:
        watch(ctx.world_size)


def undistributed(world_size: int) -> str | None:
    """What to change, if the Accelerate state of this process (Accelerate's, or the one Transformers' ``Trainer``
    made) runs in a world other than the job's ``world_size``; None where it does not, or none exists yet."""
    seen = _read_state(lambda state: state.PartialState().num_processes)  # made already: only its shared state
    if seen is None or seen == world_size:
        return None
    return (f"dask-ddp: Accelerate (or Transformers' Trainer) runs with {seen} process(es), but the job has "
            f"{world_size} ranks: each rank trains alone, on the same samples. On CPU workers, leave "
            "ACCELERATE_USE_CPU unset in the workers' environment (dask-ddp sets it to true), or pass "
            "Accelerator(cpu=True) / TrainingArguments(use_cpu=True).")


def fsdp_dropped() -> str | None:
    """What to know, if this process's Accelerate was asked for FSDP (``ACCELERATE_USE_FSDP``: an ``accelerate
    config`` file of the FSDP kind, ``run(accelerate_config=...)``, or a plugin in the code, Transformers'
    ``TrainingArguments(fsdp=...)`` too) but made its state without it: Accelerate takes FSDP on GPUs (and other
    accelerators) only; on CPUs it wraps the model in DDP, every rank holding all of it, and says nothing. None
    where it was not asked, or took it, or no state exists yet."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("1", "true", "yes"):
        return None
    kind = _read_state(lambda state: state.AcceleratorState._shared_state.get("distributed_type"))
    if kind is None or getattr(kind, "value", kind) == "FSDP":
        return None
    return (f"dask-ddp: Accelerate (or Transformers' Trainer) was asked for FSDP but trains with {kind}: Accelerate "
            "uses FSDP on GPUs only, and on CPU workers it keeps the whole model on every rank, without a word. "
            "Run the job on GPU workers for FSDP, or leave FSDP out of the config on CPUs.")


def _read_state(read: Callable[[Any], Any]) -> Any:
    """``read(accelerate.state)`` once this process's Accelerate state exists (Accelerate's, or the one
    Transformers' ``Trainer`` made); None before it does. Never imports Accelerate, never fails: an Accelerate
    other than the one this was written for reads None (no warning)."""
    state = sys.modules.get("accelerate.state")
    try:
        return read(state) if state is not None and state.is_initialized() else None
    except Exception:  # noqa: BLE001 - another Accelerate than this was written for: no warning, never a failure
        return None


def watch(world_size: int, every: float = WATCH_EVERY) -> threading.Thread:
    """Look every ``every`` seconds, from a daemon thread, for a trainer that runs undistributed
    (:func:`undistributed`) or without the FSDP it was asked for (:func:`fsdp_dropped`); log each warning once.
    Raises nothing."""
    def loop():
        stop, checks = threading.Event(), [lambda: undistributed(world_size), fsdp_dropped]
        while checks and not stop.wait(every):
            for check in list(checks):
                message = check()
                if message:
                    log.warning(message)
                    checks.remove(check)
    thread = threading.Thread(target=loop, name="dask-ddp-trainer-watch", daemon=True)
    thread.start()
    return thread
