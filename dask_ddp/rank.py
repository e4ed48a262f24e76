"""The rank process: a child of a Dask worker that runs one rank of one job.

Started by the supervisor (:mod:`dask_ddp.supervisor`) as
``python -m dask_ddp.rank FD`` in its own process group, with a socket to the
supervisor on file descriptor FD. It imports torch at once and then waits,
warm, for a job: this is what makes a spare cheap to start a job with.

Protocol (pickled tuples over the socket)::

    child -> supervisor: ("ready", pid) ("port", port) ("events", [..])
                         ("result", bytes) ("error", bytes) ("stacks", text)
    supervisor -> child: ("start", payload) ("stacks",) ("abort",)

The child kills its whole process group (itself and its DataLoader workers)
on ``abort`` or when the socket closes, so a dead supervisor or Dask worker
never leaves a rank behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection


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

    def send(self, msg) -> None:
        with self._lock:
            self.conn.send(msg)

    def listen(self) -> None:
        """Serve the supervisor's requests in a daemon thread; die on abort or a closed socket."""
        def loop():
            try:
                while True:
                    msg = self.conn.recv()
                    if msg[0] == "stacks":
                        self.send(("stacks", _format_stacks()))
                    elif msg[0] == "abort":
                        _die()
            except (EOFError, OSError):
                _die()
        threading.Thread(target=loop, name="dask-ddp-listener", daemon=True).start()


def _serialize_error(exc: BaseException, rank: int, worker: str) -> bytes:
    import cloudpickle
    from tblib import pickling_support

    from .errors import RankFailedError

    exc.add_note(f"[dask-ddp] raised on rank {rank}, worker {worker}; the other ranks were stopped")
    pickling_support.install(exc)
    try:
        return cloudpickle.dumps(exc)
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return cloudpickle.dumps(RankFailedError(f"rank {rank} on worker {worker} raised an exception that cannot "
                                                 f"be pickled back to the client:\n{text}", rank=rank, worker=worker))


def _run_job(chan: _Channel, payload: dict) -> None:
    import cloudpickle
    import torch
    import torch.distributed as dist

    from . import context, devices, reporting

    spec = payload["rank"]
    rank, world_size, worker = spec["rank"], spec["world_size"], spec["address"]
    buf = reporting.EventBuffer(rank, payload["attempt"])
    flusher = reporting.install(buf, lambda items: chan.send(("events", items)), payload["flush_interval"])
    timeout = timedelta(seconds=payload["timeout"])
    store = None
    try:
        os.environ.update(payload["env"])
        fn, args, kwargs = cloudpickle.loads(payload["call"])  # fails here, before any rendezvous, if it must
        if rank == 0:
            store = dist.TCPStore(payload["master_addr"], 0, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            chan.send(("port", store.port))  # bound by the OS on port 0: no race, no collision
        else:
            store = dist.TCPStore(payload["master_addr"], payload["master_port"], world_size, is_master=False,
                                  timeout=timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        backend, device, device_ids = devices.place(store, rank, world_size, worker, payload["backend"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if backend == "nccl" else None)  # nccl: collectives on it
        _join(store, world_size)
        context._set_context(context.Context(
            rank=rank, local_rank=spec["local_rank"], world_size=world_size,
            local_world_size=spec["local_world_size"], node_rank=spec["node_rank"], num_nodes=spec["num_nodes"],
            device=device, device_ids=device_ids, backend=backend, run_id=payload["run_id"],
            restart_count=payload["attempt"], max_restarts=payload["max_restarts"], worker=worker,
            master_addr=payload["master_addr"], master_port=store.port, checkpoint_dir=payload["checkpoint_dir"],
            checkpoint_options=payload["checkpoint_options"]))
        value = fn(*args, **kwargs)
        blob = cloudpickle.dumps(value)
        _finish(store, rank, world_size)
        message = ("result", blob)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the client
        # a broken collective on a survivor is a consequence, not a root cause
        message = ("error", _serialize_error(exc, rank, worker), time.time(), _is_collective_error(exc))
    # The outcome goes out before the process group is destroyed: destroying it breaks the other ranks'
    # collectives, and their errors must not reach the supervisors before this rank's own.
    flusher.stop()
    chan.send(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def _join(store, world_size: int) -> None:
    """Wait until every rank has its process group: no rank starts the function (and fails) before all joined."""
    if store.add("dask_ddp/joined", 1) == world_size:
        store.set("dask_ddp/all_joined", "1")
    store.wait(["dask_ddp/all_joined"])


def _is_collective_error(exc: BaseException) -> bool:
    """A failed collective (a peer went away): torch's DistError, or gloo's and NCCL's plain RuntimeErrors."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                                  "NCCL error", "ProcessGroupNCCL", "ProcessGroupGloo"))


def _finish(store, rank: int, world_size: int, wait: float = 30.0) -> None:
    """Rank 0 hosts the store: it stays until every rank has finished, so no rank loses it early."""
    store.add("dask_ddp/done", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + wait
    while store.add("dask_ddp/done", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    chan = _Channel(Connection(int(argv[0])))
    _die_with_parent()
    import cloudpickle  # noqa: F401 - warm the imports a job needs before announcing readiness
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401 - DistributedDataParallel
    try:  # DDP's first construction imports torch._dynamo: seconds that a job would otherwise wait for
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - an optional speed-up only
        pass

    import dask_ddp.context  # noqa: F401
    import dask_ddp.devices  # noqa: F401

    chan.send(("ready", os.getpid()))
    try:
        kind, payload = chan.conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    if kind != "start":
        os._exit(0)
    chan.listen()
    _run_job(chan, payload)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
