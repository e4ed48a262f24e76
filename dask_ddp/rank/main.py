"""The rank process: a child of a Dask worker that runs one rank of one job.

Runs in: the rank process: forked from its worker's zygote
(:mod:`dask_ddp.rank.zygote`, which calls :func:`serve`), or with ``ddp.zygote:
false`` started by the supervisor as ``python -m dask_ddp.rank.main FD``
(:func:`main`); either way in a process group of its own, with a socket to
the supervisor on file descriptor FD. torch is imported before a job comes;
the rank then waits for a :class:`~dask_ddp.wire.messages.Start`. The messages
both ways are the types of :mod:`dask_ddp.wire.messages`.

The child ends its whole process group (itself and its DataLoader workers)
when the socket closes (its supervisor hangs up: a cancel, a stop, the end of
the job) or its Dask worker process is gone, so a dead supervisor or Dask
worker never leaves a rank behind (:func:`_die`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection

import cloudpickle

from dask_ddp.checkpoint.sharded import background as sharded_async
from dask_ddp.rank import context, live, preemption, reporting, telemetry, trainers, warm
from dask_ddp.rank.outcome import outcome
from dask_ddp.rank.rendezvous import Joined, finish, rendezvous
from dask_ddp.rank.warm import warm_cuda, warm_imports
from dask_ddp.wire import pickling
from dask_ddp.wire.events import preloaded_item
from dask_ddp.wire.messages import (
    Events,
    Flushed,
    FlushRequest,
    Notice,
    PeerLost,
    Ready,
    Stacks,
    StacksRequest,
    Start,
    WarmCuda,
)
from dask_ddp.wire.task import RankTask

DIE_GRACE = 5.0  # seconds, after SIGTERM, before this rank SIGKILLs its own group: longer than its supervisor's
# STOP_GRACE + TRACKER_WAIT (dask_ddp.worker.process), whose own ending spares the resource tracker longer
_ENDING = threading.Event()  # this rank is ending: a SIGTERM is no preemption notice


def _die() -> None:
    """End this rank and its process group: its supervisor hung up, or its Dask worker is gone.

    SIGTERM to the group, this process included: the DataLoader workers and helpers end, and the group's
    resource tracker, which ignores SIGTERM, outlives them and removes the shared memory and semaphores they
    leaked (SIGKILL to the whole group killed it too). Where SIGTERM does what dask-ddp set, this process
    takes its default action at once, even while its main thread waits in a collective (a Python handler,
    the preemption protocol's, would run only once that thread is back in Python); a handler of the job's
    own code (or SIG_IGN) is left to do as it says. SIGKILL to the group comes only if this process is still
    there after :data:`DIE_GRACE`.
    """
    _ENDING.set()
    if preemption.sigterm_is_ours():
        _default_sigterm()
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGTERM)  # 0: this process's own group (no pid that could be another's)
    time.sleep(DIE_GRACE)
    os.killpg(0, signal.SIGKILL)


def _default_sigterm() -> None:
    """Give SIGTERM its default action (end the process) from any thread: ``signal.signal`` may only be
    called in the main thread. Python's own record of its handler is left stale: this process is ending."""
    try:
        import ctypes

        ctypes.CDLL(None).signal(signal.SIGTERM, 0)  # SIG_DFL
    except (OSError, AttributeError):  # no C library to call: the handler ends it (see preemption.start)
        pass


def die_with_parent() -> None:
    """Kill the rank (and its DataLoader workers) once the Dask worker that started it is gone.

    Started before ``import torch``: the socket is read only after that import, which can take many
    seconds on a loaded machine, and a spare must not outlive its worker for so long. Called by a spawned rank
    (:func:`main`) and by the zygote's forked child (:mod:`dask_ddp.rank.zygote`). Raises nothing.
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
            try:
                self.conn.send(msg)
            except OSError:
                if self.ending():  # the supervisor hung up: nobody reads any more (a rank deaf to SIGTERM
                    return  # runs on until SIGKILL; its reports must not fail it meanwhile)
                raise

    def ending(self) -> bool:
        """Whether this rank is ending on purpose: :func:`_die` runs, or its supervisor has hung up. Read in
        the SIGTERM handler (see :func:`dask_ddp.rank.preemption.start`): the supervisor hangs up before it
        sends SIGTERM, so a stop is never taken for a preemption notice, whichever thread sees it first."""
        if _ENDING.is_set():
            return True
        try:
            poller = select.poll()
            poller.register(self.conn.fileno(), getattr(select, "POLLRDHUP", 0) | select.POLLHUP)
            return bool(poller.poll(0))
        except (OSError, ValueError):  # closed: it is ending
            return True

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
                    elif isinstance(msg, PeerLost):  # a live job lost ranks: its group re-forms without them
                        live.peer_lost(msg.ranks, msg.replaced, msg.joined)
            except (EOFError, OSError):
                _die()
        threading.Thread(target=loop, name="dask-ddp-listener", daemon=True).start()


def _use_tmpdir(path: str | None) -> None:
    """Point ``tempfile`` (and what the rank starts, through TMPDIR) at the folder the supervisor removes."""
    if path:
        os.environ["TMPDIR"] = path
        tempfile.tempdir = path  # gettempdir() caches its first answer; the zygote may have asked already


def run_job(chan: _Channel, task: RankTask, master_port: int | None) -> None:
    """Run one rank of one attempt: its reports and telemetry, the rendezvous, the call, its outcome.

    The process group is not destroyed: the process exits right after its outcome is sent (:func:`serve`), and
    its exit closes the group's connections and frees its memory as ``destroy_process_group`` would, without its
    wait, which is on the path from a sweep trial's stop to the next trial's start: 20 ms of gloo's in a 2-rank
    job here, 0.47 s of nccl's on an H200 (``benchmarks/gpu_turnover_parts.py``). nccl unlinks its
    shared-memory files once connected, so an exit leaves none behind. The outcome goes first: the exit breaks
    the other ranks' collectives, and their errors must not reach the supervisors before this rank's own."""
    spec = task.rank
    buf = reporting.EventBuffer(spec.rank, task.attempt, task.limits)
    sampler = (telemetry.start(spec.rank, task.attempt, task.telemetry_interval, task.joined)
               if task.telemetry_interval else None)
    flusher = chan.flusher = reporting.install(buf, lambda items: chan.send(Events(items)), task.flush_interval,
                                               sampler)
    if spec.rank == 0 and (warm.PRELOADED or warm.PRELOAD_FAILED):  # ddp.zygote-preload, for job.history
        chan.send(Events([preloaded_item(0, task.attempt, warm.PRELOADED, warm.PRELOAD_FAILED)]))
    joined: list[Joined] = []

    def call():
        os.environ.update(task.env)
        fn, args, kwargs = cloudpickle.loads(task.call)  # fails here, before any rendezvous, if it must
        pickling.expose_main(fn, *args, *kwargs.values())  # the notebook's functions, as __main__.<name>
        joined.append(rendezvous(chan.send, task, master_port, sampler, ending=chan.ending))
        context.set_context(context_of(task, joined[0]))
        trainers.prepare(context.get_context())  # Lightning's, Transformers' and Accelerate's defaults: distributed
        value = fn(*args, **kwargs)
        sharded_async.wait_previous()  # an async sharded save still uploading commits (or fails) before the outcome
        return value

    message = outcome(call, spec.rank, spec.address,
                      finish=lambda: finish(joined[0].keys, spec.rank, spec.world_size))
    flusher.stop()
    chan.send(message)


def context_of(task: RankTask, joined: Joined) -> context.Context:
    """What ``get_context()`` returns in the rank of ``task``, once it has joined."""
    spec = task.rank
    return context.Context(
        rank=spec.rank, local_rank=spec.local_rank, world_size=spec.world_size,
        local_world_size=spec.local_world_size, node_rank=spec.node_rank, num_nodes=spec.num_nodes,
        device=joined.device, device_ids=joined.device_ids, backend=joined.backend, run_id=task.run_id,
        restart_count=task.attempt, max_restarts=task.max_restarts, worker=spec.address,
        master_addr=task.master_addr, master_port=joined.store.port, checkpoint_dir=task.checkpoint_dir,
        checkpoint_options=task.checkpoint_options)


def serve(fd: int) -> None:
    """Be a rank on the socket ``fd``: say Ready, wait for a Start, run that job, exit. Never returns."""
    # as `python script.py` has it: SIGINT raises KeyboardInterrupt (the worker ignores it: plugin.ignore_interrupts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    chan = _Channel(Connection(fd))
    chan.send(Ready(os.getpid()))
    try:
        msg = chan.conn.recv()
        if isinstance(msg, WarmCuda):  # forked ahead of its job: start CUDA while the job is on its way
            warm_cuda()
            msg = chan.conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    if not isinstance(msg, Start):
        os._exit(0)
    chan.listen()
    _use_tmpdir(msg.tmpdir)
    run_job(chan, msg.task, msg.master_port)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m dask_ddp.rank.main FD``: warm up, then :func:`serve` (a spawned rank)."""
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    warm_imports()  # after the parent watch started (it can take many seconds), before Ready
    serve(int(argv[0]))


if __name__ == "__main__":
    main()
