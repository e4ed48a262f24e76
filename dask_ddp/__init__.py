"""dask-ddp: PyTorch DistributedDataParallel on any Dask cluster, in one call from a notebook.

Runs in: the client (``dispatch``, ``Job``, sinks) and the rank process (``get_context``,
``report``, checkpoints, ``S3ImageFolder``). Every rank process imports this package,
so it imports neither torch nor the client's machinery until they are used.

>>> job = dask_ddp.dispatch.run(client, train, 3, lr=0.1)   # doctest: +SKIP
>>> job.result()                                            # doctest: +SKIP
>>> s = dask_ddp.sweep(client, train, {"lr": {"low": 1e-4, "high": 0.1, "log": True}},
...                    n_trials=20, metric="loss")                # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING, Any

from dask_ddp import config  # noqa: F401 - loads ddp.yaml into dask.config
from dask_ddp.checkpoint.sharded.api import load_sharded, save_sharded, wait_sharded
from dask_ddp.checkpoint.sharded.writer import ShardError
from dask_ddp.checkpoint.whole import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dask_ddp.observe.sinks import CSVSink, JSONLinesSink, TensorBoardSink, plot_metrics
from dask_ddp.rank.context import (
    Context,
    all_reduce_mean,
    get_context,
    rank_zero_first,
    seed_everything,
)
from dask_ddp.rank.fsdp import device_mesh, shard_model
from dask_ddp.rank.live import LiveRecoveryError, LiveStep, live_steps
from dask_ddp.rank.preemption import Preempted, on_preemption, preempted
from dask_ddp.rank.reporting import report
from dask_ddp.rank.telemetry import timed
from dask_ddp.wire.errors import (
    ClientClosedError,
    DaskDDPError,
    DaskDDPWarning,
    JobCancelledError,
    NotInRankError,
    PlanError,
    RankExitError,
    RankFailedError,
    RendezvousError,
    SerializationError,
    StallError,
    WorkerLostError,
)

# The one place of the version: pyproject.toml reads it (setuptools dynamic), `dask-ddp --version` shows it.
__version__ = "0.1.0"

# Imported on first use. torchvision (and so torch) takes seconds to import, and the first task of a job
# imports this package on the Dask worker's event loop, whose heartbeats would stop meanwhile. The client's
# side (distributed's client, pandas) takes most of a second, and every rank process imports this package.
_LAZY = {"S3ImageFolder": "data.image_folder", "ImageDecodeError": "data.image_folder", "Job": "client.job",
         "dispatch": None, "checkpoint": None, "data": None, "compat": None, "attach": "client.detach",
         "DetachedJobNotFound": "client.detach", "MLflowSink": "observe.mlflow_sink", "sweep": "sweeps.handle",
         "Sweep": "sweeps.handle", "attach_sweep": "sweeps.handle",
         "SweepNotFound": "sweeps.detach", "slurm_options": "client.slurm"}


if TYPE_CHECKING:  # what a type checker and an editor see; at run time they come from __getattr__
    from dask_ddp import checkpoint, compat, data, dispatch  # noqa: F401 - public modules, not in __all__
    from dask_ddp.client.detach import DetachedJobNotFound, attach
    from dask_ddp.client.job import Job
    from dask_ddp.data.image_folder import ImageDecodeError, S3ImageFolder
    from dask_ddp.observe.mlflow_sink import MLflowSink
    from dask_ddp.sweeps.detach import SweepNotFound
    from dask_ddp.sweeps.handle import Sweep, attach_sweep, sweep


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dask_ddp' has no attribute {name!r}")

__all__ = [
    "dispatch", "attach", "DetachedJobNotFound", "Job", "S3ImageFolder", "save_checkpoint", "load_checkpoint",
    "latest_checkpoint", "rng_state",
    "set_rng_state", "Context", "get_context", "report", "rank_zero_first", "seed_everything",
    "all_reduce_mean", "DaskDDPError", "PlanError", "SerializationError", "RankFailedError", "RankExitError",
    "WorkerLostError",
    "StallError", "JobCancelledError", "RendezvousError", "NotInRankError", "ClientClosedError",
    "CheckpointError", "ImageDecodeError", "JSONLinesSink", "CSVSink", "TensorBoardSink", "plot_metrics", "timed",
    "MLflowSink", "DaskDDPWarning",
    "Preempted", "preempted", "on_preemption", "sweep", "Sweep", "attach_sweep", "SweepNotFound",
    "slurm_options", "save_sharded", "load_sharded",
    "wait_sharded", "ShardError", "device_mesh", "shard_model", "live_steps", "LiveStep", "LiveRecoveryError",
]
