"""The rank supervisor: the Dask task that runs one rank in a child process.

One :func:`supervise` task per rank, pinned to its worker. It takes a warm
rank process (a spare started after the previous job, or a new one), does
the rendezvous (rank 0's child binds the store on port 0 and the supervisor
publishes the port in a Dask ``Variable`` and sets an ``Event``; the others
wait for it), starts
the job, relays the child's stdout/stderr and reports as Dask events, and
watches the job's abort ``Event``. It never raises for a rank's failure: it
returns a :class:`RankOutcome` and the client's :class:`~dask_ddp.job.Job`
decides. On failure it sets the abort event itself, so the other ranks stop
within a poll interval even if the client is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import dask

from .events import Relay

__all__ = ["RankOutcome", "supervise", "rank_process_pids", "dump_stacks", "warm_spare"]

_ACTIVE: dict[tuple[str, int], "Supervisor"] = {}  # live supervisors of this worker, for dump_stacks


@dataclass
class RankOutcome:
    """How one rank ended, as its supervisor saw it (status: ok, error, died, aborted)."""

    rank: int
    worker: str
    status: str
    value: bytes | None = None
    error: bytes | None = None
    message: str = ""
    time: float = field(default_factory=time.time)
    last_seq: int = -1
    started: float = 0.0
    secondary: bool = False


class RankProcess:
    """A warm child interpreter (``python -m dask_ddp.rank``) with torch imported, in its own process group."""

    def __init__(self):
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # The Nanny sets MALLOC_TRIM_THRESHOLD_=65536 for the worker (distributed.nanny.pre-spawn-environ);
        # in a training process it makes glibc give memory back after every step: a few % slower per step.
        if env.get("MALLOC_TRIM_THRESHOLD_") == str(dask.config.get("distributed.nanny.pre-spawn-environ", {})
                                                   .get("MALLOC_TRIM_THRESHOLD_", "")):
            env.pop("MALLOC_TRIM_THRESHOLD_")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dask_ddp.rank", str(child.fileno())], pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env=env)
        child.close()
        self.conn = Connection(parent.detach())
        self.pid = self.proc.pid
        self._send_lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def kill(self) -> None:
        """SIGKILL the child's whole process group (DataLoader workers included) and reap it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
        self.conn.close()


class _Spares:
    """At most one warm, unused rank process per Dask worker process."""

    def __init__(self):
        self._lock = threading.Condition()
        self._spare: RankProcess | None = None
        self._filling = False

    def take(self) -> RankProcess:
        """The warm spare if there is one (waiting for one being started), else a new rank process."""
        with self._lock:
            self._lock.wait_for(lambda: not self._filling, timeout=10)
            spare, self._spare = self._spare, None
        if spare is not None and spare.alive():
            return spare
        if spare is not None:
            spare.kill()
        return RankProcess()

    def refill(self, force: bool = False) -> None:
        """Start a spare in the background for the next job (ddp.warm-spare, or ``force``)."""
        if not (force or dask.config.get("ddp.warm-spare")):
            return
        with self._lock:
            if self._spare is not None or self._filling:
                return
            self._filling = True

        def fill():
            try:
                proc = RankProcess()
            except Exception:  # noqa: BLE001 - no spare then; take() starts one when needed
                proc = None
            with self._lock:
                self._spare, self._filling = proc, False
                self._lock.notify_all()

        threading.Thread(target=fill, name="dask-ddp-spare", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the spare has imported torch (its "ready" is waiting to be read); True if it has."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._lock.wait_for(lambda: not self._filling, timeout=timeout)
            spare = self._spare
        if spare is None or not spare.alive():
            return False
        while time.monotonic() < deadline:  # poll: take() may hand the spare to a job meanwhile
            try:
                if spare.conn.poll(0.1):
                    return True
            except OSError:  # closed: a job took it and has finished with it
                return False
            if not spare.alive():
                return False
        return False

    def pids(self) -> list[int]:
        with self._lock:
            return [self._spare.pid] if self._spare is not None else []


_SPARES = _Spares()


def rank_process_pids() -> dict:
    """Pids of this worker's rank processes: ``{"spare": [...], "running": [...]}`` (for tests and tools)."""
    return {"spare": _SPARES.pids(), "running": [s.child.pid for s in list(_ACTIVE.values()) if s.child]}


async def warm_spare(timeout: float = 120.0) -> bool:
    """Start this worker's spare rank process now and wait until torch is imported; run through ``client.run``."""
    import asyncio

    _SPARES.refill(force=True)
    return await asyncio.to_thread(_SPARES.wait_ready, timeout)


async def dump_stacks(run_id: str, timeout: float = 5.0) -> dict:
    """Ask this worker's ranks of ``run_id`` for a Python stack dump; run through ``client.run``."""
    import asyncio

    sups = [s for (rid, _), s in list(_ACTIVE.items()) if rid == run_id]
    results = await asyncio.gather(*(asyncio.to_thread(s.stacks, timeout) for s in sups))
    return {s.rank: text for s, text in zip(sups, results)}


class Supervisor:
    """Runs one rank: see the module docstring. One instance per task."""

    def __init__(self, task: dict):
        from distributed import Event, get_worker

        self.task = task
        self.rank = task["rank"]["rank"]
        self.worker = get_worker()
        self.address = self.worker.address
        self.abort = Event(task["abort_event"])
        self.relay = Relay(self.worker, task["topic"], self.rank, task["attempt"], task["run_id"],
                           task["payload"].get("flush_interval"))
        self.child: RankProcess | None = None
        self.outcome: RankOutcome | None = None
        self._stacks: deque = deque(maxlen=1)
        self._stacks_ready = threading.Event()
        self._stderr_tail: deque = deque(maxlen=30)
        self._last_abort_check = 0.0

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        key = (self.task["run_id"], self.rank)
        _ACTIVE[key] = self
        started = time.time()
        try:
            self.child = _SPARES.take()
            if self.task.get("spare_early"):
                _SPARES.refill()
            self._pump_output()
            self.relay.start()
            self.outcome = self._drive()
        except BaseException as exc:  # an error of dask-ddp itself: still an outcome, never a hang
            self.outcome = self._fail("error", f"the supervisor of rank {self.rank} failed: {exc!r}")
        finally:
            _ACTIVE.pop(key, None)
            if self.child is not None:
                self.child.kill()
            # The next job's spare starts now, not while this one trains: importing torch beside a training
            # rank slowed its steps by 15% on a 2-core box (benchmarks/RESULTS_dispatch.md). A job that may
            # restart started it early instead (spare_early): then this is a no-op.
            _SPARES.refill()
            self.relay.stop()
        self.outcome.started = started
        self.outcome.last_seq = self.relay.seq
        if self.outcome.status in ("error", "died"):
            self._set_abort()
        return self.outcome

    def _drive(self) -> RankOutcome:
        child, task = self.child, self.task
        ready = self._recv_until(lambda m: m[0] == "ready", task["spawn_timeout"], "start its rank process")
        if isinstance(ready, RankOutcome):
            return ready
        payload = dict(task["payload"], master_port=None)
        if self.rank != 0:
            port = self._wait_port()
            if isinstance(port, RankOutcome):
                return port
            payload["master_port"] = port
        child.send(("start", payload))
        return self._watch()

    def _recv_until(self, want, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._aborted():
                return self._fail("aborted", "stopped because another rank failed or the job was cancelled")
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
        from .errors import RendezvousError
        return self._fail("error", f"rank {self.rank} on worker {self.address} could not {what} within "
                          f"{timeout:.0f} s", exc=RendezvousError)

    def _wait_port(self):
        from distributed import Event, Variable

        # Wait on an Event (a timed-out Event.wait is quiet; a timed-out Variable.get logs a scheduler ERROR)
        ready = Event(self.task["port_variable"] + "-ready")
        deadline = time.monotonic() + self.task["rendezvous_timeout"]
        while time.monotonic() < deadline:
            if self._aborted():
                return self._fail("aborted", "stopped because another rank failed or the job was cancelled")
            if ready.wait(timeout=self.task["poll_interval"]):
                return int(Variable(self.task["port_variable"]).get())
        from .errors import RendezvousError
        return self._fail("error", f"rank {self.rank} on worker {self.address} waited "
                          f"{self.task['rendezvous_timeout']:.0f} s for rank 0 to open the rendezvous store; "
                          "is rank 0's worker busy with other tasks?", exc=RendezvousError)

    def _watch(self) -> RankOutcome:
        """Relay the child's messages until it sends its result and exits, dies, or the job aborts."""
        child, result, exit_by = self.child, None, None
        while True:
            if child.conn.poll(0.05):
                try:
                    msg = child.conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    return result or self._died()
                if msg[0] == "result":
                    result = RankOutcome(self.rank, self.address, "ok", value=msg[1])
                elif msg[0] == "error":
                    result = RankOutcome(self.rank, self.address, "error", error=msg[1], time=msg[2],
                                         secondary=msg[3])
                    self._set_abort()  # stop the others now, not when the client notices
                if msg[0] in ("result", "error"):  # the child destroys its process group, then exits
                    exit_by = time.monotonic() + 10
                else:
                    self._handle(msg)
            elif not child.alive():
                return result or self._died()
            if exit_by is not None and time.monotonic() > exit_by:
                return result  # stuck in destroy_process_group: the caller kills it, the outcome stands
            if result is None and self._aborted():
                return self._fail("aborted", "stopped because another rank failed or the job was cancelled")

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "events":  # a batch the rank gathered for a flush interval: on its way at once
            self.relay.extend(msg[1], now=True)
        elif kind == "port":
            from distributed import Event, Variable
            Variable(self.task["port_variable"]).set(int(msg[1]))
            Event(self.task["port_variable"] + "-ready").set()
        elif kind == "stacks":
            self._stacks.append(msg[1])
            self._stacks_ready.set()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _pump_output(self) -> None:
        def pump(stream, name):
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                if name == "stderr":
                    self._stderr_tail.append(line)
                self.relay.log(name, line)
        for stream, name in ((self.child.proc.stdout, "stdout"), (self.child.proc.stderr, "stderr")):
            threading.Thread(target=pump, args=(stream, name), name=f"dask-ddp-{name}", daemon=True).start()

    def _aborted(self) -> bool:
        now = time.monotonic()
        if now - self._last_abort_check < self.task["poll_interval"]:
            return False
        self._last_abort_check = now
        try:
            return bool(self.abort.is_set())
        except Exception:  # scheduler unreachable: treat as abort, a lone rank cannot finish a job
            return True

    def _set_abort(self) -> None:
        try:
            self.abort.set()
        except Exception:
            pass

    def _died(self) -> RankOutcome:
        code = self.child.proc.wait(timeout=10)
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        time.sleep(0.05)  # let the output pumps catch the last lines
        tail = "\n".join(self._stderr_tail)
        from .errors import RankFailedError
        return self._fail("died", f"the process of rank {self.rank} on worker {self.address} {how} "
                          f"without a result" + (f"; its last stderr lines:\n{tail}" if tail else ""),
                          exc=RankFailedError)

    def _fail(self, status: str, message: str, exc=None) -> RankOutcome:
        import cloudpickle

        from .errors import RankFailedError
        err = (exc or RankFailedError)(message, rank=self.rank, worker=self.address)
        return RankOutcome(self.rank, self.address, status, error=cloudpickle.dumps(err), message=message)

    def stacks(self, timeout: float) -> str:
        """The child's Python stack dump, or a line saying why there is none."""
        if self.child is None or not self.child.alive():
            return "(no rank process running)"
        self._stacks_ready.clear()
        try:
            self.child.send(("stacks",))
        except OSError as exc:
            return f"(could not ask for stacks: {exc})"
        if self._stacks_ready.wait(timeout):
            return self._stacks[-1]
        return f"(no answer within {timeout} s: the rank holds the GIL or is stopped)"


def supervise(task: dict) -> RankOutcome:
    """The Dask task of one rank: run it in a child process and return its :class:`RankOutcome`."""
    return Supervisor(task).run()


def supervise_raising(task: dict):
    """Like :func:`supervise`, but return the rank's value or raise its error (dask-pytorch-ddp's futures)."""
    import cloudpickle

    outcome = supervise(task)
    if outcome.status == "ok":
        return cloudpickle.loads(outcome.value)
    raise cloudpickle.loads(outcome.error)
