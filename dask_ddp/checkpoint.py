"""``dask_ddp.checkpoint``: the public home of the checkpoint functions.

Runs in: the rank process (and the client, given ``directory=``). The code lives in
:mod:`dask_ddp.data.checkpoint`.
"""

from dask_ddp.data.checkpoint import (
    Checkpoint,
    CheckpointError,
    job_folder,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "Checkpoint",
           "CheckpointError", "job_folder", "rng_state", "set_rng_state"]
