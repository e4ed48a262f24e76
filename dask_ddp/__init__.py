"""dask-ddp: PyTorch DistributedDataParallel on any Dask cluster, in one call from a notebook.

>>> job = dask_ddp.dispatch.run(client, train, 3, lr=0.1)   # doctest: +SKIP
>>> job.result()                                            # doctest: +SKIP
"""

from . import config  # noqa: F401 - loads ddp.yaml into dask.config
from . import dispatch
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .context import Context, all_reduce_mean, get_context, rank_zero_first, seed_everything
from .errors import (
    ClientClosedError,
    DaskDDPError,
    JobCancelledError,
    NotInRankError,
    PlanError,
    RankFailedError,
    RendezvousError,
    SerializationError,
    StallError,
    WorkerLostError,
)
from .job import Job
from .reporting import report
from .sinks import CSVSink, JSONLinesSink, TensorBoardSink, plot_metrics

__version__ = "0.1.0"

# Imported on first use: torchvision (and so torch) takes seconds to import, and the first task of a job
# imports this package on the Dask worker's event loop, whose heartbeats would stop meanwhile.
_LAZY = {"S3ImageFolder": "data", "ImageDecodeError": "data"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dask_ddp' has no attribute {name!r}")

__all__ = [
    "dispatch", "Job", "S3ImageFolder", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state",
    "set_rng_state", "Context", "get_context", "report", "rank_zero_first", "seed_everything",
    "all_reduce_mean", "DaskDDPError", "PlanError", "SerializationError", "RankFailedError", "WorkerLostError",
    "StallError", "JobCancelledError", "RendezvousError", "NotInRankError", "ClientClosedError",
    "CheckpointError", "ImageDecodeError", "JSONLinesSink", "CSVSink", "TensorBoardSink", "plot_metrics",
]
