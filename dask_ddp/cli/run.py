"""Runs in: the user's shell (``dask-ddp run``); the script itself runs on the ranks (:mod:`dask_ddp.cli.script`).

``dask-ddp run SCRIPT ARGS``: read and compile the script here, open a
cluster (``--scheduler``'s or a local one), run the script on every rank as
torchrun would, wait for it and turn the outcome into an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import uuid

from dask_ddp.cli import siblings
from dask_ddp.cli.common import (
    EXIT_FAILED,
    add_cluster_arguments,
    int_at_least,
    open_client,
    usage_error,
    wait_for,
)
from dask_ddp.cli.script import Script, load_script, run_script
from dask_ddp.wire.errors import PlanError

__all__ = ["add_parser", "main", "run_on"]

DESCRIPTION = """\
Run SCRIPT on the workers of a Dask cluster, one rank per worker, as torchrun would:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the
TORCHELASTIC_* variables are set, and the script's own
torch.distributed.init_process_group(...) (env://) joins the job's rendezvous.
Every line a rank prints is echoed as "[rank N] ...".

Files: the script is read here and shipped as text, and each rank runs it as
`python SCRIPT` would, the script's folder first on sys.path. On the local
cluster that is the folder itself. With --scheduler the workers need not see
this machine's files: the Python modules and packages beside SCRIPT ship with
it (up to --ship-limit MiB; never hidden folders, virtual environments, data
files, or packages with compiled extensions, which must be installed on the
workers like any other module it imports), and each rank runs from a private
copy of the folder that holds only those: data files next to __file__ are
not there. Relative paths the script writes or reads (open("log.txt", "w"),
torch.save(model, "ckpt.pt")) resolve against the rank's working directory,
which is its Dask worker's: on the local cluster the directory you run
dask-ddp run from; with --scheduler the directory each `dask worker` was
started in (in a container, its working directory), on that worker's
machine. Give shared or s3:// paths for what must outlive the workers.

GPUs: cuda:LOCAL_RANK is each rank's own GPU, as under torchrun: the local
cluster's workers see every GPU, and on dask-cuda workers (--scheduler of a
LocalCUDACluster or dask-cuda-worker), whose CUDA_VISIBLE_DEVICES is rotated
per worker, each rank sees its host's GPUs re-listed in torchrun's order.
"""

EPILOG = """\
examples:
  dask-ddp run examples/torchrun_script.py                  # starts a local cluster of 2 workers
  dask-ddp run --workers 4 train.py --epochs 3              # ... of 4 workers
  dask-ddp run --scheduler tcp://127.0.0.1:8786 train.py    # every worker of that cluster
  dask-ddp run --scheduler tcp://127.0.0.1:8786 --workers 2 -- train.py --help

The same script runs under torchrun:  torchrun --standalone --nproc-per-node 2 train.py
exit codes: 0 success, 1 a rank failed (root cause on stderr), 2 usage error, 130 interrupted
"""


def add_parser(commands) -> None:
    """Add the ``run`` command and its options to ``commands`` (what ``add_subparsers`` returned).

    Raises
    ------
    argparse.ArgumentError
        ``commands`` has a ``run`` command already.
    """
    parser = commands.add_parser("run", help="run a torchrun-style script on a Dask cluster", description=DESCRIPTION,
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser, "a LocalCluster; its workers see every GPU")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="gloo",
                        help="backend of the short-lived group dask-ddp forms before handing over to the "
                             "script (default gloo); the script picks its own in init_process_group")
    parser.add_argument("--max-restarts", type=int_at_least(0), default=0, metavar="N",
                        help="restart every rank up to N times after a failure (TORCHELASTIC_RESTART_COUNT "
                             "counts them), as torchrun --max-restarts")
    parser.add_argument("--ship-limit", type=_mebibytes, default=siblings.DEFAULT_LIMIT / (1 << 20), metavar="MIB",
                        help="with --scheduler: the most MiB of Python modules from the script's folder that ship "
                             "with it (default %(default)g); over it, nothing runs")
    parser.add_argument("--progress", action="store_true",
                        help="show a progress bar of the steps the script reports with dask_ddp.report()")
    parser.add_argument("script", help="the Python script, as `python SCRIPT` would run it")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script (everything after SCRIPT)")
    parser.set_defaults(func=main)


def _mebibytes(text: str) -> float:
    """An argparse ``type``: a size in MiB, 0 or more (``argparse.ArgumentTypeError`` otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected at least 0 MiB, got {text}")
    return value


def main(args: argparse.Namespace) -> int:
    """Run ``dask-ddp run`` from parsed arguments; return the exit code (0, 1 failed, 2 usage, 130 interrupted).

    A script that cannot be read or compiled, or more ``--workers`` than the
    cluster has, is a usage error (2); an unreachable scheduler or a failed
    rank is 1, with the reason on stderr.

    Raises
    ------
    KeyboardInterrupt
        Ctrl-C before the job started (the CLI turns it into exit code 130).
    """
    try:
        # only a cluster started elsewhere needs the modules beside the script: the local one sees the folder
        limit = int(args.ship_limit * (1 << 20)) if args.scheduler else None
        script = load_script(args.script, args.script_args, ship_limit=limit)
    except (OSError, ValueError, SyntaxError) as exc:
        return usage_error("run", f"{type(exc).__name__}: {exc}")
    for name in script.not_shipped:
        print(f"dask-ddp run: not shipped: {name}/ (compiled extension modules): install it on the workers",
              file=sys.stderr)
    with contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(open_client(args.scheduler, args.workers, dask_cuda=False,
                                                     connect_timeout=args.connect_timeout))
        except OSError as exc:
            print(f"dask-ddp run: cannot reach the Dask scheduler at {args.scheduler}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return run_on(client, script, args)


def run_on(client, script: Script, args: argparse.Namespace) -> int:
    """Run the loaded ``script`` as a DDP job on ``client``'s cluster with the settings of the command line
    ``args`` (``--workers``, ``--backend``, ``--max-restarts``, ``--progress``), wait for it and return the exit
    code (``dask-ddp run``'s and ``dask-ddp slurm``'s, once their cluster is up).

    Raises nothing of its own: a workers selection the cluster cannot plan is a usage error (its message on
    stderr, the usage exit code); the job's own outcome is the exit code (see ``wait_for``).
    """
    from dask_ddp.client import dispatch  # here, not at the top: `dask-ddp --help` imports no distributed

    workers = args.workers if args.scheduler else None  # a local cluster has exactly --workers workers
    try:
        job = dispatch.run(client, run_script, script, workers=workers, backend=args.backend,
                           max_restarts=args.max_restarts, progress=args.progress,
                           name=f"{script.name.removesuffix('.py')}-{uuid.uuid4().hex[:6]}")
    except PlanError as exc:
        return usage_error("run", str(exc))
    return wait_for(job, f"dask-ddp run: {script.name}")
