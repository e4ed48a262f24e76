"""``dask_ddp.checkpoint``: the public home of the checkpoint functions.

Runs in: the rank process (and the client, given ``directory=``). The code lives in
:mod:`dask_ddp.data.checkpoint` (whole checkpoints: ``torch.save`` of a state) and
:mod:`dask_ddp.data.sharded` (sharded checkpoints over torch DCP: FSDP2 and DDP, resharded on load).
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
from dask_ddp.data.dcp_storage import ShardError
from dask_ddp.data.sharded import list_sharded, load_sharded, save_sharded, wait_sharded
from dask_ddp.data.sharded_export import export_sharded, read_sharded

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "Checkpoint",
           "CheckpointError", "job_folder", "rng_state", "set_rng_state", "save_sharded", "load_sharded",
           "list_sharded", "wait_sharded", "ShardError", "export_sharded", "read_sharded"]
