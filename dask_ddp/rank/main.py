"""The rank process: a child of a Dask worker that runs one rank of one job.

Runs in: the rank process: forked from its worker's zygote
(:mod:`dask_ddp.rank.zygote`, which calls :func:`serve`), or with ``ddp.zygote:
false`` started by the supervisor as ``python -m dask_ddp.rank.main FD``
(:func:`main`); either way in a process group of its own, with a socket to
the supervisor on file descriptor FD. torch is imported before a job comes;
the rank then waits for a :class:`~dask_ddp.wire.messages.Start`. The messages
both ways are the types of :mod:`dask_ddp.wire.messages`.

The child kills its whole process group (itself and its DataLoader workers)
when the socket closes or its Dask worker process is gone, so a dead
supervisor or Dask worker never leaves a rank behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import cloudpickle
from tblib import pickling_support

from dask_ddp.rank import context, devices, network, preemption, reporting, telemetry
from dask_ddp.wire import pickling
from dask_ddp.wire.errors import (
    RankExitError,
    RankFailedError,
    RendezvousError,
    SerializationError,
)
from dask_ddp.wire.messages import (
    Events,
    Failed,
    Flushed,
    FlushRequest,
    Notice,
    Port,
    Ready,
    Result,
    Saved,
    Stacks,
    StacksRequest,
    Start,
)
from dask_ddp.wire.task import RankTask

# Text of gloo's and NCCL's plain RuntimeErrors for a broken connection: the last resort of
# _is_collective_error, for the errors torch gives no type of their own (gloo raises RuntimeError)
_COLLECTIVE_TEXT = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                    "ProcessGroupNCCL", "ProcessGroupGloo")


def _die() -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)


def _die_with_parent() -> None:
    """Kill the rank (and its DataLoader workers) once the Dask worker that started it is gone.

    Started before ``import torch``: the socket is read only after that import, which can take many
    seconds on a loaded machine, and a spare must not outlive its worker for so long.
    """
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        _die()
    threading.Thread(target=watch, name="dask-ddp-parent-watch", daemon=True).start()


def _format_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if names.get(ident, "").startswith("dask-ddp-"):
            continue
        out.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class _Channel:
    """The socket to the supervisor, safe to send on from several threads."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self.flusher: reporting.Flusher | None = None  # set once the job's report buffer exists

    def send(self, msg) -> None:
        with self._lock:
            self.conn.send(msg)

    def listen(self) -> None:
        """Serve the supervisor's requests in a daemon thread; die when the socket closes."""
        def loop():
            try:
                while True:
                    msg = self.conn.recv()
                    if isinstance(msg, StacksRequest):
                        self.send(Stacks(_format_stacks()))
                    elif isinstance(msg, FlushRequest):
                        if self.flusher is not None:  # its lock orders the batch before the answer
                            self.flusher.flush()
                        self.send(Flushed())
                    elif isinstance(msg, Notice):  # a worker of the job leaves: tell every rank
                        preemption.announce(msg)
            except (EOFError, OSError):
                _die()
        threading.Thread(target=loop, name="dask-ddp-listener", daemon=True).start()


def _serialize_error(exc: BaseException, rank: int, worker: str) -> bytes:
    exc.add_note(f"[dask-ddp] raised on rank {rank}, worker {worker}; the other ranks were stopped")
    pickling_support.install(exc)
    try:
        return cloudpickle.dumps(exc)
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return cloudpickle.dumps(RankFailedError(f"rank {rank} on worker {worker} raised an exception that cannot "
                                                 f"be pickled back to the client:\n{text}", rank=rank, worker=worker))


def _use_tmpdir(path: str | None) -> None:
    """Point ``tempfile`` (and what the rank starts, through TMPDIR) at the folder the supervisor removes."""
    if path:
        os.environ["TMPDIR"] = path
        tempfile.tempdir = path  # gettempdir() caches its first answer; the zygote may have asked already


def _run_job(chan: _Channel, task: RankTask, master_port: int | None) -> None:
    import torch.distributed as dist  # imported (warm) by main() already; here for its name

    spec = task.rank
    rank, world_size, worker = spec.rank, spec.world_size, spec.address
    buf = reporting.EventBuffer(rank, task.attempt)
    sampler = telemetry.start(rank, task.attempt, task.telemetry_interval) if task.telemetry_interval else None
    flusher = chan.flusher = reporting.install(buf, lambda items: chan.send(Events(items)), task.flush_interval,
                                               sampler)
    timeout = timedelta(seconds=task.timeout)
    try:
        os.environ.update(task.env)
        fn, args, kwargs = cloudpickle.loads(task.call)  # fails here, before any rendezvous, if it must
        pickling.expose_main(fn, *args, *kwargs.values())  # the notebook's functions, as __main__.<name>
        pinned = network.pin_interfaces(spec.host)
        store = _open_store(chan, task, master_port)
        if rank == 0 and pinned:  # worth a line in the notebook only where the interface matters: across hosts
            logging.getLogger("dask_ddp").log(
                logging.INFO if spec.num_nodes > 1 else logging.DEBUG,
                "collectives use interface %s (the worker's address %s); set %s to choose another",
                next(iter(pinned.values())), spec.host, " / ".join(pinned))
        backend, device, device_ids = devices.place(store, rank, world_size, worker, task.backend,
                                                    spec.local_rank, spec.local_world_size)
        if sampler is not None:
            sampler.device = device
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)  # nccl: collectives on it
        _join(store, world_size)
        preemption.start(store, task.master_addr, int(os.environ["MASTER_PORT"]), rank, world_size, chan.send,
                         preemption.grace_period(), worker)
        context._set_context(context.Context(
            rank=rank, local_rank=spec.local_rank, world_size=world_size,
            local_world_size=spec.local_world_size, node_rank=spec.node_rank, num_nodes=spec.num_nodes,
            device=device, device_ids=device_ids, backend=backend, run_id=task.run_id,
            restart_count=task.attempt, max_restarts=task.max_restarts, worker=worker,
            master_addr=task.master_addr, master_port=store.port, checkpoint_dir=task.checkpoint_dir,
            checkpoint_options=task.checkpoint_options))
        try:
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            value = _exit_value(exc, rank, worker)
        blob = _pickle_value(value, rank, worker)
        _finish(store, rank, world_size)
        message = Result(blob)
    except preemption.Preempted as exc:  # stopped at the agreed step: wait until the save is committed
        message = Saved(preemption.stopped(exc))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the client
        exc = _as_exception(exc, rank, worker)
        _add_hint(exc)
        # a broken collective on a survivor is a consequence, not a root cause
        message = Failed(_serialize_error(exc, rank, worker), time.time(), _is_collective_error(exc))
    # The outcome goes out before the process group is destroyed: destroying it breaks the other ranks'
    # collectives, and their errors must not reach the supervisors before this rank's own.
    flusher.stop()
    chan.send(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_value(exc: SystemExit, rank: int, worker: str) -> None:
    """The value of a rank whose function called ``sys.exit``: None for ``sys.exit()`` and ``sys.exit(0)``
    (torchrun counts exit code 0 as success).

    Raises
    ------
    RankExitError
        Any other code, or a message (Python exits with code 1 for it); the ``SystemExit`` is its cause.
    """
    what = RankExitError.describe(exc.code)
    if what is None:
        return None
    raise RankExitError(f"the function called sys.exit with {what} on rank {rank} (worker {worker})",
                        code=exc.code, rank=rank, worker=worker) from exc


def _as_exception(exc: BaseException, rank: int, worker: str) -> BaseException:
    """``exc``, or for a ``BaseException`` that is no ``Exception`` (``KeyboardInterrupt``, ``GeneratorExit``,
    a ``SystemExit`` from outside the function) a :class:`RankFailedError` caused by it: re-raised as such in
    the notebook, it would read as the user's own Ctrl-C or end a script, and pass ``except Exception``."""
    if isinstance(exc, Exception):
        return exc
    err = RankFailedError(f"rank {rank} on worker {worker} raised {type(exc).__name__}: {exc}", rank=rank,
                          worker=worker)
    err.__cause__ = exc
    return err


def _add_hint(exc: BaseException) -> None:
    """Add a note saying what to do to a rank's error that has a known cause in how the function was written."""
    if isinstance(exc, ValueError) and "initialize the default process group twice" in str(exc):
        import torch.distributed as dist

        backend = dist.get_backend() if dist.is_initialized() else "?"
        exc.add_note(f"[dask-ddp] dask-ddp initialises the process group before it calls your function (backend "
                     f"{backend}, torchrun's environment set): remove the function's own "
                     "dist.init_process_group(...), or call it only `if not dist.is_initialized()`. An unchanged "
                     "torchrun script runs with `dask-ddp run script.py`.")


def _pickle_value(value, rank: int, worker: str) -> bytes:
    """The function's return value, pickled to go back to the client.

    Raises
    ------
    SerializationError
        It cannot be pickled (a lock, an open file, a generator, ...); the pickling error is its cause.
    """
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise SerializationError(
            f"rank {rank} on worker {worker}: the function's return value ({kind}) cannot be pickled back to the "
            f"client: {type(exc).__name__}: {exc}. Return plain values (numbers, tensors, dicts of them); save "
            "models and large state with dask_ddp.save_checkpoint", rank=rank, worker=worker) from exc


def _open_store(chan: _Channel, task: RankTask, master_port: int | None):
    """Rank 0: host the rendezvous store on ``master_addr`` only (a port the OS picks: no race, no collision)
    and send its port. Other ranks: connect within ``rendezvous_timeout``, then wait on the store as long as
    the collectives do (``timeout``).

    Raises
    ------
    RendezvousError
        ``master_addr`` is not an address of rank 0's host, or a rank cannot reach the store in time.
    """
    import torch.distributed as dist

    spec, timeout = task.rank, timedelta(seconds=task.timeout)
    if spec.rank == 0:
        sock = network.listen(task.master_addr, rank=0, worker=spec.address)
        host, port = sock.getsockname()[:2]
        store = dist.TCPStore(host, port, spec.world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.detach())  # the store owns it now
        chan.send(Port(port))
    else:
        port = master_port
        try:
            store = dist.TCPStore(task.master_addr, port, spec.world_size, is_master=False,
                                  timeout=timedelta(seconds=task.rendezvous_timeout))
        except dist.DistError as exc:
            raise RendezvousError(
                f"rank {spec.rank} on worker {spec.address} could not reach the rendezvous store at "
                f"{task.master_addr}:{port} within {task.rendezvous_timeout:g} s (ddp.rendezvous-timeout): "
                f"{str(exc).splitlines()[0]}. Is master_addr an address every worker can reach, and is the port "
                "open between the workers (firewall, NetworkPolicy)?") from None
        store.set_timeout(timeout)
    os.environ["MASTER_PORT"] = str(port)
    return store


def _join(store, world_size: int) -> None:
    """Wait until every rank has its process group: no rank starts the function (and fails) before all joined."""
    if store.add("dask_ddp/joined", 1) == world_size:
        store.set("dask_ddp/all_joined", "1")
    store.wait(["dask_ddp/all_joined"])


def _is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a broken collective (a peer went away) rather than the rank's own failure.

    By type first: torch's ``DistError`` family (NCCL's ``DistBackendError``, the store's
    ``DistStoreError``/``DistNetworkError``). Then by where it was raised: a ``RuntimeError`` from
    inside ``torch.distributed``'s Python API. Last, and only for the ``RuntimeError`` that gloo
    raises from C++ with no type of its own (for instance inside DDP's backward all-reduce), by its
    text (``_COLLECTIVE_TEXT``): checked on torch 2.14, gloo's "Connection reset by peer".
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and "torch/distributed/" in frames[-1].filename.replace("\\", "/"):
        return True
    return any(mark in str(exc) for mark in _COLLECTIVE_TEXT)


def _finish(store, rank: int, world_size: int, wait: float = 30.0) -> None:
    """Rank 0 hosts the store: it stays until every rank has finished, so no rank loses it early; then every
    rank's notice watcher is let go (:func:`preemption.release`) before the store can close."""
    store.add("dask_ddp/done", 1)
    if rank == 0:
        deadline = time.monotonic() + wait
        while store.add("dask_ddp/done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    preemption.release(store, rank, world_size)  # no notice watcher left waiting on the store when it closes


def warm_imports() -> None:
    """Import what every job needs, so that a job does not wait for it: torch, its distributed package,
    DDP and ``torch._dynamo`` (which DDP's first construction imports). Never initialises CUDA."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401 - DistributedDataParallel
    try:  # DDP's first construction imports torch._dynamo: seconds that a job would otherwise wait for
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass


def serve(fd: int) -> None:
    """Be a rank on the socket ``fd``: say Ready, wait for a Start, run that job, exit. Never returns."""
    # as `python script.py` has it: SIGINT raises KeyboardInterrupt (the worker ignores it: plugin.ignore_interrupts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chan = _Channel(Connection(fd))
    chan.send(Ready(os.getpid()))
    try:
        msg = chan.conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    if not isinstance(msg, Start):
        os._exit(0)
    chan.listen()
    _use_tmpdir(msg.tmpdir)
    _run_job(chan, msg.task, msg.master_port)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dask_ddp.rank.main FD``: warm up, then :func:`serve` (a spawned rank)."""
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    warm_imports()  # after the parent watch started (it can take many seconds), before Ready
    serve(int(argv[0]))


if __name__ == "__main__":
    main()
