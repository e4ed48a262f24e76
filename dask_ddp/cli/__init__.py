"""Runs in: the user's shell (the ``dask-ddp`` command, or ``python -m dask_ddp.cli``).

``dask-ddp run`` runs torchrun-style scripts on a Dask cluster
(:mod:`.run`, with the script runner in :mod:`.script` and the modules that
ship beside the script in :mod:`.siblings`); ``dask-ddp demo`` trains a CNN
on digits read from S3 (:mod:`.demo`); ``dask-ddp slurm``, inside an sbatch
script, starts the cluster with srun and runs a script as ``run`` does
(:mod:`.slurm`); ``dask-ddp export`` writes a sharded checkpoint as one file
(:mod:`.export`); :mod:`.common` holds what they share. Imports go one way:
this module -> slurm -> run, demo, export -> common, script -> siblings.

Exit codes: 0 success; 1 the job failed (the root cause and its traceback on
stderr) or the scheduler could not be reached; 2 usage errors (bad options,
no such script, a script that does not compile, more workers asked for than
the cluster has); 130 interrupted (Ctrl-C: the job is cancelled first).

Importing this package is light (no torch, no distributed): the ranks of
``dask-ddp run`` import it to unpickle :func:`.script.run_script`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from dask_ddp import __version__
from dask_ddp.cli import demo, export, run, slurm
from dask_ddp.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    open_client,
)

__all__ = ["main", "build_parser", "open_client", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED"]

_DESCRIPTION = """\
PyTorch DistributedDataParallel on any Dask cluster.

  dask-ddp run    run an unchanged torchrun-style script, one rank per Dask worker
  dask-ddp demo   train a small CNN with DDP on scikit-learn's digits read from S3 (all local)
  dask-ddp slurm  inside an sbatch script: start the workers with srun, then run a script on them
  dask-ddp export write a sharded checkpoint (save_sharded) as one torch.save or safetensors file
"""

_EPILOG = """\
examples:
  dask-ddp demo                                       # 2 local workers, embedded S3 server, about a minute
  dask-ddp run examples/torchrun_script.py --steps 50  # a local cluster of 2 workers
  dask-ddp run --scheduler tcp://10.0.0.5:8786 --workers 4 train.py --lr 0.1

exit codes: 0 success, 1 a rank failed (root cause on stderr), 2 usage error, 130 interrupted
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dask-ddp`` and its sub-commands; each sets ``func``, its entry point.

    Raises nothing (argparse raises ``SystemExit`` later, when parsing).
    """
    parser = argparse.ArgumentParser(prog="dask-ddp", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dask-ddp {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{run,demo,slurm,export}", required=True)
    run.add_parser(commands)
    demo.add_parser(commands)
    slurm.add_parser(commands)
    export.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dask-ddp`` command; returns the exit code.

    Raises
    ------
    SystemExit
        From argparse, with code 2 for usage errors and 0 for ``--help``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"dask-ddp {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
