"""Runs in: the batch script of a SLURM job (``dask-ddp slurm SCRIPT ARGS`` in an ``sbatch`` script).

The batch form of SLURM: one allocation holds the whole run. ``dask-ddp slurm``
starts a Dask scheduler in this process, on this node's address on the route
to the allocation's other nodes (no ``--interface`` to guess), starts one
``dask worker`` per task of the allocation with ``srun`` (one rank per task:
``--ntasks-per-node`` = GPUs per node), waits for them, runs SCRIPT as
``dask-ddp run`` does (a torchrun-style script, unchanged), then stops the
workers and the scheduler. The exit code is ``dask-ddp run``'s.

The cluster speaks TLS, as ``dask-ddp run``'s local one does: a plain-TCP scheduler on the node's routed
address takes code from anyone who can reach it, and runs it as the job's owner. The material
(``Security.temporary()``, made for this job) is written to a private folder (0700, files 0600) under
``--tls-dir`` (default ``~/.dask-ddp``: it must be a folder every node of the allocation sees, as a home
folder is), for the workers that ``srun`` starts there, and removed at the end. The dashboard listens on
127.0.0.1 only: an ssh tunnel to the node reaches it (the command prints the line).

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
import socket
import subprocess
import sys
import time

from dask_ddp.cli import run, siblings
from dask_ddp.cli.common import EXIT_FAILED, TLSFiles, usage_error
from dask_ddp.cli.script import load_script
from dask_ddp.wire.errors import DaskDDPError

__all__ = ["add_parser", "main", "allocation", "scheduler_address_for", "worker_command", "tls_base"]

DESCRIPTION = """\
Inside an sbatch script (or salloc): start a Dask scheduler here, one Dask worker per task of
the allocation (srun), run SCRIPT on them as `dask-ddp run` would (one rank per task), then
stop them. The scheduler listens on this node's address on the route to the allocation's
other nodes; each rank's gloo/NCCL socket interface follows its worker's address.
Scheduler and workers speak TLS with a certificate made for this job, in a private folder
under --tls-dir that the workers read; the dashboard listens on 127.0.0.1 (ssh -L reaches it).
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
    parser.add_argument("--tls-dir", metavar="DIR",
                        help="where the job's TLS certificate and key go, in a private folder of their own that is "
                             "removed at the end: a folder of yours that every node sees (default ~/.dask-ddp)")
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


def worker_command(scheduler: str, tasks: int, cpus: int, extra: str = "", tls: TLSFiles | None = None) -> list[str]:
    """The ``srun`` command line that starts one Nanny-run ``dask worker`` per task (speaking TLS with ``tls``'s
    material, which the scheduler's must be). Raises nothing."""
    return (["srun", f"--ntasks={tasks}", "--kill-on-bad-exit=0", sys.executable, "-m",
             "distributed.cli.dask_worker", scheduler, "--nthreads", str(cpus), "--nanny", "--no-dashboard",
             "--dashboard-address", "127.0.0.1:0"]  # its HTTP server (/metrics, /health) runs all the same
            + (tls.worker_args() if tls is not None else []) + shlex.split(extra))


def tls_base(given: str | None) -> str:
    """The folder that holds the job's private TLS folder: ``given``, else ``~/.dask-ddp`` (made 0700; where it
    is not this user's private folder, another one beside it, see
    :func:`~dask_ddp.worker.tmpdirs.private_folder`).

    Raises
    ------
    OSError
        The home folder cannot be written.
    """
    from dask_ddp.worker.tmpdirs import private_folder

    if given:
        return os.path.abspath(os.path.expanduser(given))
    return private_folder(os.path.expanduser("~"), ".dask-ddp")


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
    from distributed.security import Security

    try:
        host = scheduler_address_for(nodes, os.environ.get("SLURMD_NODENAME"))
        security = Security.temporary()  # this job's alone: nobody without its key joins or connects
        tls = TLSFiles.write(security, tls_base(args.tls_dir), f"slurm-{os.environ['SLURM_JOB_ID']}-")
    except (DaskDDPError, OSError) as exc:
        print(f"dask-ddp slurm: {exc}", file=sys.stderr)
        return EXIT_FAILED
    with contextlib.ExitStack() as stack:
        stack.callback(tls.remove)  # after the workers stopped: a worker (re)starting reads it
        workers: list[subprocess.Popen] = []
        stack.callback(_stop, workers)  # the scheduler's close has told the workers to go by then
        cluster = stack.enter_context(LocalCluster(n_workers=0, host=host, scheduler_port=0, security=security,
                                                   dashboard_address="127.0.0.1:0"))
        client = stack.enter_context(Client(cluster))
        _announce(cluster, tls, tasks, nodes)
        workers.append(subprocess.Popen(worker_command(cluster.scheduler_address, tasks, cpus, args.worker_args,
                                                       tls)))
        try:
            client.wait_for_workers(tasks, timeout=args.start_timeout)
        except TimeoutError:
            have = len(client.scheduler_info(n_workers=-1)["workers"])
            code = workers[0].poll()
            print(f"dask-ddp slurm: {have} of {tasks} workers joined within {args.start_timeout:.0f} s (srun "
                  f"{'still runs' if code is None else f'exited {code}'}): see the job's output for the workers' "
                  f"errors (each reads the job's TLS material in {tls.folder}: --tls-dir must be a folder every "
                  "node sees)", file=sys.stderr)
            return EXIT_FAILED
        args.workers, args.scheduler = tasks, cluster.scheduler_address
        code = run.run_on(client, script, args)
        if code and _ends_within(workers[0], 10.0):  # srun exits a little after its workers left the scheduler
            print("dask-ddp slurm: the workers' srun step ended while the job ran (SLURM's --signal before the "
                  "time limit, scancel, or the limit itself): what the ranks saved at the notice is what the "
                  "script resumes from when you submit it again", file=sys.stderr)
        return code


def _announce(cluster, tls: TLSFiles, tasks: int, nodes: list[str]) -> None:
    """Print where the scheduler and the dashboard are, and how to reach them."""
    address = cluster.scheduler_address
    print(f"dask-ddp slurm: scheduler {address} (TLS; this job's certificate and key in {tls.folder}, yours alone, "
          f"removed at the end); starting {tasks} workers on {','.join(nodes) or 'this node'}", file=sys.stderr)
    port = cluster.scheduler_info.get("services", {}).get("dashboard")
    if port:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"dask-ddp slurm: dashboard on {node}, 127.0.0.1:{port} only: `ssh -N -L 8787:127.0.0.1:{port} {node}`"
              " (from the login node), then http://localhost:8787/status", file=sys.stderr)
    print(f"dask-ddp slurm: to connect while the job runs (as you): {tls.client_code(address)}", file=sys.stderr,
          flush=True)


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
