"""SLURM as a deployment target: keyword arguments that fit dask-jobqueue's ``SLURMCluster`` to dask-ddp.

Runs in: the client (a notebook or script on a SLURM login node, or in a batch job), before the cluster
exists; :func:`route_to` also in ``dask-ddp slurm-env`` (the sbatch script's helper).

``SLURMCluster(**dask_ddp.slurm_options(queue="gpu", cores=8, memory="64GB", walltime="04:00:00"))``
gives each worker job what a DDP job needs, which plain ``SLURMCluster`` leaves to the user:

- **The scheduler's address**: the address of this host on the route to the partition's nodes (the
  first node ``sinfo`` lists; its ``NodeAddr``), so that no ``interface="ib0"`` guess is needed. A
  worker then advertises the address on its route back to the scheduler (Dask does that), and each rank
  pins gloo/NCCL's socket interface to its worker's address (:mod:`dask_ddp.rank.network`). The default
  otherwise is the address on the route to 8.8.8.8, which compute nodes often cannot reach, or
  127.0.0.1 where there is no such route.
- **A preemption notice**: ``#SBATCH --signal=B:TERM@<notice>`` and ``exec`` before the worker command,
  so SLURM's SIGTERM ``notice`` seconds before the walltime reaches the ``dask worker`` process itself
  (``B:`` signals the batch shell only, and a shell waiting on a command would not pass it on). Its
  Nanny then lets the job save at an agreed step (:mod:`dask_ddp.worker.leaving`). ``scancel`` (SIGTERM
  to every process of the job, SIGKILL ``KillWait`` s later) is a notice too.
- **Ports**, where a firewall stands between the login node and the compute nodes: ``ports=(lo, hi)``
  splits the range between the workers' and the Nannies' listening ports.
- **TLS**: ``security=True`` (dask-jobqueue makes a ``Security.temporary()`` for the cluster and writes the
  workers' copy of its certificate and key, files of mode 0600, to ``shared_temp_directory``, here ``~``
  unless set: a home folder every node sees). The scheduler listens on the login node's routed address, and
  a plain-TCP scheduler there runs the code of anyone who can reach it, as you. Its dashboard listens on
  127.0.0.1:8787 (an ssh tunnel, or a Jupyter proxy on the login node, reaches it).
- **GPUs**: ``gpus=N`` asks each job for N GPUs (``--gres=gpu:N``) and runs N workers in it
  (``processes=N``): one rank per GPU. The workers of a job all see the job's GPUs, and each rank takes
  ``cuda:LOCAL_RANK``, as under torchrun (:mod:`dask_ddp.rank.devices`). ``gpus=1``: a job per GPU.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
from typing import Any

import dask

from dask_ddp.wire.errors import DaskDDPError
from dask_ddp.wire.notices import grace_period

__all__ = ["slurm_options", "scheduler_host", "route_to", "partition_addresses"]

DEFAULT_NOTICE = 60  # seconds before the walltime; SLURM may send it up to 60 s earlier than asked
_PROBE_PORT = 9  # discard: a UDP "connect" sends nothing, it only asks the kernel for the route


def route_to(address: str) -> str:
    """The IP address of this host that the kernel would use to reach ``address`` (a name or an IP).

    Sends nothing (a UDP socket's ``connect`` only picks the route).

    Raises
    ------
    DaskDDPError
        ``address`` does not resolve, or this host has no route to it.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, _PROBE_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except (OSError, UnicodeError, IndexError) as exc:
        raise DaskDDPError(f"this host has no route to {address!r} ({exc}): pass interface= (the network "
                           "the compute nodes share, e.g. 'ib0') or scheduler_options={'host': ...}") from None


def partition_addresses(partition: str | None = None, timeout: float = 30.0) -> list[str]:
    """The ``NodeAddr`` of every node of ``partition`` (the default partition when None), as ``sinfo`` lists.

    Raises
    ------
    DaskDDPError
        ``sinfo`` is missing or fails (not a SLURM host, no such partition), or lists no node.
    """
    if shutil.which("sinfo") is None:
        raise DaskDDPError("sinfo is not on PATH: run this on a SLURM login node (or pass interface= / "
                           "scheduler_options={'host': ...} to SLURMCluster yourself)")
    argv = ["sinfo", "-h", "-N", "-o", "%o"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DaskDDPError(f"{shlex.join(argv)} did not answer within {timeout:.0f} s: is slurmctld up?") from None
    addrs = list(dict.fromkeys(line.strip() for line in out.stdout.splitlines() if line.strip()))
    if out.returncode or not addrs:
        why = out.stderr.strip() or "no node listed"
        raise DaskDDPError(f"{shlex.join(argv)} failed ({why}): check the partition name (queue=)")
    return addrs


def scheduler_host(partition: str | None = None) -> str:
    """The address the scheduler should listen on: this host's address on the route to ``partition``'s nodes.

    Raises
    ------
    DaskDDPError
        No node of the partition is known (see :func:`partition_addresses`) or none is reachable.
    """
    errors = []
    for addr in partition_addresses(partition)[:4]:
        try:
            return route_to(addr)
        except DaskDDPError as exc:
            errors.append(str(exc))
    raise DaskDDPError(f"no node of partition {partition or '(default)'} is reachable from here: "
                       + "; ".join(errors))


def slurm_options(*, notice: int = DEFAULT_NOTICE, ports: tuple[int, int] | None = None, gpus: int | None = None,
                  **cluster_kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``dask_jobqueue.SLURMCluster``: ``cluster_kwargs`` completed for dask-ddp.

    A setting of the site's dask-jobqueue configuration (``jobqueue.slurm.*``) counts as passed.
    ``notice``: seconds before the walltime at which SLURM sends SIGTERM (``--signal=B:TERM@notice``); it
    must leave the job ``ddp.preemption.grace-period`` to save. ``ports``: a ``(lo, hi)`` range for the
    workers' and Nannies' ports. ``gpus``: GPUs per worker job (see the module's docstring). TLS with a
    certificate made for the cluster (``security=True``, ``shared_temp_directory="~"``) and the dashboard on
    127.0.0.1:8787, unless the caller says otherwise (``security=False``: plain TCP, which lets anyone who
    reaches the scheduler run code as you). Everything the caller passed wins: an ``interface`` or a scheduler
    ``host``/``interface`` of theirs is kept, so is a ``--signal`` directive, and lists
    (``job_extra_directives``, ``worker_extra_args``) are extended.

    Raises
    ------
    ValueError
        ``notice`` leaves less than the grace period, ``ports`` is not a range of at least 2 ports, ``gpus``
        is below 1.
    DaskDDPError
        The scheduler's address cannot be found (no ``sinfo``, no reachable node): the message says what to pass.
    """
    kw = dict(cluster_kwargs)
    grace = grace_period()
    if notice < grace + 5:
        raise ValueError(f"slurm_options(notice={notice}) leaves the job less than ddp.preemption.grace-period "
                         f"({grace:.0f} s) plus 5 s to save before SLURM's SIGKILL: pass notice >= {grace + 5:.0f} "
                         "or lower the grace period")
    directives = list(_given(kw, "job_extra_directives") or [])
    if not any(d.strip().startswith("--signal") for d in directives):
        directives.append(f"--signal=B:TERM@{int(notice)}")
    extra_args = list(_given(kw, "worker_extra_args") or [])
    if ports is not None:
        extra_args += _port_args(ports)
    if gpus is not None:
        if gpus < 1:
            raise ValueError(f"slurm_options(gpus={gpus}): a worker job needs at least 1 GPU (or gpus=None)")
        if not any("--gres" in d or "--gpus" in d for d in directives):
            directives.append(f"--gres=gpu:{gpus}")
        kw.setdefault("processes", gpus)  # one worker (one rank) per GPU; each rank takes a GPU of its own
    kw["job_extra_directives"] = directives
    kw["worker_extra_args"] = extra_args
    python = _given(kw, "python") or sys.executable
    kw["python"] = python if python.split()[0] == "exec" else f"exec {python}"
    sched = dict(_given(kw, "scheduler_options") or {})
    if not (_given(kw, "interface") or sched.get("host") or sched.get("interface")):
        sched["host"] = scheduler_host(_given(kw, "queue"))
    sched.setdefault("dashboard_address", "127.0.0.1:8787")
    kw["scheduler_options"] = sched
    _secure(kw)
    return kw


def _secure(kw: dict) -> None:
    """TLS unless the caller (or the site) chose: ``security=True`` and its files' folder, ``~`` by default."""
    if kw.get("security") is False:  # plain TCP on purpose: dask-jobqueue takes None for it
        kw.pop("security")
        return
    if kw.get("security") is None:
        kw["security"] = True
    if _given(kw, "shared_temp_directory") is None:
        kw["shared_temp_directory"] = "~"  # else the current folder, with a warning


def _given(kw: dict, name: str) -> Any:
    """What the caller passed for ``name``, else the site's dask-jobqueue setting (``jobqueue.slurm.<name>``)."""
    if kw.get(name) is not None:
        return kw[name]
    return dask.config.get(f"jobqueue.slurm.{name.replace('_', '-')}", None)


def _port_args(ports: tuple[int, int]) -> list[str]:
    lo, hi = (int(p) for p in ports)
    if not 0 < lo < hi < 65536:
        raise ValueError(f"slurm_options(ports={ports!r}) needs a range (lo, hi) with 0 < lo < hi < 65536")
    mid = (lo + hi) // 2
    return ["--worker-port", f"{lo}:{mid}", "--nanny-port", f"{mid + 1}:{hi}"]

