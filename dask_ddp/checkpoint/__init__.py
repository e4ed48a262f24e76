"""``dask_ddp.checkpoint``: the checkpoint wing and the public home of its functions.

Runs in: the rank process (and the client, given ``directory=``). Whole checkpoints (:mod:`.whole`:
``torch.save`` of a state, atomically, in a folder per job) and sharded checkpoints over torch DCP
(:mod:`.sharded`: FSDP2 and DDP, resharded on load).

May import: :mod:`dask_ddp.storage` and :mod:`dask_ddp.wire` (and :mod:`dask_ddp.config`). Never the
streaming loaders: what else rides in a save registers itself with the checkpoints.
"""

from dask_ddp.checkpoint.folder import job_folder
from dask_ddp.checkpoint.sharded.api import list_sharded, load_sharded, save_sharded, wait_sharded
from dask_ddp.checkpoint.sharded.export import export_sharded, read_sharded
from dask_ddp.checkpoint.sharded.writer import ShardError
from dask_ddp.checkpoint.whole import (
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "Checkpoint",
           "CheckpointError", "job_folder", "rng_state", "set_rng_state", "save_sharded", "load_sharded",
           "list_sharded", "wait_sharded", "ShardError", "export_sharded", "read_sharded"]
