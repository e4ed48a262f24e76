"""The sweep's driver: asks Optuna for trials, gang-places them, runs each as a job, tells Optuna how it ended.

Runs in: the client, in the sweep's driver thread (one per sweep). Every Optuna call of a sweep is made here, so
the study is never used from two threads; the trials' jobs only post to the driver's inbox from their watcher
threads (:class:`TrialHooks`). One iteration (:meth:`Driver.step`):

1. take what the jobs posted: rank 0's reports of the metric go to the trial's
   :class:`~.search.Decider`; when Optuna's pruner answers "prune at step s", the trial's job is
   stopped (:meth:`Job.stop <dask_ddp.client.job.Job.stop>`: every rank stops at one agreed report, the
   preemption protocol, saving what ``on_preemption`` registered; ranks that reach no report within
   ``ddp.sweep.prune-grace`` seconds are killed together, so no rank is left waiting in a collective) and the
   trial is PRUNED at ``s``: its reports after ``s`` do not count; ``stopped_step`` is where its ranks stopped.
   A job's end frees its workers (free only once every rank has stopped) and is told to Optuna;
2. fill the free workers: ask Optuna for trials (a short line of them, kept by the sweep's
   :class:`~.queue.TrialQueue`: ``LINE``, up to ``LINE_MAX`` while none of them fits the
   free workers), pick which fits (:func:`~.placement.pick`), seat it
   (:func:`~.placement.place`) and start its job pinned to those workers (``dispatch.start``, with
   ``ddp.sweep.warm-cuda``);
3. end the sweep once every trial has ended, or stop it (``cancel()``, the failure limit, the client closed):
   queued trials are dropped, running ones cancelled, and the sweep ends when they have stopped."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from typing import Any

import dask

from dask_ddp.client import dispatch
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.sweeps import inherit as sweep_resume
from dask_ddp.sweeps import pickup as sweep_continue
from dask_ddp.sweeps import search
from dask_ddp.sweeps.placement import pick, place
from dask_ddp.sweeps.queue import TrialQueue
from dask_ddp.sweeps.search import Decider
from dask_ddp.sweeps.trial import SweepSpec, TrialHooks, TrialRecord, failed_text, job_error
from dask_ddp.sweeps.view import SweepView
from dask_ddp.wire import plan as planning
from dask_ddp.wire.events import RESERVED_KEYS
from dask_ddp.worker import plugin

__all__ = ["Driver", "SweepSpec", "TrialHooks"]

logger = logging.getLogger("dask_ddp")

LINE = 2  # trials asked ahead of a free slot: a trial of another size may fit where the first does not
LINE_MAX = 4  # ... and up to this many while none of them fits the free workers (which would idle meanwhile)
PATIENCE = 4  # times the head of the line may be passed over before it holds the free workers for itself
RECHECK = 1.0  # seconds between looks at the cluster while nothing ended (workers may have joined)
CLIENT_CLOSED = "the Dask client closed: its trials' ranks stop with it"


class Driver:
    """Runs one sweep (see the module docstring); ``cond`` guards ``trials`` and ``state`` for the handle."""

    pickled_results = False  # the trials' jobs keep their ranks' values and errors pickled (a detached sweep's)

    def __init__(self, client, spec: SweepSpec, study, searched: dict):
        self.client, self.spec, self.study, self.searched = client, spec, study, searched
        self.cond = threading.Condition()
        self.inbox: queue.Queue = queue.Queue()
        self.trials: dict[int, TrialRecord] = {}
        self.state, self.cause = "RUNNING", ""
        self.error: str | None = None
        self.queue = TrialQueue(study, searched, spec.n_trials)  # asked and not yet told; the line to start
        self._deciders: dict[int, Decider] = {}
        self._jobs: dict[int, Any] = {}
        self._busy: set[str] = set()
        self.failures = 0
        self._stop: str | None = None  # the sweep's end state once it is stopping
        self._look_at = 0.0  # monotonic time of the next look at the cluster
        self._thread = threading.Thread(target=self.run, name=f"dask-ddp-sweep-{spec.name}", daemon=True)
        self.view = SweepView(self)  # the dashboard's and MLflow's view

    def start(self) -> None:
        self._thread.start()

    def resume(self, number: int, ranks: int | None, params: dict | None) -> None:
        """Ask for a trial continuing trial ``number`` (from any thread); a FINISHED sweep runs again for it."""
        self.inbox.put(("resume", number, (ranks, params)))
        with self.cond:
            if self.state != "FINISHED" or self._thread.is_alive():
                return
            self.state, self.cause = "RUNNING", f"trial {number} resumed"
        self._thread = threading.Thread(target=self.run, name=f"dask-ddp-sweep-{self.spec.name}", daemon=True)
        self._thread.start()

    def stop(self, state: str, cause: str) -> None:
        """Ask the sweep to stop (from any thread): it ends in ``state`` once its running trials have stopped."""
        self.inbox.put(("stop", state, cause))

    # ---- driving -------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until the sweep has ended; a bug here still stops every trial and ends the sweep."""
        try:
            if self.view.mlflow is not None and self.view.mlflow.parent is None:  # not again when resumed
                self.view.begin()
            while not self.step():
                pass
        except Exception as exc:  # noqa: BLE001 - never leave trials running unseen
            if closed := getattr(self.client, "status", None) != "running":  # it closed under the driver's call
                self.error = error = CLIENT_CLOSED
            else:
                logger.exception("dask-ddp sweep %s: its driver failed", self.spec.name)
                self.error = error = f"the sweep's driver failed: {exc!r}; its trials were cancelled"
            self._abandon()
            self._finish("CANCELLED" if closed else "FAILED", error)

    def _abandon(self) -> None:
        """After a bug in the driver: cancel every running trial and wait for its ranks (up to 60 s each), and tell
        Optuna that every trial not yet told failed (so that no trial stays RUNNING in a kept study)."""
        for job in list(self._jobs.values()):
            _quiet_cancel(job)
        for job in list(self._jobs.values()):
            try:
                job.wait(60, progress=False)
            except Exception:  # noqa: BLE001 - the client may be gone: its ranks stop with it
                logger.warning("dask-ddp could not wait for job %s", job.run_id, exc_info=True)
        for number in self.queue.untold():
            try:
                self.queue.tell(number, state=search.optuna_module().trial.TrialState.FAIL)
            except Exception:  # noqa: BLE001 - told already, or the storage is gone
                logger.warning("dask-ddp could not tell Optuna that trial %d ended", number, exc_info=True)
            with self.cond:
                if self.trials[number].state not in ("COMPLETE", "PRUNED", "FAILED"):
                    self.trials[number].end("CANCELLED", self.error)

    def step(self, wait: float = 0.1) -> bool:
        """One iteration (see the module docstring); True once the sweep has ended."""
        self._take(wait)
        self._client_closed()
        if self._stop is not None:
            if not self._jobs:
                self._finish(self._stop, self.cause)
                return True
            return False
        self._fill()
        self.view.tick()
        if not self.queue.more() and not self.queue.waiting() and not self._jobs:
            self._finish("FINISHED", f"all {self.queue.asked} trials ended" + (" (the grid is walked)" if
                                                                               self.queue.exhausted else ""))
            return True
        return False

    def _take(self, wait: float) -> None:
        try:
            messages = [self.inbox.get(timeout=wait)]
        except queue.Empty:
            return
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, a, b in messages:
            if kind == "metric":
                self._metric(a, b)
            elif kind == "end":
                self._ended(a, b)
            elif kind == "resume":
                sweep_resume.take(self, a, *b)
            elif self._stop is None:
                self._begin_stop(a, b)

    # ---- what the jobs post --------------------------------------------------------------------------------
    def _metric(self, number: int, item: dict) -> None:
        rec = self.trials[number]
        with self.cond:
            rec.keys.update(k for k in item if k not in RESERVED_KEYS)
        decider = self._deciders.get(number)  # None once the trial has ended
        if item.get("rank") != 0 or self.spec.metric not in item or rec.pruned_at is not None or decider is None:
            return
        step, value = int(item["step"]), float(item[self.spec.metric])
        if decider.last_step is not None and step <= decider.last_step:
            return  # one value a step, as Optuna keeps
        with self.cond:
            rec.add(step, value, self.spec.minimize, item.get("time"))
        if decider.report(step, value):
            with self.cond:
                rec.pruned_at, rec.stopped = step, time.time()
            logger.info("sweep %s: trial %d pruned at step %d (%s=%g)", self.spec.name, number, step,
                        self.spec.metric, value)
            _quiet_stop(self._jobs[number], f"the sweep's pruner stopped trial {number} at step {step}")

    def _ended(self, number: int, job) -> None:
        """The trial's job has ended (every rank stopped): free its workers, tell Optuna, count a failure."""
        optuna = search.optuna_module()
        rec = self.trials[number]
        self._jobs.pop(number, None)
        self._busy.difference_update(rec.workers)
        self._look_at = 0.0
        error, failure = job_error(job)  # failure: a rank's exception still pickled (a detached sweep's trial)
        with self.cond:
            rec.stopped_step, rec.failure = getattr(job, "stopped_step", None), failure
        if rec.pruned_at is not None:
            self.queue.tell(number, state=optuna.trial.TrialState.PRUNED)
            self._end(rec, "PRUNED", value=rec.last)  # Optuna keeps the last intermediate value: the same
        elif job.state == "FINISHED" and rec.steps:
            self.queue.tell(number, rec.last)
            self._end(rec, "COMPLETE", value=rec.last)
        elif job.state == "FINISHED":
            seen = ", ".join(sorted(rec.keys)) or "none"
            self._fail(rec, f"trial {number} (job {rec.run_id}) finished without reporting the metric "
                             f"{self.spec.metric!r} on rank 0; the keys it reported: {seen}. Report it with "
                             f"dask_ddp.report({self.spec.metric}=value), or pass metric= one of those keys")
        elif (job.state == "CANCELLED" and self._stop is not None) or self._client_closed():  # ended by its close
            self.queue.tell(number, state=optuna.trial.TrialState.FAIL)
            self._end(rec, "CANCELLED", error=f"cancelled: {self.cause}")
        else:
            self._fail(rec, failed_text(number, rec.run_id, error))

    # ---- filling free workers ------------------------------------------------------------------------------
    def _fill(self) -> None:
        if time.monotonic() < self._look_at:
            return
        self._look_at = time.monotonic() + RECHECK
        reach = LINE
        while self._stop is None:
            while len(self.queue.waiting()) < reach and self.queue.more() and self._stop is None:
                self.ask()
            cap = self.spec.max_concurrent
            if not self.queue.waiting() or (cap is not None and len(self._jobs) >= cap):
                return
            eligible = self._eligible()
            room = len(eligible) if self.spec.max_workers is None else min(len(eligible), self.spec.max_workers)
            self.view.room = room
            self._fail_oversized(room)
            free = [w for w in eligible if w.address not in self._busy]
            if self.spec.max_workers is not None:
                free_n = min(len(free), self.spec.max_workers - len(self._busy))
            else:
                free_n = len(free)
            line = self.queue.waiting()
            sizes = [self.trials[n].ranks for n in line]
            passed = self.queue.passes()  # a new head (the last started or failed) starts at 0
            i = pick(sizes, free_n, passed, PATIENCE)
            addresses = None if i is None else place(sizes[i], free)
            if i is None or addresses is None:  # nothing fits (pick() only picks what does)
                if self.queue.more() and free_n and passed < PATIENCE and len(line) >= reach < LINE_MAX:
                    reach += 1  # a free worker would idle: look one trial further (a 1-rank one may fit)
                    continue
                return
            self._launch(self.queue.start(i), addresses)

    def _eligible(self) -> list[planning.WorkerInfo]:
        """The running workers the sweep may use (``workers=`` of the sweep, if given)."""
        found = scheduler_workers(self.client)
        running = {a: w for a, w in found.items() if w.get("status", "running") == "running"}
        workers = planning.workers_from_scheduler_info({"workers": running})
        if self.spec.workers is not None:
            workers = [w for w in workers if w.address in self.spec.workers or w.name in self.spec.workers]
        return workers

    def _fail_oversized(self, room: int) -> None:
        for number in [n for n in self.queue.waiting() if self.trials[n].ranks > room]:
            if not self.queue.drop(number):  # a failure before it stopped the sweep: the line was cleared
                continue
            rec = self.trials[number]
            self._fail(rec, f"trial {number} needs {rec.ranks} ranks, but the sweep may use only {room} workers "
                            f"now (max_workers={self.spec.max_workers}, workers={self.spec.workers}): add workers "
                            "or lower ranks_per_trial")

    def ask(self, counted: bool = True, params: dict | None = None, first: bool = False) -> TrialRecord:
        """In the driver's thread: ask Optuna for a trial (with ``params`` enqueued first: a trial asked again) and
        put it in line, last or ``first`` (a resumed one is not ``counted`` against n_trials). A trial whose
        ``ranks_per_trial`` fails or gives no positive int is FAILED instead. Returns its record; raises what
        ``study.ask`` raises."""
        trial = self.queue.ask(counted, params)
        params = {**trial.params, **self.spec.fixed}
        rec = TrialRecord(trial.number, params, 0)
        with self.cond:
            self.trials[trial.number] = rec
        try:
            rec.ranks = self.spec.ranks(params)
        except Exception:  # noqa: BLE001 - the user's ranks_per_trial: the trial fails, the sweep goes on
            self._fail(rec, f"ranks_per_trial failed for trial {trial.number} ({params}):\n"
                            f"{traceback.format_exc()}")
            return rec
        if isinstance(rec.ranks, bool) or not isinstance(rec.ranks, int) or rec.ranks < 1:
            self._fail(rec, f"ranks_per_trial gave {rec.ranks!r} for trial {trial.number} ({params}): expected a "
                            "positive int")
            return rec
        self._deciders[trial.number] = Decider(trial)
        self.queue.line_up(trial.number, first)
        return rec

    def look_now(self) -> None:
        """Look at the cluster for free workers at the next step (a trial was put first in line)."""
        self._look_at = 0.0

    def _launch(self, number: int, addresses: list[str]) -> None:
        rec, spec = self.trials[number], self.spec
        with self.cond:
            rec.state, rec.workers, rec.started = "RUNNING", tuple(addresses), time.time()
            if rec.resumed_from is None:
                sweep_resume.exploit(self, rec)
        self._busy.update(addresses)
        extra: dict[str, Any] = {"resume_from": rec.resume_from} if spec.resume_arg else {}
        try:
            job = dispatch.start(self.client, spec.fn, spec.args, dict(**spec.kwargs, **rec.params, **extra),
                                 workers=list(addresses), name=f"{spec.name}-trial{number}",
                                 callbacks=[*self.view.callbacks(number, rec.params), TrialHooks(self.inbox, number)],
                                 progress=False, pickled=self.pickled_results, warm_cuda=spec.warm_cuda,
                                 **spec.run_options)
        except Exception:  # noqa: BLE001 - a worker left meanwhile, a parameter does not pickle, ...
            self._busy.difference_update(addresses)
            return self._fail(rec, f"trial {number} could not start on {', '.join(addresses)}:\n"
                                   f"{traceback.format_exc()}")
        self._jobs[number] = job
        with self.cond:
            rec.run_id, rec.checkpoint = job.run_id, job.checkpoint_dir
        sweep_continue.remember(self.queue.held(number), rec)

    # ---- ending --------------------------------------------------------------------------------------------
    def _fail(self, rec: TrialRecord, error: str) -> None:
        self.queue.tell(rec.number, state=search.optuna_module().trial.TrialState.FAIL)
        self._end(rec, "FAILED", error=error)
        self.failures += 1
        logger.warning("sweep %s: %s", self.spec.name, error.splitlines()[0])
        limit = self.spec.max_failures
        if limit is not None and self.failures >= limit and self._stop is None:
            first = next((r.error for r in sorted(self.trials.values(), key=lambda r: r.ended or 0)
                          if r.state == "FAILED" and r.error), "")
            self._begin_stop("FAILED", f"{self.failures} trials failed (max_failures={limit}); the first: {first}")

    def _end(self, rec: TrialRecord, state: str, value: float | None = None, error: str | None = None) -> None:
        self._deciders.pop(rec.number, None)
        with self.cond:
            rec.value = value
            rec.end(state, error)
            self.cond.notify_all()
        self.view.ended(rec)

    def _client_closed(self) -> bool:
        """Whether the client is closed; then the sweep stops (its trials' ranks stop with the client)."""
        closed = getattr(self.client, "status", None) != "running"
        if closed and self._stop is None:
            self._begin_stop("CANCELLED", CLIENT_CLOSED)
        return closed

    def _begin_stop(self, state: str, cause: str) -> None:
        self._stop, self.cause = state, cause
        logger.info("sweep %s: stopping (%s)", self.spec.name, cause)
        for number in self.queue.clear():
            self.queue.tell(number, state=search.optuna_module().trial.TrialState.FAIL)
            self._end(self.trials[number], "CANCELLED", error=f"never started: {cause}")
        for job in list(self._jobs.values()):
            _quiet_cancel(job)

    def _finish(self, state: str, cause: str) -> None:
        self.view.finish(state)
        if self.spec.warm_cuda:  # the ranks that started CUDA for a next trial end now
            plugin.stop_warm_cuda(self.client)
        with self.cond:
            self.state, self.cause = state, cause
            self.cond.notify_all()
        logger.info("sweep %s %s: %s", self.spec.name, state, cause)


def _quiet_cancel(job) -> None:
    """Cancel a trial's job without waiting (its end reaches the inbox through ``on_finish``)."""
    try:
        job.cancel(timeout=0)
    except Exception:  # noqa: BLE001 - the client may be closing: the job then ends on its own
        logger.warning("dask-ddp could not cancel job %s", getattr(job, "run_id", job), exc_info=True)


def _quiet_stop(job, cause: str) -> None:
    """Stop a pruned trial's ranks at one agreed step (cancelled together after ``ddp.sweep.prune-grace``)."""
    try:
        job.stop(cause, grace=float(dask.config.get("ddp.sweep.prune-grace", 5)))
    except Exception:  # noqa: BLE001 - the client may be closing: the job then ends on its own
        logger.warning("dask-ddp could not stop job %s", getattr(job, "run_id", job), exc_info=True)
        _quiet_cancel(job)
