"""How a worker gets its zygote forked by its host's warm zygote host (``ddp.zygote-host``).

Runs in: the Dask worker (the zygote's reader thread, :class:`dask_ddp.worker.zygote.Zygote`).

The host (:mod:`dask_ddp.rank.zygote_host`) listens on a Unix socket named after everything that could make an
``import torch`` come out differently: the interpreter and its version, the package and when it last changed,
the environment (less the variables a zygote takes after its fork anyway: :data:`PER_WORKER`), the working
directory, the user and groups, the namespaces (a worker in a network namespace of its own, as the simulated
hosts of the tests, gets a host in that namespace), the cgroup (a batch job's processes stay in its job) and
the resource limits. The first worker that finds no host starts one, under a lock, detached from itself; the
host exits once it has had no zygote for ``ddp.zygote-host-idle`` seconds.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["fork_zygote", "host_key", "socket_dir", "PER_WORKER"]

# variables a zygote takes from its worker after the fork (the import of torch never reads them): workers that
# differ only in these share a host (dask-cuda gives each worker its own CUDA_VISIBLE_DEVICES; distributed marks
# each client process's workers with its pid, for their process titles)
PER_WORKER = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "__DASK_PARENT_PID", "PYTEST_")
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_MEMLOCK", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_NPROC")
_NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")


@functools.lru_cache(maxsize=1)
def _package_stamp() -> tuple[str, int]:
    root = Path(__file__).resolve().parents[1]
    return str(root), max(p.stat().st_mtime_ns for p in root.rglob("*.py"))


def _read(path: str) -> str:
    try:
        return os.readlink(path) if path.startswith("/proc/self/ns/") else Path(path).read_text()
    except OSError:
        return ""


def host_key(env: dict[str, str], cwd: str) -> str:
    """The name of the zygote host that may fork a zygote for a worker with environment ``env`` in ``cwd``
    (hex; equal for processes whose ``import torch`` would come out the same). Raises nothing."""
    seen = {
        "python": [sys.executable, sys.version, *_package_stamp()],
        "env": sorted((k, v) for k, v in env.items() if not k.startswith(PER_WORKER)),
        "cwd": cwd, "ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
        "ns": [_read(f"/proc/self/ns/{ns}") for ns in _NAMESPACES], "cgroup": _read("/proc/self/cgroup"),
        "limits": [resource.getrlimit(getattr(resource, name)) for name in _LIMITS if hasattr(resource, name)],
    }
    return hashlib.sha256(json.dumps(seen, sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()[:24]


def socket_dir() -> Path:
    """This user's directory for zygote host sockets (created mode 0700).

    Raises OSError: it exists but another user owns it or others may enter it (then no host is used).
    """
    path = Path(tempfile.gettempdir()) / f"dask-ddp-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not os.path.isdir(path) or os.path.islink(path):
        raise OSError(f"{path} is not a directory of this user's alone (owner uid {st.st_uid}, mode "
                      f"{oct(st.st_mode & 0o777)}): no zygote host; remove it or set ddp.zygote-host: false")
    return path


def _sweep(directory: Path) -> None:
    """Remove the sockets of hosts that died without removing them (SIGKILL, a network namespace torn down):
    nothing answers on them (called under the start lock; a live host reads the end of a connection at once)."""
    for stale in directory.glob("zygote-*.sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(str(stale))
        except ConnectionRefusedError:
            stale.unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            sock.close()


def _start_host(path: Path, env: dict[str, str], cwd: str) -> None:
    """Bind the host's socket and start the host on it (called under the lock, with no host listening)."""
    _sweep(path.parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        path.unlink(missing_ok=True)  # a host that died without removing it
        listener.bind(str(path))
        listener.listen(64)
        proc = subprocess.Popen([sys.executable, "-m", "dask_ddp.rank.zygote_host", str(path)],
                                stdin=listener.fileno(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env=env, cwd=cwd)
    finally:
        listener.close()
    threading.Thread(target=proc.wait, name="dask-ddp-zygote-host-start", daemon=True).start()  # it detaches


def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(str(path))
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None


def _connect_or_start(env: dict[str, str], cwd: str) -> socket.socket:
    directory = socket_dir()
    key = host_key(env, cwd)
    path = directory / f"zygote-{key}.sock"
    sock = _connect(path)
    if sock is not None:
        return sock
    with open(directory / "start.lock", "a") as lock:  # one for all hosts: a start takes ~10 ms
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(path)  # another worker may have started it meanwhile
        if sock is None:
            _start_host(path, env, cwd)
            sock = _connect(path)
    if sock is None:
        raise OSError(f"the zygote host at {path} did not take a connection")
    return sock


def fork_zygote(env: dict[str, str], fds: list[int], timeout: float) -> tuple[int, int]:
    """Have this host's zygote host fork a zygote for this worker, passing it ``fds`` (the zygote's socket, its
    stdout and stderr); return its pid and a pidfd of it. Starts the host if none runs (its warm-up, seconds,
    is within ``timeout``); tries twice (a host may exit idle as the request comes).

    Raises OSError: no answer within ``timeout`` s, or the host cannot be reached or started.
    """
    cwd, deadline, why = os.getcwd(), time.monotonic() + timeout, ""
    request = json.dumps({"env": env, "cwd": cwd, "umask": _umask(), "affinity": sorted(os.sched_getaffinity(0))})
    for _ in range(2):
        sock = _connect_or_start(env, cwd)
        try:
            socket.send_fds(sock, [request.encode("utf-8", "surrogateescape")], fds)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            msg, got, _, _ = socket.recv_fds(sock, 64, 1)
        except OSError as e:
            msg, got, why = b"", [], str(e)
        finally:
            sock.close()
        if msg.startswith(b"Z") and len(got) == 1:
            return int(msg[1:]), got[0]
        for fd in got:
            os.close(fd)
        if time.monotonic() > deadline:
            break
    raise OSError(f"the zygote host did not fork a zygote within {timeout:.0f} s: {why or 'it hung up'}")


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would, for a moment, for every thread)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022
