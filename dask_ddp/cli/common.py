"""Runs in: the user's shell (the ``dask-ddp`` command): what its commands share.

Exit codes; the cluster options every command takes; the Dask client of a
running scheduler or of a local cluster started (and stopped) here; a cluster's
TLS material written for processes elsewhere (:class:`TLSFiles`); waiting
for a job, where Ctrl-C cancels it; printing a failed job's root cause.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from typing import Callable, Iterator

from dask_ddp.cli.script import ScriptExitError

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED", "add_cluster_arguments", "int_at_least",
           "usage_error", "wait_for", "print_failure", "open_client", "TLSFiles"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # dask_ddp/, not dask_ddp/cli/


# ---- arguments and usage errors ------------------------------------------------------------------------------

def add_cluster_arguments(parser: argparse.ArgumentParser, local: str) -> None:
    """Add ``--scheduler``, ``--connect-timeout`` and ``--workers`` to ``parser``; ``local`` names the local cluster.

    Raises
    ------
    argparse.ArgumentError
        ``parser`` has one of these options already.
    """
    parser.add_argument("--scheduler", metavar="ADDR",
                        help=f"address of a running Dask scheduler (tcp://host:8786); default: start a local "
                             f"cluster ({local}) on 127.0.0.1 and stop it at the end")
    parser.add_argument("--connect-timeout", type=float, default=30, metavar="SECONDS",
                        help="how long to try reaching --scheduler (default 30)")
    parser.add_argument("--workers", type=int_at_least(1), metavar="N",
                        help="number of ranks: the first N workers of --scheduler's cluster (default all), or "
                             "the size of the local cluster (default: one per GPU, else 2)")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for whole numbers >= ``minimum``, with the bound in its message.

    The returned function raises ``argparse.ArgumentTypeError`` for text that
    is not a whole number or is below ``minimum`` (argparse makes it a usage
    error, exit code 2).
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum}, got {value}")
        return value
    return parse


def usage_error(command: str, message: str) -> int:
    """Print ``message`` the way argparse reports usage errors and return exit code 2; never raises."""
    print(f"dask-ddp {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


# ---- waiting for a job ---------------------------------------------------------------------------------------

def wait_for(job, what: str) -> int:
    """Wait for ``job``; print the root cause and return 1 if it failed, cancel it and return 130 on Ctrl-C.

    ``job.result()`` (and its progress bar) runs in a helper thread. Ctrl-C only sets a flag here (a
    SIGINT handler of our own): a KeyboardInterrupt raised while the main thread happened to run a
    finaliser (``__del__``, a weakref callback, the garbage collector) is swallowed by Python, and the
    command then never stopped. Raises nothing: the job's error is printed (``what`` heads it).
    """
    outcome: list = []
    interrupted = threading.Event()
    waiter = threading.Thread(target=_collect, args=(job, outcome), name="dask-ddp-cli-wait", daemon=True)
    with _sigint_handler(lambda *_: interrupted.set()):
        waiter.start()
        while not outcome and not interrupted.wait(0.1):
            pass
    if interrupted.is_set() and not outcome:
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
    """Print a failed job's root cause on stderr: a headline naming the rank when known, then the traceback.

    The traceback starts at the first frame outside dask-ddp (the user's code).
    Raises nothing of its own.
    """
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
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(_PACKAGE):
        first = first.tb_next
    return first or tb


# ---- the cluster ---------------------------------------------------------------------------------------------

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
    from distributed import (
        Client,  # half a second to import: not for --help, usage errors or a rank
    )

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
    with _sigint_handler(signal.SIG_IGN):  # the worker processes inherit SIG_IGN: Ctrl-C is this process's to handle
        cluster = make()
    try:
        yield cluster
    finally:
        with _sigint_handler(signal.SIG_IGN):
            cluster.close()


def _gpu_count() -> int:
    import torch  # seconds to import: only when the local cluster's size depends on it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_cluster_kind(workers: int | None, dask_cuda: bool, gpus: int):
    """``(description, factory)`` of the local cluster to start: a pure choice, nothing is started.

    The cluster speaks TLS with temporary credentials (``Security.temporary()``, made for it and known only to
    this process and the cluster's): a plain-TCP scheduler on 127.0.0.1 takes code from any local user."""
    n = workers or gpus or 2

    def common() -> dict:
        from distributed.security import Security

        return dict(host="127.0.0.1", dashboard_address="127.0.0.1:0", threads_per_worker=1,
                    security=Security.temporary(), preload=["dask_ddp.worker.early"])  # torch imported meanwhile
    if gpus and dask_cuda and importlib.util.find_spec("dask_cuda") is not None:
        def make_cuda():
            from dask_cuda import LocalCUDACluster  # optional: dask-ddp[cuda]

            return LocalCUDACluster(n_workers=n, **common())
        return f"LocalCUDACluster with {n} workers (one GPU each; TLS)", make_cuda

    def make():
        from distributed import LocalCluster

        return LocalCluster(n_workers=n, processes=True, **common())
    return f"LocalCluster with {n} workers (TLS)", make


@contextlib.contextmanager
def _sigint_handler(handler):
    """SIGINT goes to ``handler`` (a callable, or ``signal.SIG_IGN``) inside the block; main thread only, else a
    no-op."""
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: signals are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---- TLS material for processes elsewhere --------------------------------------------------------------------

@dataclass(frozen=True)
class TLSFiles:
    """A cluster's TLS certificate and key as files, in a folder of their own that only this user can enter.

    For processes started elsewhere (``dask worker`` on other nodes, a notebook that connects): they read
    them there. ``Security.temporary()`` material is a self-signed certificate, its own CA: whoever holds the
    key is a member of the cluster, and whoever does not is refused.
    """

    folder: str
    cert: str
    key: str

    @classmethod
    def write(cls, security, base: str, prefix: str) -> "TLSFiles":
        """Write ``security``'s certificate and key (PEM text, as ``Security.temporary()`` holds them) to a new
        folder ``base/<prefix>XXXXXXXX`` (mode 0700, made atomically by ``mkdtemp``; files 0600, never through
        a link). Remove it with :meth:`remove`.

        Raises
        ------
        OSError
            ``base`` cannot be written: the message names it.
        """
        try:
            folder = tempfile.mkdtemp(prefix=prefix, dir=base)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot make the cluster's private TLS folder in {base}: {exc.strerror}; "
                                     "give a folder of yours that every node sees") from None
        paths = {}
        for name, text in (("cert", security.tls_scheduler_cert), ("key", security.tls_scheduler_key)):
            paths[name] = os.path.join(folder, f"{name}.pem")
            fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        return cls(folder, paths["cert"], paths["key"])

    def worker_args(self) -> list[str]:
        """The ``dask worker`` options that make it speak TLS with this material. Raises nothing."""
        return ["--tls-ca-file", self.cert, "--tls-cert", self.cert, "--tls-key", self.key]

    def client_code(self, address: str) -> str:
        """Python code that connects a client to the scheduler at ``address`` with this material. Raises nothing."""
        return (f"from distributed import Client, Security; client = Client({address!r}, security=Security("
                f"tls_ca_file={self.cert!r}, tls_client_cert={self.cert!r}, tls_client_key={self.key!r}, "
                "require_encryption=True))")

    def remove(self) -> None:
        """Remove the folder and its files (best effort). Raises nothing."""
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)
