"""``run(..., accelerate_config="x.yaml")``: an ``accelerate config`` file applied to a job's ranks, as
``accelerate launch --config_file x.yaml`` would apply it.

Runs in: the client (``dispatch.run``), which needs Accelerate installed for this option only.

``accelerate launch`` turns the file (mixed precision, FSDP, gradient accumulation, dynamo, ...) into environment
variables its launcher gives every process (``ACCELERATE_*``, ``FSDP_*``), which ``Accelerator()`` and
Transformers' ``Trainer`` read. Here Accelerate's own launch code makes those variables from the file; the job's
ranks get the ones that configure Accelerate. The rest of what the launcher sets (the rendezvous: ranks, world size,
master address and port; thread counts) is dask-ddp's, as for every job. A DeepSpeed, TPU or SageMaker file is
refused: dask-ddp launches neither.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["accelerate_environment", "KEPT_PREFIXES"]

KEPT_PREFIXES = ("ACCELERATE_", "FSDP_", "MEGATRON_LM_", "PARALLELISM_CONFIG_")  # what configures Accelerate


def accelerate_environment(path: Any, world_size: int) -> dict[str, str]:
    """The variables ``accelerate launch --config_file path`` gives its processes that configure Accelerate, for
    a job of ``world_size`` ranks. Its "not on the CPU" (``ACCELERATE_USE_CPU=False``, the launcher's default) is
    left out: a rank without a GPU says true (:mod:`dask_ddp.rank.trainers`).

    Raises
    ------
    ImportError
        Accelerate is not installed where ``run`` is called.
    FileNotFoundError
        No file at ``path``.
    ValueError
        The file is not an ``accelerate config`` file Accelerate reads, or asks for what dask-ddp does not launch
        (DeepSpeed, TPU, SageMaker).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"run(accelerate_config={path!r}): no such file (write one with `accelerate config "
                                "--config_file FILE`)")
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser  # type: ignore[import-untyped]
        from accelerate.utils.launch import (  # type: ignore[import-untyped]
            prepare_multi_gpu_env,
            prepare_simple_launcher_cmd_env,
        )
    except ImportError as e:
        raise ImportError("run(accelerate_config=...) needs Accelerate where run is called: pip install "
                          "'dask-ddp[accelerate]'") from e
    parser = launch_command_parser()
    try:
        args = parser.parse_args(["--config_file", path, "--num_processes", str(world_size),
                                  "--main_process_port", "29500", "dask-ddp-job.py"])
        args, _, _ = _validate_launch_command(args)  # the file's values, as `accelerate launch` reads them
    except SystemExit as e:  # argparse's way to fail
        raise ValueError(f"run(accelerate_config={path!r}): Accelerate cannot read it as a launch config") from e
    except Exception as e:  # noqa: BLE001 - Accelerate's own checks of the file's values
        raise ValueError(f"run(accelerate_config={path!r}): {e}") from e
    if args.use_deepspeed or args.tpu or getattr(args, "tpu_use_cluster", False):
        raise ValueError(f"run(accelerate_config={path!r}) asks for DeepSpeed or a TPU, which dask-ddp does not "
                         "launch: use a config of the multi-GPU, FSDP or CPU kind")
    args.main_process_port = 29500  # never used: the rendezvous is dask-ddp's (its variables are not kept)
    if (args.use_fsdp or args.multi_gpu or args.use_megatron_lm) and not args.cpu:
        env = _quiet(lambda: prepare_multi_gpu_env(args))
    else:
        env = _quiet(lambda: prepare_simple_launcher_cmd_env(args)[1])
    kept = {k: str(v) for k, v in env.items() if k.startswith(KEPT_PREFIXES) and os.environ.get(k) != v}
    if kept.get("ACCELERATE_USE_CPU", "").lower() in ("false", "0", "no"):
        del kept["ACCELERATE_USE_CPU"]
    return kept


def _quiet(make: Any) -> dict:
    """``make()`` with Accelerate's launch warnings (a port in use: not ours to use) silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(make())

