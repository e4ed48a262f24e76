"""Runs in: the batch script of a SLURM job (``dask-ddp slurm SCRIPT ARGS`` in an ``sbatch`` script).

The batch form of SLURM: one allocation holds the whole run. ``dask-ddp slurm``
starts a Dask scheduler in this process, on this node's address on the route
to the allocation's other nodes (no ``--interface`` to guess), starts one
``dask worker`` per task of the allocation with ``srun`` (one rank per task:
``--ntasks-per-node`` = GPUs per node), waits for them, runs SCRIPT as
``dask-ddp run`` does (a torchrun-style script, unchanged), then stops the
workers and the scheduler. The exit code is ``dask-ddp run``'s.

A notice before the time limit: ``#SBATCH --signal=TERM@120`` (without ``B:``)
sends SIGTERM to the job steps, which is the workers' ``srun`` step here:
each worker's Nanny lets the ranks save at an agreed step (a script that
registered ``dask_ddp.on_preemption`` or saves periodic checkpoints), and the
next job resumes from that checkpoint. ``examples/slurm/ddp.sbatch`` is an example.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time

from dask_ddp.cli import run, siblings
from dask_ddp.cli.common import EXIT_FAILED, usage_error
from dask_ddp.cli.script import load_script
from dask_ddp.wire.errors import DaskDDPError

__all__ = ["add_parser", "main", "allocation", "scheduler_address_for", "worker_command"]

DESCRIPTION = """\
Inside an sbatch script (or salloc): start a Dask scheduler here, one Dask worker per task of
the allocation (srun), run SCRIPT on them as `dask-ddp run` would (one rank per task), then
stop them. The scheduler listens on this node's address on the route to the allocation's
other nodes; each rank's gloo/NCCL socket interface follows its worker's address.
"""

EPILOG = """\
example sbatch script (examples/slurm/ddp.sbatch):
  #SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8
  #SBATCH --time=04:00:00 --signal=TERM@120     # the workers' notice, 120 s before the limit
  dask-ddp slurm train.py --epochs 10

exit codes: 0 success, 1 a rank failed (root cause on stderr), 2 usage error (not in a SLURM job), 130 interrupted
"""


def add_parser(commands) -> None:
    """Add the ``slurm`` command and its options to ``commands`` (what ``add_subparsers`` returned).

    Raises
    ------
    argparse.ArgumentError
        ``commands`` has a ``slurm`` command already.
    """
    parser = commands.add_parser("slurm", help="inside an sbatch script: start the cluster with srun, run a script",
                                 description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-args", default="", metavar="ARGS",
                        help="more arguments for each `dask worker`, as one string (e.g. \"--worker-port "
                             "40000:40100 --local-directory /scratch\")")
    parser.add_argument("--start-timeout", type=float, default=300, metavar="SECONDS",
                        help="how long to wait for every worker to join (default 300)")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="gloo",
                        help="backend of dask-ddp's short-lived group before the script's own (default gloo)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart every rank up to N times after a failure, as torchrun --max-restarts")
    parser.add_argument("--progress", action="store_true", help="show a progress bar of the reported steps")
    parser.add_argument("script", help="the Python script, as `python SCRIPT` would run it")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=main)


def allocation(environ=os.environ) -> tuple[int, int, list[str]]:
    """``(tasks, cpus per task, node names)`` of the SLURM job this process runs in.

    Raises
    ------
    LookupError
        Not inside a SLURM job (no ``SLURM_JOB_ID`` / ``SLURM_NTASKS``): the message says where to run it.
    """
    if not environ.get("SLURM_JOB_ID") or not environ.get("SLURM_NTASKS"):
        raise LookupError("SLURM_JOB_ID or SLURM_NTASKS is not set: run `dask-ddp slurm` inside an sbatch script "
                          "(or salloc) that asks for --ntasks, one task per rank")
    nodes = subprocess.run(["scontrol", "show", "hostnames", environ.get("SLURM_JOB_NODELIST", "")],
                           capture_output=True, text=True, timeout=30).stdout.split()
    return int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_CPUS_PER_TASK") or 1), nodes


def scheduler_address_for(nodes: list[str], here: str | None) -> str:
    """The address of this node that the other nodes of the allocation reach it by (its route to one of them).

    Raises
    ------
    DaskDDPError
        No node of the allocation resolves or is reachable from here.
    """
    from dask_ddp.client.slurm import route_to

    others = [n for n in nodes if n != here] or nodes or ["localhost"]
    return route_to(others[0])


def worker_command(scheduler: str, tasks: int, cpus: int, extra: str = "") -> list[str]:
    """The ``srun`` command line that starts one Nanny-run ``dask worker`` per task. Raises nothing."""
    return (["srun", f"--ntasks={tasks}", "--kill-on-bad-exit=0", sys.executable, "-m",
             "distributed.cli.dask_worker", scheduler, "--nthreads", str(cpus), "--nanny", "--no-dashboard"]
            + shlex.split(extra))


def main(args: argparse.Namespace) -> int:
    """Run ``dask-ddp slurm`` from parsed arguments; return the exit code (0, 1 failed, 2 usage, 130 interrupted).

    Raises
    ------
    KeyboardInterrupt
        Ctrl-C before the job started (the CLI turns it into exit code 130).
    """
    try:
        tasks, cpus, nodes = allocation()
        script = load_script(args.script, args.script_args, ship_limit=siblings.DEFAULT_LIMIT)
    except LookupError as exc:
        return usage_error("slurm", str(exc))
    except (OSError, ValueError, SyntaxError) as exc:
        return usage_error("slurm", f"{type(exc).__name__}: {exc}")
    from dask.distributed import Client, LocalCluster

    try:
        host = scheduler_address_for(nodes, os.environ.get("SLURMD_NODENAME"))
    except DaskDDPError as exc:
        print(f"dask-ddp slurm: {exc}", file=sys.stderr)
        return EXIT_FAILED
    with contextlib.ExitStack() as stack:
        workers: list[subprocess.Popen] = []
        stack.callback(_stop, workers)  # last: the scheduler's close has told the workers to go by then
        cluster = stack.enter_context(LocalCluster(n_workers=0, host=host, scheduler_port=0,
                                                   dashboard_address=f"{host}:0"))
        client = stack.enter_context(Client(cluster))
        print(f"dask-ddp slurm: scheduler {cluster.scheduler_address} (dashboard {cluster.dashboard_link}); "
              f"starting {tasks} workers on {','.join(nodes) or 'this node'}", file=sys.stderr, flush=True)
        workers.append(subprocess.Popen(worker_command(cluster.scheduler_address, tasks, cpus, args.worker_args)))
        try:
            client.wait_for_workers(tasks, timeout=args.start_timeout)
        except TimeoutError:
            have = len(client.scheduler_info(n_workers=-1)["workers"])
            code = workers[0].poll()
            print(f"dask-ddp slurm: {have} of {tasks} workers joined within {args.start_timeout:.0f} s (srun "
                  f"{'still runs' if code is None else f'exited {code}'}): see the job's output for the workers' "
                  "errors", file=sys.stderr)
            return EXIT_FAILED
        args.workers, args.scheduler = tasks, cluster.scheduler_address
        code = run._run_script(client, script, args)
        if code and _ends_within(workers[0], 10.0):  # srun exits a little after its workers left the scheduler
            print("dask-ddp slurm: the workers' srun step ended while the job ran (SLURM's --signal before the "
                  "time limit, scancel, or the limit itself): what the ranks saved at the notice is what the "
                  "script resumes from when you submit it again", file=sys.stderr)
        return code


def _ends_within(proc: subprocess.Popen, wait: float) -> bool:
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        return False
    return True


def _stop(workers: list[subprocess.Popen], wait: float = 30.0) -> None:
    """Stop the workers' srun step: it ends by itself once the scheduler has closed (each Nanny closes when its
    scheduler does); after ``wait`` s SIGTERM (srun ends its tasks), after as long again SIGKILL."""
    for proc in workers:
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and proc.poll() is None:
                proc.send_signal(sig)
            deadline = time.monotonic() + wait
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is not None:
                break
        proc.wait()
