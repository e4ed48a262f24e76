"""The job controller: owns a job's live state and is the one place that acts on failures.

Runs in: the client, in the job's watcher thread. :meth:`Controller.step` does
one iteration; :meth:`Controller.run` loops it until the job has ended. Each
iteration delivers the events that arrived, notes lost and silent workers and
ended ranks, and moves the attempt through its phases (:class:`Phase`)::

    running ---- every rank ended ----> draining ---- its events are in ----> (decide)
       ^                                                                        |
       |                         finish / fail: the job ends <------------------+
       +---- enough workers ---- waiting for workers <---- restart <------------+

Decisions (a :class:`~dask_ddp.client.policy.Action` and its reason) come from
:mod:`dask_ddp.client.policy` (pure); actions go through a
cluster port (:class:`dask_ddp.client.cluster.DaskCluster`, or a fake in tests).
The job's state machine (PENDING, RUNNING, RESTARTING, FINISHED, FAILED,
CANCELLED) lives in the :class:`~dask_ddp.client.record.JobRecord`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import Any, Callable

import cloudpickle
import dask

from dask_ddp.client import elastic, policy
from dask_ddp.client import live as live_recovery
from dask_ddp.client.attempt import Attempt
from dask_ddp.client.callbacks import Callbacks
from dask_ddp.client.events import EventOrder, items_of
from dask_ddp.client.launch import rank_tasks
from dask_ddp.client.liveness import SilenceWatch
from dask_ddp.client.notices import NoticeDesk, growth_bounds
from dask_ddp.client.policy import Action
from dask_ddp.client.record import JobRecord, format_log
from dask_ddp.client.stall import StallClock
from dask_ddp.client.stragglers import StragglerWatch
from dask_ddp.dashboard import jobs as dashboard_jobs
from dask_ddp.observe.progress import Progress
from dask_ddp.wire import plan as planning
from dask_ddp.wire.errors import ClientClosedError, DaskDDPError, JobCancelledError
from dask_ddp.wire.notices import Stopped, grace_period
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.spec import LaunchSpec

__all__ = ["Controller", "Phase"]

logger = logging.getLogger("dask_ddp")

DRAIN_WAIT = 5.0  # seconds an ended attempt waits for its ranks' last event batches
QUEUED_AFTER = 10.0  # seconds into an attempt when its rank tasks are checked for waiting on a busy worker


class Phase(enum.StrEnum):
    """Where the controller's current attempt is (see the module docstring)."""

    NEW = "new"  # nothing launched yet
    RUNNING = "running"  # ranks run; outcomes are collected as they end
    DRAINING = "draining"  # every rank ended: their last event batches are awaited
    WAITING = "waiting"  # a restart waits for the workers it needs
    ENDED = "ended"  # the job has ended


class Controller:
    """Runs one job's attempts on a cluster port; see the module docstring.

    ``owner`` is what callbacks receive as the job (the :class:`~dask_ddp.client.job.Job`);
    ``clock`` is ``time.monotonic`` unless a test drives time.
    """

    def __init__(self, spec: LaunchSpec, run_id: str, cluster, record: JobRecord, owner: Any = None,
                 clock: Callable[[], float] = time.monotonic, raw_results: bool = False):
        self.spec, self.run_id, self.cluster, self.record = spec, run_id, cluster, record
        self.owner, self.clock, self.raw = owner, clock, raw_results  # raw: values and errors stay pickled (detach)
        self.callbacks = Callbacks(spec.callbacks)
        self.order = EventOrder()
        self.silence = SilenceWatch(spec.worker_timeout)
        self.attempt: Attempt | None = None
        self.cancel_requested = False
        self.phase = Phase.NEW
        self._deadline = 0.0
        self._backfilled = False
        self._restart_need: tuple[int, Any] = (0, None)
        self._decision: policy.Decision | None = None  # the decision a restart acts on
        self.progress = StallClock()  # when each rank last reported or made a step
        self.stragglers = StragglerWatch(spec.straggler_window) if spec.straggler_window is not None else None
        self.preemptions = 0  # restarts after a preemption or growth: they do not count against max_restarts
        self.departed: set[str] = set()  # workers that left gracefully: never planned on again
        self.grace, self.max_preemptions = grace_period(), int(dask.config.get("ddp.preemption.max-restarts", 100))
        self.notices = NoticeDesk(cluster, growth_bounds(spec), self.grace,  # growth and stop() notices
                                  record.note if spec.recovery == "live" else None)
        self._leftover: Any = None  # the ended attempt's RankTask, until its scheduler state is removed

    # ---- driving -------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Launch the first attempt (the job's new topic is subscribed already: nothing to backfill yet)."""
        self._announce("PENDING", self.spec.first_plan)
        self._launch(0, self.spec.first_plan)
        self.callbacks("on_start", self.owner)

    def run(self) -> None:
        """Step until the job has ended; a bug here still stops the ranks and ends the job."""
        try:
            while not self.step():
                pass
        except Exception as exc:  # a bug here must not leave ranks running or result() hanging
            if self.cluster.client_closed():  # the user's client.close(): the ranks stop as orphans
                error: Exception = ClientClosedError.of_job(self.run_id)
            else:
                logger.exception("dask-ddp job watcher failed")
                error = DaskDDPError(f"dask-ddp's job watcher failed: {exc!r}; the ranks were stopped")
            self._abort(f"the job watcher failed: {exc!r}")
            self._end("FAILED", error)
        finally:
            self.cluster.close()

    def step(self, wait: float = 0.05) -> bool:
        """One iteration: deliver events (waiting up to ``wait`` s for some), then advance. True once ended."""
        if self.phase == Phase.ENDED:
            return True
        self._deliver(self.cluster.events(wait))
        if self.phase == Phase.RUNNING:
            self._check_ranks()
        if self.phase == Phase.RUNNING and self.notices.active:
            overdue = self.notices.check(self.attempt, self.clock(), self.progress.reported, self._usable_workers)
            if overdue and not self.cancel_requested:
                self.cancel()  # the ranks did not reach a report in time after stop(): stop them all together (killed)
        if self.phase == Phase.DRAINING:
            self._check_drained()
        if self.phase == Phase.WAITING:
            self._check_restart()
        return self.phase == Phase.ENDED

    def cancel(self) -> None:
        """Ask every rank to stop; the job ends CANCELLED once they have."""
        self.cancel_requested = True
        self._abort("cancel() was called", cancel=True)

    def stop(self, cause: str, grace: float) -> None:
        """Ask every rank to stop at one agreed step (a ``stop`` notice, as a preemption's, saving what the code
        registered); the job ends CANCELLED there without a restart, or is cancelled after ``grace`` seconds."""
        self.notices.stop(cause, self.clock() + grace)

    # ---- events --------------------------------------------------------------------------------------------
    def _deliver(self, messages: list[dict]) -> None:
        for msg in messages:
            self._deliver_batches(self.order.take(msg))

    def _deliver_batches(self, batches: list[dict]) -> None:
        for batch in batches:
            items = items_of(batch)
            self.record.add(items)
            now = self.clock()
            for item in items:
                kind = item.get("kind")
                if kind == "metric":
                    self.progress.report(item["rank"], now)
                if kind == "log" and self.spec.echo_logs:
                    Progress.write(format_log(item), item.get("stream") == "stderr")
                if kind in ("metric", "log"):
                    self.callbacks("on_metrics" if kind == "metric" else "on_log", item)
                elif kind == "telemetry":
                    self._telemetry(item, now)

    def _telemetry(self, item: dict, now: float) -> None:
        """Feed the straggler watch; name a straggler once (warning, history, callbacks, the jobs topic)."""
        self.callbacks("on_telemetry", item)
        att = self.attempt
        if att is None or item.get("attempt") != att.index:
            return
        self.progress.telemetry(item["rank"], item.get("step"), now)
        if self.stragglers is None:
            return
        found = self.stragglers.update(item, now)
        if found is None:
            return
        r = att.plan.ranks[found.rank]
        message = found.message(r.address, r.host)
        with self.record.cond:
            self.record.stragglers[found.rank] = message
        self.record.note(f"straggler: {message}")
        event = {"kind": "straggler", "run": self.run_id, "rank": found.rank, "worker": r.address, "host": r.host,
                 "cause": found.cause, "time": time.time(), "message": message}
        self.callbacks("on_straggler", self.owner, event)
        dashboard_jobs.publish(getattr(self.cluster, "client", None), event)

    # ---- running -------------------------------------------------------------------------------------------
    def _launch(self, index: int, plan: planning.RankPlan) -> None:
        tasks = rank_tasks(self.spec, self.run_id, index, plan)
        self.attempt = Attempt(index, plan, tasks, self.cluster.submit(tasks), self.clock())
        self.progress.reset()  # the stall clock of each rank restarts at its first report (or step)
        if self.stragglers is not None:
            self.stragglers.reset()
        with self.record.cond:
            self.record.telemetry.clear()
            self.record.stragglers.clear()
        self.phase = Phase.RUNNING
        self._transition("RUNNING", f"attempt {index + 1}: {plan.world_size} ranks on "
                                    f"{', '.join(plan.addresses)}, master {plan.master_addr}")
        if self.cancel_requested:
            self._abort("cancel() was called", cancel=True)

    def _check_ranks(self) -> None:
        att = self.attempt
        for address in self.cluster.removed():
            if address in att.plan.addresses:
                att.lost.setdefault(address, time.time())
        for address in self.cluster.leaving():
            self.departed.add(address)
            if address in att.plan.addresses:
                att.leaving.setdefault(address, self.clock())
        now = self.clock()
        if self.silence.due(now):
            live = [a for a in att.plan.addresses if a not in att.lost and a not in att.leaving]
            for address in self.silence.check(self.cluster.workers(), live, now):
                att.lost[address] = time.time()
        for r, task, fut in zip(att.plan.ranks, att.tasks, att.futures):
            if r.rank in att.outcomes:
                continue
            if r.address in att.lost or att.left_for_good(r.address, self.clock(), self.grace):
                outcome = policy.lost_outcome(r, att.lost.get(r.address, time.time()),
                                              self.silence.silent.get(r.address),
                                              retired=r.address in att.leaving and r.address not in att.lost)
                self.cluster.cancel(fut)  # pinned to a dead worker, it would wait forever
            else:
                outcome = self.cluster.outcome(fut, task)
                if outcome is None:
                    continue
            att.outcomes[r.rank] = outcome
            if outcome.failed and not live_recovery.handled(self.spec, self.cluster, att, outcome,
                                                            self._usable_workers, self.record.note):
                self._abort(outcome.message or f"rank {r.rank} failed")
        self._check_stall(att)
        self._check_queued(att)
        if att.ended():
            self.phase, self._deadline, self._backfilled = Phase.DRAINING, self.clock() + DRAIN_WAIT, False

    def _check_stall(self, att: Attempt) -> None:
        limit = self.spec.stall_timeout
        if limit and not att.stalled and not att.ended():
            att.stalled = self.progress.stalled(self.clock(), limit, att, self.cluster.stacks, self.run_id)
            if att.stalled is not None:
                self._abort(f"rank {att.stalled.rank} stalled")

    def _check_queued(self, att: Attempt) -> None:
        """Once an attempt, QUEUED_AFTER s in: say which rank tasks still wait for a free thread on their workers
        (busy with other Dask work, or another job's ranks), and what runs there; else the job waits unexplained
        (the ranks that started wait for them in the rendezvous). Asked in a thread of its own: a worker that
        does not answer must not hold the controller."""
        probe = getattr(self.cluster, "queued", None)
        if att.queue_checked or probe is None or self.clock() < att.launched + QUEUED_AFTER:
            return
        att.queue_checked = True
        tasks = [t for t in att.tasks if t.rank.rank not in att.outcomes]
        if not tasks:
            return

        def ask() -> None:
            try:
                message = policy.queued_message(probe(tasks), {t.key: t.rank.rank for t in tasks})
            except Exception:  # noqa: BLE001 - a hint only; the job goes on either way
                logger.debug("dask-ddp: could not ask the workers about queued rank tasks", exc_info=True)
                return
            if message and self.attempt is att and not att.ended():
                self.record.note(message)
        threading.Thread(target=ask, name=f"dask-ddp-queued-{self.run_id}", daemon=True).start()

    # ---- an attempt ended ------------------------------------------------------------------------------------
    def _check_drained(self) -> None:
        """Every batch a rank published must arrive before the job reports its end (or DRAIN_WAIT passes)."""
        att, now = self.attempt, self.clock()
        pending = [o for o in att.outcomes.values() if o.last_seq >= 0]

        def arrived() -> bool:
            return all(self.order.have_all(att.index, o.rank, o.last_seq, att.tasks[o.rank].joined) for o in pending)

        if not arrived() and not self._backfilled and now > self._deadline - DRAIN_WAIT / 2:
            self._deliver(self.cluster.backfill())  # subscribing does not replay what came before it
            self._backfilled = True
        if not arrived():
            if now < self._deadline:
                return
            self._deliver_batches(self.order.flush())  # batches whose predecessor never came: late, not lost
        self._decide(att)

    def _decide(self, att: Attempt) -> None:
        outcomes = list(live_recovery.settled(att).values())
        if att.stalled is not None:
            outcomes.append(RankOutcome(att.stalled.rank, att.stalled.worker, Status.STALLED, time=0.0,
                                        error=cloudpickle.dumps(att.stalled)))
        decision = policy.decide(outcomes, cancelled=self.cancel_requested, attempt=att.index - self.preemptions,
                                 max_restarts=self.spec.max_restarts)
        pre = elastic.preemption(outcomes)
        capped, stop = None, pre is not None and pre.notice.kind == "stop" and decision.action != Action.FINISH
        if pre is not None and decision.action != Action.FINISH and not self.cancel_requested and not stop:
            capped = elastic.over_cap(self.preemptions, self.max_preemptions, self.run_id)
            decision = self._after_preemption(pre) if capped is None else policy.Decision(Action.FAIL, str(capped))
        self.cluster.release(att.futures)
        self._leftover = att.tasks[0]  # its flag and port leave the scheduler after on_finish, or before a restart
        if capped is not None:
            self._end("FAILED", capped, decision.reason)
        elif decision.action == Action.FINISH:
            values, error = policy.results(live_recovery.settled(att), self.raw, self.run_id)
            self._end("FAILED" if error else "FINISHED", error, str(error) if error else decision.reason, values)
        elif stop or self.cancel_requested:
            self.record.stopped_step = pre.step if stop else None
            self._cancelled(f"stopped at step {pre.step} on every rank ({'saved' if pre.safe else 'not saved'}): "
                            f"{pre.notice.cause}" if stop and pre.step is not None else decision.reason)
        elif decision.action == Action.RESTART:
            self._begin_restart(att, decision)
        else:
            self._end("FAILED", policy.root_error(decision, outcomes, self.run_id, self.raw), decision.reason)

    def _after_preemption(self, pre: Stopped) -> policy.Decision:
        """Restart after a preemption or growth (not counted against max_restarts), saying what was saved."""
        self.preemptions += 1
        if pre.notice.kind == "leave" and pre.notice.worker:
            self.departed.add(pre.notice.worker)  # it is closing: the restart must not plan on it
        fallback = None if pre.safe else elastic.last_checkpoint_step(self.spec.checkpoint_dir, self.run_id,
                                                                        self.spec.checkpoint_options)
        return policy.Decision(Action.RESTART, elastic.reason(pre, self.record.top_step, fallback, self.grace))

    def _begin_restart(self, att: Attempt, decision: policy.Decision) -> None:
        self._clean_up()
        self._transition("RESTARTING", decision.reason)
        self.callbacks("on_restart", self.owner, att.index + 1)
        self._restart_need = policy.restart_request(self.spec.workers, att.plan.world_size)
        self._decision = decision
        self.phase, self._deadline = Phase.WAITING, self.clock() + self.spec.restart_wait

    def _check_restart(self) -> None:
        """Restart once the cluster has the workers it needs (silent ones left out), or give up at the deadline."""
        if self.cancel_requested:
            return self._cancelled("cancelled while waiting for workers to restart on")
        need, selection = self._restart_need
        workers = planning.workers_from_scheduler_info({"workers": self._usable_workers()})
        if len(workers) < need and self.clock() < self._deadline:
            return
        att = self.attempt
        try:
            plan = planning.make_plan(workers, selection, self.spec.master_addr)
        except Exception as exc:  # noqa: BLE001 - not enough workers, or the named ones are gone
            err = policy.root_error(self._decision, att.outcomes.values(), self.run_id, self.raw)
            err.add_note(f"[dask-ddp] no restart: {need} workers were not available within "
                         f"{self.spec.restart_wait} s ({exc})")
            return self._end("FAILED", err, f"restart impossible: {exc}")
        if plan.world_size != att.plan.world_size:
            logger.warning("job %s: attempt %d runs on %d workers (attempt %d had %d)", self.run_id,
                           att.index + 2, plan.world_size, att.index + 1, att.plan.world_size)
        self._launch(att.index + 1, plan)

    # ---- state ----------------------------------------------------------------------------------------------
    def _transition(self, state: str, cause: str) -> None:
        self.record.transition(state, cause, self.attempt)
        self._announce(state, self.attempt.plan if self.attempt else self.spec.first_plan)

    def _announce(self, state: str, plan) -> None:
        """Tell the scheduler's DDP page (``dask-ddp-jobs``); a cluster port without a client (a test's) has none."""
        msg = dashboard_jobs.job_message(self.run_id, self.spec.name or self.spec.fn_name, state,
                                         self.attempt.index if self.attempt else 0, plan, self.spec.backend)
        dashboard_jobs.publish(getattr(self.cluster, "client", None), msg)

    def _usable_workers(self) -> dict[str, dict]:
        """The scheduler's workers a plan may use: running (not retiring or closing), neither silent nor departed."""
        return {a: info for a, info in self.cluster.workers().items() if info.get("status", "running") == "running"
                and self.silence.heard(a) and a not in self.departed}

    # ---- acting --------------------------------------------------------------------------------------------
    def _abort(self, cause: str, cancel: bool = False) -> None:
        if self.attempt is None or self.phase not in (Phase.RUNNING, Phase.NEW):
            return
        self.cluster.abort(self.attempt.tasks[0], cancel=cancel)
        logger.info("job %s: stopping every rank of attempt %d: %s", self.run_id, self.attempt.index + 1, cause)

    def _clean_up(self) -> None:  # the ended attempt's abort flag and rendezvous port off the scheduler, once
        task, self._leftover = self._leftover, None
        if task is not None:
            self.cluster.cleanup(task)

    def _cancelled(self, cause: str) -> None:
        self._end("CANCELLED", JobCancelledError(f"job {self.run_id} was cancelled; every rank was stopped"), cause)

    def _end(self, state: str, error: BaseException | None, cause: str = "", values: list | None = None) -> None:
        self.phase = Phase.ENDED
        self.record.error, self.record.values = error, values
        self._transition(state, cause or (str(error) if error else ""))
        if error is not None:
            self.callbacks("on_failure", self.owner, error)
        self.callbacks("on_finish", self.owner)  # before waking result(): a sink's file is complete when it returns
        self._clean_up()  # after on_finish: a scheduler round trip that the sweep's next trial need not wait for
        self.cluster.close()  # before waking result() too: the job's topic and handlers are gone when it returns
        self.record.settle()
