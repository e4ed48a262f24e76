"""The rank supervisor: the Dask task that runs one rank in a child process.

Runs in: the Dask worker (a task thread), one :func:`supervise` task per rank,
pinned to its worker. It takes a warm rank process from the worker's
:class:`~dask_ddp.worker.plugin.RankHost` (or starts one), does the rendezvous (rank
0's child binds the store on port 0; the supervisor publishes the port in a
Dask ``Variable`` and sets an ``Event``; the others wait for it), starts the
job, relays the child's stdout/stderr and reports as Dask events, and watches
the attempt's abort ``Event``. It never raises for a rank's failure: it
returns a :class:`~dask_ddp.wire.outcome.RankOutcome` and the client's controller
decides. On failure it sets the abort event itself, so the other ranks stop
within a poll interval even if the client is gone.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from typing import Callable

import cloudpickle
from distributed import Event, Variable, get_worker
from distributed.core import Status as WorkerStatus

from dask_ddp.wire.errors import RankFailedError, RendezvousError
from dask_ddp.wire.messages import (
    Events,
    Failed,
    Flushed,
    FlushRequest,
    Notice,
    NoticeSeen,
    Port,
    Ready,
    Result,
    Saved,
    Stacks,
    StacksRequest,
    Start,
)
from dask_ddp.wire.notices import Stopped
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.task import RankTask
from dask_ddp.worker.plugin import RankHost
from dask_ddp.worker.process import RankProcess, stop_marked
from dask_ddp.worker.pump import PUMP_WAIT, OutputPump
from dask_ddp.worker.relay import Relay, drop_topic
from dask_ddp.worker.scheduler_call import on_scheduler
from dask_ddp.worker.stopping import ORPHANED, STOPPED, StopRule
from dask_ddp.worker.tmpdirs import worker_tmp_root

__all__ = ["supervise", "Supervisor", "forget_attempt"]

logger = logging.getLogger("dask_ddp")

_UNWANTED = {"cancelled", "released", "forgotten"}  # a task nobody wants any more (its client released it)
_CLOSING = (WorkerStatus.closing, WorkerStatus.closing_gracefully)


class Supervisor:
    """Runs one rank: see the module docstring. One instance per task."""

    def __init__(self, task: RankTask, worker):
        self.task = task
        self.rank = task.rank.rank
        self.worker = worker
        self.address = worker.address
        self.key = worker.get_current_task()
        self.host = RankHost.of(worker)
        self.relay = Relay(worker, task.topic, self.rank, task.attempt, task.attempt_id, task.flush_interval,
                           task.via, task.hub_interval, task.limits, task.joined)
        self.child: RankProcess | None = None
        self._stacks: deque = deque(maxlen=1)
        self._stacks_ready = threading.Event()
        self.rule = StopRule(Event(task.abort_event), Event(task.cancel_event), task.poll_interval, self._orphaned,
                             self._saving_notice, alone=task.recovery == "live")
        self.pump: OutputPump | None = None  # relays the rank's stdout and stderr
        self.ended = threading.Event()  # set once the outcome is made and everything the rank sent is relayed
        self.tmpdir: str | None = None
        self._notice: Notice | None = None  # a preemption notice this rank knows of: aborts wait for its deadline
        self._started = False  # the child has its Start: a Notice may follow
        self.declined = False  # the rank cannot save for a preemption (see NoticeSeen.can_save)

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        self.host.add(self)
        started = time.time()
        try:
            alone = self.task.rank.local_world_size < 2  # its GPU is device 0 as it is: CUDA may have started
            self.child = self.host.launcher.take(self.rule.aborted, self.task.spawn_timeout, cuda_ok=alone)
            if self.child is None:
                return self._finish(self._fail(Status.ABORTED, self.rule.reason or STOPPED), started)
            if self.task.spare_early:
                self.host.launcher.refill()
            if self.task.warm_cuda and alone:  # the next job's rank, forked now, starts CUDA while this one runs
                self.host.launcher.refill(ahead=True, cuda=True)
            self.child.pumped = True
            self.pump = OutputPump({"stdout": self.child.stdout, "stderr": self.child.stderr}, self.relay.log,
                                   self.rule.stopping_within, self.rank).start()
            self.relay.start()
            outcome = self._drive()
        except BaseException as exc:  # an error of dask-ddp itself: still an outcome, never a hang
            outcome = self._fail(Status.ERROR, f"the supervisor of rank {self.rank} failed: {exc!r}")
        return self._finish(outcome, started)

    def _finish(self, outcome: RankOutcome, started: float) -> RankOutcome:
        self.host.remove(self)
        if self.child is not None:
            self.child.kill()
            stop_marked(self.task.token)  # what it started in sessions of their own, after it can start no more
            if self.pump is not None:  # the rank's last lines reach the relay before it stops
                self.pump.join(PUMP_WAIT)
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        # The next job's spare (or zygote) starts now, not while this one trains: importing torch beside a
        # training rank slowed its steps by 15% on a 2-core box (benchmarks/RESULTS_dispatch.md). A job that
        # may restart started it early instead (spare_early): then this is a no-op. With the zygote, the next
        # job's rank is forked now too, while this outcome travels to the client.
        self.host.launcher.refill(ahead=True)
        self.relay.stop()
        outcome.started = started
        outcome.last_seq = self.relay.seq
        live = self.task.recovery == "live"  # its peers go on without it (dask_ddp.rank.live, rank.keeper)
        if outcome.status == Status.ERROR or outcome.status == Status.DIED and not live:
            self.rule.set_abort()
        if self.rule.reason == ORPHANED and self.rank == 0:
            forget_attempt(self.task)  # no client is left to do it
        self.ended.set()
        return outcome

    def stop(self, reason: str) -> None:
        """Stop the rank from another thread (its worker is closing); the run returns ABORTED.

        The supervisor's own thread ends it within a poll: it first asks the rank for the reports and lines it
        holds (up to 1 s, :meth:`_collect_held_events`), then kills it; :attr:`ended` is set once all is relayed.
        A rank of code that cannot save declines a closing worker's notice at once, and killing it here lost what
        it had gathered since its last flush. :meth:`kill` ends it at once.
        """
        self.rule.stop(reason)

    def kill(self) -> None:
        """End the rank's processes now (what :meth:`stop` did not end in time): SIGTERM to its group, a grace,
        then SIGKILL (:meth:`RankProcess.kill <dask_ddp.worker.process.RankProcess.kill>`)."""
        if self.child is not None:
            self.child.kill()

    def notice(self, notice: Notice) -> None:
        """Tell the rank that the job must save and stop by ``notice.deadline`` (its worker leaves, or the job
        grows); the first notice holds."""
        self._notice = self._notice or notice
        if self._started:
            self._send_notice()

    @property
    def saving(self) -> bool:
        """Whether a closing worker should wait for this rank: it runs the job's code and either saves at the
        agreed step, or (its code registered no save) may still save a periodic checkpoint in the grace period
        (the job has a ``checkpoint_dir``): the job resumes from the newest one."""
        if not (self._started and self.child is not None and self.child.alive()):
            return False
        return not self.declined or self.task.checkpoint_dir is not None

    def peer_lost(self, msg) -> None:
        """Tell a live job's rank (:class:`~dask_ddp.wire.messages.PeerLost`) that peers were lost: it re-forms its
        group without them. Nothing when the rank has not started or has ended; raises nothing."""
        if self._started and self.child is not None:
            try:
                self.child.send(msg)
            except OSError:  # the rank has ended
                pass

    def _send_notice(self) -> None:
        try:
            self.child.send(self._notice)
        except OSError:  # the rank has ended
            pass

    def _drive(self) -> RankOutcome:
        ready = self._recv_until(lambda m: isinstance(m, Ready), self.task.spawn_timeout, "start its rank process")
        if isinstance(ready, RankOutcome):
            return ready
        port = None
        if self.rank != 0 or self.task.joined:  # a live job's new rank 0 joins the store its keeper holds
            port = self._wait_port()
            if isinstance(port, RankOutcome):
                return port
        # Short, in the system's temp folder: multiprocessing (DataLoader workers passing tensors) binds
        # AF_UNIX sockets under TMPDIR, whose paths may not exceed 107 bytes; under a worker's local
        # directory (dask-cuda's is long) every batch failed to send and the DataLoader waited for good.
        self.tmpdir = tempfile.mkdtemp(prefix=tmpdir_prefix(self.task), dir=worker_tmp_root())
        self.child.send(Start(self.task, port, self.tmpdir))
        self._started = True
        if self._notice is not None:
            self._send_notice()
        return self._watch()

    def _recv_until(self, want: Callable, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.rule.aborted():
                return self._fail(Status.ABORTED, self.rule.reason or STOPPED)
            if self.child.conn.poll(0.05):
                try:
                    msg = self.child.conn.recv()
                except (EOFError, OSError):
                    return self._died()
                if want(msg):
                    return msg
                self._handle(msg)
            elif not self.child.alive():
                return self._died()
        return self._fail(Status.ERROR, f"rank {self.rank} on worker {self.address} could not {what} within "
                          f"{timeout:.0f} s", exc=RendezvousError)

    def _wait_port(self):
        # Wait on an Event (a timed-out Event.wait is quiet; a timed-out Variable.get logs a scheduler ERROR)
        ready = Event(self.task.port_variable + "-ready")
        deadline = time.monotonic() + self.task.rendezvous_timeout
        while time.monotonic() < deadline:
            if self.rule.aborted():
                return self._fail(Status.ABORTED, self.rule.reason or STOPPED)
            if ready.wait(timeout=self.task.poll_interval):
                return int(Variable(self.task.port_variable).get())
        return self._fail(Status.ERROR, f"rank {self.rank} on worker {self.address} waited "
                          f"{self.task.rendezvous_timeout:.0f} s for rank 0 to open the rendezvous store; "
                          "is rank 0's worker busy with other tasks?", exc=RendezvousError)

    def _watch(self) -> RankOutcome:
        """Relay the child's messages until it sends its result and exits, dies, or the job aborts."""
        child, result, exit_by = self.child, None, None
        while True:
            if child.conn.poll(0.05):
                try:
                    msg = child.conn.recv()
                except (EOFError, OSError):
                    return result or self._died()
                if isinstance(msg, Result):
                    result = RankOutcome(self.rank, self.address, Status.OK, value=msg.value)
                elif isinstance(msg, Saved):  # stopped at the agreed step; every rank passed the barrier
                    result = RankOutcome(self.rank, self.address, Status.PREEMPTED, preempt=msg.stopped)
                elif isinstance(msg, Failed):
                    result = RankOutcome(self.rank, self.address, Status.ERROR, error=msg.error, time=msg.time,
                                         secondary=msg.secondary, preempt=self._preempt(), message=msg.summary)
                    self.rule.set_abort()  # stop the others now, not when the client notices
                else:
                    self._handle(msg)
                if result is not None and exit_by is None:  # the child exits once its output is flushed
                    exit_by = time.monotonic() + 10
            elif not child.alive():
                if child.conn.poll(0):  # its last messages came after the look above, then it exited: read them
                    continue
                return result or self._died()
            if exit_by is not None and time.monotonic() > exit_by:
                return result  # stuck on its way out: the caller kills it, the outcome stands
            if result is None and self.rule.aborted():
                self._collect_held_events()
                return self._fail(Status.ABORTED, self.rule.reason or STOPPED)

    def _collect_held_events(self, timeout: float = 1.0) -> None:
        """Before a stopped rank is killed: relay the reports, logs and results it holds but has not flushed.

        Its listener thread answers even while the training code waits in a collective; a rank that does not
        answer within ``timeout`` (stopped, or holding the GIL in C code) is killed with what it held.
        """
        try:
            self.child.send(FlushRequest())
        except OSError:
            return
        self._relay_held(time.monotonic() + timeout)
        # published now, in this thread: the relay's own thread would publish it a tick later (it spaces the
        # rank's batches), after the kill, when a closing worker may no longer reach the scheduler
        self.relay.flush()

    def _relay_held(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            if not self.child.conn.poll(left):
                return
            try:
                msg = self.child.conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Flushed):
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        match msg:
            case Events(items):  # a batch the rank gathered for a flush interval: on its way at once
                self.relay.extend(items, now=True)
            case Port(port) if self.task.rank.world_size > 1:  # alone, a rank has nobody to tell (2 round trips)
                Variable(self.task.port_variable).set(int(port))
                Event(self.task.port_variable + "-ready").set()
            case NoticeSeen(notice, can_save):
                if not can_save:  # its code neither registered a save nor polls: nothing to wait for
                    self._notice, self.declined = self._notice or notice, True
                else:
                    self._notice = self._notice or notice
            case Stacks(text):
                self._stacks.append(text)
                self._stacks_ready.set()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _orphaned(self) -> bool:
        """Whether nobody wants this task any more: its client released it (closed, disconnected or died).

        A local read of the worker's own state: the scheduler cancels the task on the worker (within
        milliseconds of the client's connection closing) but cannot stop a running task; this does.
        """
        if self.worker.status in _CLOSING:  # closing cancels its tasks; its teardown stops (or drains) the ranks
            return False
        ts = self.worker.state.tasks.get(self.key) if self.key is not None else None
        return ts is None or ts.state in _UNWANTED

    def _died(self) -> RankOutcome:
        if self.rule.reason is not None:
            return self._fail(Status.ABORTED, self.rule.reason)
        code = self.child.wait(10)
        how = ("exited, how is unknown" if code is None else f"was killed by signal {signal.Signals(-code).name}"
               if code < 0 else f"exited with code {code}")
        time.sleep(0.05)  # let the output pumps catch the last lines
        tail = self.pump.tail() if self.pump is not None else ""
        return self._fail(Status.DIED, f"the process of rank {self.rank} on worker {self.address} {how} "
                          f"without a result" + (f"; its last stderr lines:\n{tail}" if tail else ""))

    def _fail(self, status: Status, message: str, exc: type = RankFailedError) -> RankOutcome:
        err = exc(message, rank=self.rank, worker=self.address)
        return RankOutcome(self.rank, self.address, status, error=cloudpickle.dumps(err), message=message,
                           preempt=self._preempt())

    def _saving_notice(self) -> Notice | None:
        """The notice the job's abort waits for: none once the rank declined it (its code saves nothing then)."""
        return None if self.declined else self._notice

    def _preempt(self) -> Stopped | None:
        """What a notice did to this rank when it ended otherwise than at the agreed step."""
        return None if self._notice is None else Stopped(self._notice)

    def stacks(self, timeout: float) -> str:
        """The child's Python stack dump, or a line saying why there is none."""
        if self.child is None or not self.child.alive():
            return "(no rank process running)"
        self._stacks_ready.clear()
        try:
            self.child.send(StacksRequest())
        except OSError as exc:
            return f"(could not ask for stacks: {exc})"
        if self._stacks_ready.wait(timeout):
            return self._stacks[-1]
        return f"(no answer within {timeout} s: the rank holds the GIL or is stopped)"


def tmpdir_prefix(task: RankTask) -> str:
    """The start of the name of a rank's TMPDIR (in :func:`worker_tmp_root`): ``<run hex>-<attempt>-r<rank>-``."""
    return f"{task.run_id[-8:]}-{task.attempt}-r{task.rank.rank}-"


def forget_attempt(task: RankTask, client=None) -> None:
    """Remove an attempt's abort flag and rendezvous port from the scheduler (best effort).

    One call to the scheduler, not the Event/Variable methods: deleting a Dask Variable logs a
    ``remove-client`` event under a topic of its own (``variable-<name>``) that nothing ever removes,
    one more per job for the scheduler's life; done on the scheduler, that topic goes in the same step.
    """
    try:
        client = client or get_worker().client
        on_scheduler(client, _forget_on_scheduler, task.abort_event, task.port_variable, task.cancel_event)
    except Exception:  # noqa: BLE001 - the scheduler may be gone; its state went with it
        pass


async def _forget_on_scheduler(abort_event: str, port_variable: str, cancel_event: str = "",
                               dask_scheduler=None) -> None:
    """On the scheduler: delete the port Variable and both Events, then the topic the delete logged under."""
    events = dask_scheduler.extensions["events"]
    for name in (abort_event, port_variable + "-ready", *([cancel_event] if cancel_event else [])):
        events.event_clear(name=name)  # a cleared Event nobody waits on is deleted
    await dask_scheduler.extensions["variables"].delete(name=port_variable)
    drop_topic(f"variable-{port_variable}", dask_scheduler=dask_scheduler)


def supervise(task: RankTask) -> RankOutcome:
    """The Dask task of one rank: run it in a child process and return its :class:`RankOutcome`."""
    return Supervisor(task, get_worker()).run()
