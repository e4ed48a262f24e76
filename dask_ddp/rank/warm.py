"""What every rank needs before its job, done once where ranks come from, so that no job waits for it.

Runs in: the zygote (:mod:`dask_ddp.rank.zygote`), before it says it is ready, and a spawned rank process
(``ddp.zygote: false``) before its Ready. A rank forked from the zygote inherits all of it.

Measured per rank start on the 2-core development box (torch 2.14, 274 installed distributions), before this
was done in the zygote: torch's registration of its built-in backends 28 ms of CPU, the modules a job's start imports
(the telemetry's collectives, the ``idna`` codec of the first socket call given a host name) 10-15 ms.
Nothing here initialises CUDA or starts a thread (the zygote forks: see its module docstring).
"""

from __future__ import annotations

import logging
import os

__all__ = ["warm_imports", "register_backends", "warm_cuda", "preload", "PRELOADED", "PRELOAD_FAILED"]

logger = logging.getLogger("dask_ddp")
WARMED = False  # this rank process started CUDA before its job (warm_cuda): read by tests
PRELOADED: list[str] = []  # the modules of ddp.zygote-preload this process imported before its job
PRELOAD_FAILED: dict[str, str] = {}  # module -> why its import failed


def warm_imports() -> None:
    """Import what every job needs: torch, its distributed package, DDP, ``torch._dynamo`` (which DDP's first
    construction imports), what a job's start imports lazily; and register torch's built-in backends
    (:func:`register_backends`). Never initialises CUDA. Raises what ``import torch`` raises."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401 - DistributedDataParallel
    try:  # DDP's first construction imports torch._dynamo: seconds that a job would otherwise wait for
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass
    import encodings.idna  # noqa: F401 - the codec of a host name, imported at the first socket call given one

    from dask_ddp.rank import collectives  # noqa: F401 - the telemetry sampler's, imported at each job's start

    register_backends()
    preload()


def preload(names: str | None = None) -> list[str]:
    """Import the modules of ``ddp.zygote-preload`` (``names``: comma-separated; default: the environment's
    ``DASK_DDP_PRELOAD``, which the worker sets), so that a job that imports them pays nothing for it; return those
    imported. A module that fails to import is recorded in :data:`PRELOAD_FAILED` (the job's history says why) and
    the others go on: a job that needs it fails at its own import, with its own error. Raises nothing."""
    import importlib

    from dask_ddp.wire.task import PRELOAD_VARIABLE

    wanted = os.environ.get(PRELOAD_VARIABLE, "") if names is None else names
    for name in filter(None, (n.strip() for n in wanted.split(","))):
        if name in PRELOADED or name in PRELOAD_FAILED:
            continue
        try:
            importlib.import_module(name)
            PRELOADED.append(name)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a module's SystemExit too: the process must live
            PRELOAD_FAILED[name] = f"{type(e).__name__}: {e}"[:300]
            logger.warning("dask-ddp: ddp.zygote-preload: %s did not import (%s)", name, PRELOAD_FAILED[name])
    return list(PRELOADED)


def register_backends(names: tuple[str, ...] = ("gloo", "nccl")) -> bool:
    """Have torch register its built-in backends ``names`` now, as its first ``init_process_group`` would; True if
    it did.

    torch 2.14 registers even its built-in backends through entry points (``torch.distributed.backends``): the
    first process group of a process reads the entry points of every installed distribution to find the
    registrar (28 ms of CPU here, 274 distributions), and every rank forked from the zygote was such a first.
    Registered here, in the zygote, the ranks find them registered. Registration only records the backend's
    constructor (no CUDA, no thread). Where torch has no such step (another version), nothing is done. Raises
    nothing.
    """
    try:
        from torch.distributed import distributed_c10d as c10d

        ensure = getattr(c10d.Backend, "_ensure_backend_registered", None)  # private: guarded
        if ensure is None:
            return False
        for name in names:
            ensure(name)
    except Exception:  # noqa: BLE001 - an optional speed-up only: torch registers them at the first group then
        logger.debug("dask-ddp: torch's backends were not registered in advance", exc_info=True)
        return False
    return True


def warm_cuda() -> bool:
    """Start CUDA on device 0 (its context and cuBLAS) in a rank forked ahead of its job, never in the zygote: the
    job then does not wait for them (0.25-0.3 s on an H200, ``benchmarks/gpu_turnover_parts.py``). Asked for with
    ``ddp.warm-cuda`` (sweeps' trials); only for a job whose rank is alone on its host, whose own GPU is device 0
    as it is (ranks sharing a host re-list ``CUDA_VISIBLE_DEVICES`` before CUDA starts: they get a fresh fork).
    True if CUDA started; False without a GPU or on any error (the job meets it itself). Raises nothing."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # the context
        torch.cuda.current_blas_handle()  # cuBLAS loaded and its handle made: a first matmul's start
        global WARMED
        WARMED = True
    except Exception:  # noqa: BLE001 - an optional speed-up only
        logger.debug("dask-ddp: CUDA was not started ahead of the job", exc_info=True)
        return False
    return True
