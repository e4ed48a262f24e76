"""The ``dask-ddp`` command: ``dask-ddp run`` (torchrun-style scripts on a Dask cluster) and ``dask-ddp demo``.

Exit codes: 0 success; 1 the job failed (the root cause and its traceback on
stderr) or the scheduler could not be reached; 2 usage errors (bad options,
no such script, a script that does not compile, more workers asked for than
the cluster has); 130 interrupted (Ctrl-C: the job is cancelled first).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
import threading
import time
import traceback
from typing import Iterator, Sequence

__all__ = ["main", "build_parser", "open_client", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

_DESCRIPTION = """\
PyTorch DistributedDataParallel on any Dask cluster.

  dask-ddp run    run an unchanged torchrun-style script, one rank per Dask worker
  dask-ddp demo   train a small CNN with DDP on scikit-learn's digits read from S3 (all local)
"""

_EPILOG = """\
examples:
  dask-ddp demo                                       # 2 local workers, embedded S3 server, about a minute
  dask-ddp run examples/torchrun_script.py --steps 50  # a local cluster of 2 workers
  dask-ddp run --scheduler tcp://10.0.0.5:8786 --workers 4 train.py --lr 0.1

exit codes: 0 success, 1 a rank failed (root cause on stderr), 2 usage error, 130 interrupted
"""

_RUN_DESCRIPTION = """\
Run SCRIPT on the workers of a Dask cluster, one rank per worker, as torchrun would:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the
TORCHELASTIC_* variables are set, and the script's own
torch.distributed.init_process_group(...) (env://) joins the job's rendezvous.
The script is read here and shipped as text: the workers need not share a
filesystem with this machine (but modules it imports must be installed there).
Every line a rank prints is echoed as "[rank N] ...".

GPUs: the local cluster's workers see every GPU, so cuda:LOCAL_RANK is each
rank's own GPU, as under torchrun. On dask-cuda workers (--scheduler of a
LocalCUDACluster or dask-cuda-worker) CUDA_VISIBLE_DEVICES is rotated per
worker and a rank's own GPU is cuda:0 instead.
"""

_RUN_EPILOG = """\
examples:
  dask-ddp run examples/torchrun_script.py                  # starts a local cluster of 2 workers
  dask-ddp run --workers 4 train.py --epochs 3              # ... of 4 workers
  dask-ddp run --scheduler tcp://127.0.0.1:8786 train.py    # every worker of that cluster
  dask-ddp run --scheduler tcp://127.0.0.1:8786 --workers 2 -- train.py --help

The same script runs under torchrun:  torchrun --standalone --nproc-per-node 2 train.py
exit codes: 0 success, 1 a rank failed (root cause on stderr), 2 usage error, 130 interrupted
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dask-ddp`` and its sub-commands."""
    from . import demo

    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="dask-ddp", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=fmt)
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"dask-ddp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,demo}", required=True)

    run = sub.add_parser("run", help="run a torchrun-style script on a Dask cluster", description=_RUN_DESCRIPTION,
                         epilog=_RUN_EPILOG, formatter_class=fmt)
    _add_cluster_arguments(run, "a LocalCluster; its workers see every GPU")
    run.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="gloo",
                     help="backend of the short-lived group dask-ddp forms before handing over to the "
                          "script (default gloo); the script picks its own in init_process_group")
    run.add_argument("--max-restarts", type=_int_at_least(0), default=0, metavar="N",
                     help="restart every rank up to N times after a failure (TORCHELASTIC_RESTART_COUNT "
                          "counts them), as torchrun --max-restarts")
    run.add_argument("--progress", action="store_true",
                     help="show a progress bar of the steps the script reports with dask_ddp.report()")
    run.add_argument("script", help="the Python script, as `python SCRIPT` would run it")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                     help="arguments for the script (everything after SCRIPT)")
    run.set_defaults(func=_cmd_run)

    d = sub.add_parser("demo", help="train a CNN with DDP on digits read from S3 (all local, about a minute)",
                       description=demo.DESCRIPTION, epilog=demo.EPILOG, formatter_class=fmt)
    _add_cluster_arguments(d, "a LocalCUDACluster with a GPU and dask-cuda, else a LocalCluster")
    demo.add_arguments(d)
    d.set_defaults(func=demo.main)
    return parser


def _add_cluster_arguments(parser: argparse.ArgumentParser, local: str) -> None:
    parser.add_argument("--scheduler", metavar="ADDR",
                        help=f"address of a running Dask scheduler (tcp://host:8786); default: start a local "
                             f"cluster ({local}) on 127.0.0.1 and stop it at the end")
    parser.add_argument("--connect-timeout", type=float, default=30, metavar="SECONDS",
                        help="how long to try reaching --scheduler (default 30)")
    parser.add_argument("--workers", type=_int_at_least(1), metavar="N",
                        help="number of ranks: the first N workers of --scheduler's cluster (default all), or "
                             "the size of the local cluster (default: one per GPU, else 2)")


def _int_at_least(minimum: int):
    """An argparse ``type`` for whole numbers >= ``minimum``, with the bound in its message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value
    return parse


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


def _cmd_run(args: argparse.Namespace) -> int:
    from .script import load_script

    try:
        script = load_script(args.script, args.script_args)
    except (OSError, ValueError, SyntaxError) as exc:
        return usage_error("run", f"{type(exc).__name__}: {exc}")
    with contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(open_client(args.scheduler, args.workers, dask_cuda=False,
                                                     connect_timeout=args.connect_timeout))
        except OSError as exc:
            print(f"dask-ddp run: cannot reach the Dask scheduler at {args.scheduler}: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return _run_script(client, script, args)


def _run_script(client, script, args: argparse.Namespace) -> int:
    from .. import dispatch
    from .script import run_script
    from ..errors import PlanError

    workers = args.workers if args.scheduler else None  # a local cluster has exactly --workers workers
    try:
        job = dispatch.run(client, run_script, script, workers=workers, backend=args.backend,
                           max_restarts=args.max_restarts, progress=args.progress,
                           name=f"{script.name.removesuffix('.py')}-{_suffix()}")
    except PlanError as exc:
        return usage_error("run", str(exc))
    return wait_for(job, f"dask-ddp run: {script.name}")


def wait_for(job, what: str) -> int:
    """Wait for ``job``; print the root cause and return 1 if it failed, cancel it and return 130 on Ctrl-C.

    ``job.result()`` (and its progress bar) runs in a helper thread while this
    thread only sleeps: the KeyboardInterrupt of Ctrl-C then lands in a plain
    ``time.sleep``, never half-way through the job's locks.
    """
    outcome: list = []
    waiter = threading.Thread(target=_collect, args=(job, outcome), name="dask-ddp-cli-wait", daemon=True)
    waiter.start()
    try:
        while not outcome:
            time.sleep(0.1)
    except KeyboardInterrupt:
        print(f"{what}: interrupted; cancelling job {job.run_id} ...", file=sys.stderr)
        job.cancel()
        return EXIT_INTERRUPTED
    error = outcome[0]
    if error is not None:
        print_failure(error, what)
        return EXIT_FAILED
    return EXIT_OK


def _collect(job, outcome: list) -> None:
    try:
        job.result()
    except BaseException as err:  # noqa: BLE001 - every failure is the job's root cause, shown as such
        outcome.append(err)
        return
    outcome.append(None)


def print_failure(err: BaseException, what: str) -> None:
    """Print a failed job's root cause on stderr: a headline naming the rank when known, then the traceback."""
    from .script import ScriptExitError

    rank = getattr(err, "rank", None)
    where = f" on rank {rank}" if rank is not None else ""
    print(f"{what} failed{where}: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
    if isinstance(err, ScriptExitError):  # its traceback is dask-ddp's own, not the script's
        print("".join(traceback.format_exception_only(err)), end="", file=sys.stderr)
        return
    print("root cause (the rank's traceback; notes name the rank and worker):", file=sys.stderr)
    traceback.print_exception(type(err), err, _user_frames(err.__traceback__), file=sys.stderr)


def _user_frames(tb):
    """The traceback from its first frame outside dask-ddp (the whole of it if every frame is dask-ddp's)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dask_ddp/, not dask_ddp/cli/
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(package):
        first = first.tb_next
    return first or tb


def usage_error(command: str, message: str) -> int:
    """Print ``message`` the way argparse reports usage errors and return exit code 2."""
    print(f"dask-ddp {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _suffix() -> str:
    import uuid

    return uuid.uuid4().hex[:6]


@contextlib.contextmanager
def open_client(scheduler: str | None = None, workers: int | None = None, *, dask_cuda: bool = True,
                connect_timeout: float = 30) -> Iterator[object]:
    """A Dask client of the cluster at ``scheduler``, or of a local cluster started (and stopped) here.

    The local cluster listens on 127.0.0.1 and has ``workers`` workers
    (default: one per GPU, else 2), one thread each. With a GPU, ``dask_cuda=True``
    starts a ``LocalCUDACluster`` (each worker sees its own GPU as ``cuda:0``,
    what dask-ddp's functions expect) when dask-cuda is installed;
    ``dask_cuda=False`` a ``LocalCluster`` whose workers see every GPU, so that a
    torchrun-style script's ``cuda:LOCAL_RANK`` is its own GPU, as under
    torchrun. The worker processes ignore SIGINT: Ctrl-C in a terminal reaches
    this process alone, which can then cancel the job cleanly.

    Raises
    ------
    OSError
        The scheduler cannot be reached within ``connect_timeout`` seconds.
    """
    from distributed import Client

    if scheduler:
        with Client(scheduler, timeout=connect_timeout) as client:
            yield client
        return
    with _local_cluster(workers, dask_cuda) as cluster, Client(cluster) as client:
        yield client


@contextlib.contextmanager
def _local_cluster(workers: int | None, dask_cuda: bool):
    gpus = _gpu_count() if dask_cuda or workers is None else 0  # spare the client a torch import when it can
    kind, make = _local_cluster_kind(workers, dask_cuda, gpus)
    print(f"starting a local {kind} ...", file=sys.stderr)
    with _sigint_ignored():  # the worker processes inherit SIG_IGN: Ctrl-C is this process's to handle
        cluster = make()
    try:
        yield cluster
    finally:
        with _sigint_ignored():
            cluster.close()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_cluster_kind(workers: int | None, dask_cuda: bool, gpus: int):
    """``(description, factory)`` of the local cluster to start: a pure choice, nothing is started."""
    common = dict(host="127.0.0.1", dashboard_address="127.0.0.1:0", threads_per_worker=1)
    n = workers or gpus or 2
    if gpus and dask_cuda and importlib.util.find_spec("dask_cuda") is not None:
        def make_cuda():
            from dask_cuda import LocalCUDACluster

            return LocalCUDACluster(n_workers=n, **common)
        return f"LocalCUDACluster with {n} workers (one GPU each)", make_cuda

    def make():
        from distributed import LocalCluster

        return LocalCluster(n_workers=n, processes=True, **common)
    return f"LocalCluster with {n} workers", make


@contextlib.contextmanager
def _sigint_ignored():
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
