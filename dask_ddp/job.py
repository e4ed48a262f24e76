"""The client-side handle of a running DDP job, and the one place that acts on failures.

States (every transition is logged on the ``dask_ddp`` logger with its cause
and kept in :attr:`Job.history`)::

    PENDING -> RUNNING -> FINISHED
                       -> FAILED       (a rank raised/died, a worker left, a stall; no restarts left)
                       -> CANCELLED    (job.cancel())
                       -> RESTARTING -> RUNNING   (max_restarts not used up)

A watcher thread owns the live state: it drains the job's events, watches the
rank futures and the workers, stops every rank of an attempt as soon as one
fails, and asks :func:`dask_ddp.policy.decide` what comes next.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Iterator

import cloudpickle

from . import plan as planning
from .errors import DaskDDPError, JobCancelledError, RankFailedError, StallError, WorkerLostError
from .events import Subscription, WorkerWatch
from .liveness import SilenceWatch
from .policy import decide
from .progress import Progress
from .supervisor import RankOutcome, dump_stacks, supervise, supervise_raising

__all__ = ["Job"]

logger = logging.getLogger("dask_ddp")


class _Attempt:
    """Live state of one attempt: its plan, futures and outcomes."""

    def __init__(self, index: int, plan: planning.RankPlan, futures: list, names: dict):
        self.index, self.plan, self.futures, self.names = index, plan, futures, names
        self.outcomes: dict[int, RankOutcome] = {}
        self.lost: dict[str, float] = {}  # worker address -> time it was found gone
        self.stalled: StallError | None = None


class Job:
    """A DDP job started by :func:`dask_ddp.dispatch.run`; returned at once, while the ranks start.

    Attributes
    ----------
    run_id : str
    state : str
        PENDING, RUNNING, RESTARTING, FINISHED, FAILED or CANCELLED.
    history : list of (time, old, new, cause)
    futures : list of distributed.Future
        The rank tasks of the current attempt, in rank order.
    """

    def __init__(self, client, spec):
        self.client, self.spec = client, spec
        self.run_id = spec.name or f"{spec.fn_name}-{uuid.uuid4().hex[:8]}"
        self.topic = f"dask-ddp-{self.run_id}"
        self.state = "PENDING"
        self.history: list[tuple[float, str, str, str]] = []
        self.attempt: _Attempt | None = None
        self._events: list[dict] = []
        self._metric_rows: list[dict] = []
        self._cond = threading.Condition()
        self._last_report: dict[int, float] = {}
        self._error: BaseException | None = None
        self._values: list | None = None
        self._cancel_requested = False
        self._settled = False  # True once the end state is set and on_finish callbacks have run
        self._callbacks = list(spec.callbacks)
        self._broken_callbacks: set[int] = set()
        self._sub = Subscription(client, self.topic)
        self._watch = WorkerWatch.of(client)
        self._watch_token = self._watch.add(self._on_worker_removed)
        self._silence = SilenceWatch(client, spec.worker_timeout)
        self._thread = threading.Thread(target=self._watch_loop, name=f"dask-ddp-job-{self.run_id}", daemon=True)

    # ---- public API ----------------------------------------------------------------------------------------
    @property
    def futures(self) -> list:
        return list(self.attempt.futures) if self.attempt else []

    @property
    def plan(self) -> planning.RankPlan | None:
        return self.attempt.plan if self.attempt else None

    def done(self) -> bool:
        """True once the job has FINISHED, FAILED or been CANCELLED (and its on_finish callbacks have run)."""
        return self._settled

    def wait(self, timeout: float | None = None, *, progress: bool | None = None) -> bool:
        """Block until the job ends or ``timeout`` seconds pass, with a progress bar; True if it ended.

        Never raises for a failed job (see :meth:`result`).
        """
        show = self.spec.progress if progress is None else progress
        bar = Progress(self, total=self.spec.total) if show else None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._cond:
                while not self.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(0.2 if left is None else min(0.2, left))
                    if bar:
                        bar.update()
        finally:
            if bar:
                bar.close()
        return self.done()

    def result(self, timeout: float | None = None, *, progress: bool | None = None) -> list:
        """Wait for the job and return each rank's return value, in rank order.

        Raises
        ------
        Exception
            The root cause when a rank failed: the rank's own exception with its
            type and traceback, a note naming the rank and worker, and the
            other ranks' fates grouped in a note; :class:`WorkerLostError`
            when a worker left; :class:`StallError` when the job stalled.
        JobCancelledError
            When the job was cancelled.
        TimeoutError
            When ``timeout`` passes first (the job keeps running).
        """
        if not self.wait(timeout, progress=progress):
            raise TimeoutError(f"job {self.run_id} still {self.state} after {timeout} s; it keeps running: "
                               "call result() again or cancel()")
        if self._error is not None:
            raise self._error
        return list(self._values)

    def cancel(self, timeout: float = 30) -> None:
        """Stop every rank (their processes are killed) and wait for them; result() then raises JobCancelledError."""
        if self.done():
            return
        self._cancel_requested = True
        self._abort("cancel() was called")
        self.wait(timeout, progress=False)

    @property
    def metrics(self):
        """A pandas DataFrame of every report so far: rank, attempt, step, time, then the reported keys."""
        import pandas as pd

        with self._cond:
            rows = list(self._metric_rows)
        df = pd.DataFrame(rows, columns=None if rows else ["rank", "attempt", "step", "time"])
        lead = ["rank", "attempt", "step", "time"]
        return df[lead + [c for c in df.columns if c not in lead and c != "kind"]]

    @property
    def logs(self) -> list[str]:
        """Every output line and log record of the ranks so far, as ``[rank N] line``.

        Lines of a later attempt read ``[rank N, attempt K] line`` (K from 1, as in :attr:`history`).
        """
        with self._cond:
            return [_format_log(e) for e in self._events if e["kind"] == "log"]

    @property
    def events(self) -> list[dict]:
        """Every event so far (metrics and logs), in arrival order."""
        with self._cond:
            return list(self._events)

    def stream(self, timeout: float | None = None) -> Iterator[dict]:
        """Iterate over events as they arrive, from the first, until the job ends and all are seen."""
        i, deadline = 0, None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while i >= len(self._events) and not self.done():
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    self._cond.wait(0.2)
                batch, finished = self._events[i:], self.done()
            i += len(batch)
            yield from batch
            if finished and not batch:
                return

    def plot(self, y: str | list[str] | None = None, x: str = "step", ax=None):
        """Plot reported metrics per rank with matplotlib (every numeric key but ``epoch`` by default)."""
        from .sinks import plot_metrics
        return plot_metrics(self.metrics, y=y, x=x, ax=ax)

    def __repr__(self) -> str:
        ranks = self.plan.world_size if self.plan else "?"
        return f"<dask_ddp.Job {self.run_id} {self.state} ranks={ranks}>"

    # ---- starting ------------------------------------------------------------------------------------------
    def _start(self) -> "Job":
        self._sub.backfill()
        self._launch(0, self.spec.first_plan)
        self._thread.start()
        self._call("on_start", self)
        return self

    def _launch(self, index: int, plan: planning.RankPlan) -> None:
        rid = f"{self.run_id}-{index}"
        names = {"abort": f"dask-ddp-abort-{rid}", "port": f"dask-ddp-port-{rid}"}
        base = self.spec.task_base(self.run_id, index, plan, self.topic, names)
        fn = supervise_raising if self.spec.raise_in_task else supervise
        futures = [self.client.submit(fn, self._rank_task(base, r, index), key=f"dask-ddp-{rid}-rank{r.rank}", workers=[r.address],
                                      allow_other_workers=False, pure=False, retries=0)
                   for r in plan.ranks]
        self.attempt = _Attempt(index, plan, futures, names)
        with self._cond:
            self._last_report.clear()  # the stall clock of each rank restarts at its first report
        self._transition("RUNNING", f"attempt {index + 1}: {plan.world_size} ranks on "
                         f"{', '.join(plan.addresses)}, master {plan.master_addr}")

    def _rank_task(self, base: dict, r: planning.RankSpec, index: int) -> dict:
        env = planning.torchrun_env(r, base["payload"]["master_addr"], self.run_id, index, self.spec.max_restarts)
        return dict(base, rank=_rank_dict(r), payload=dict(base["payload"], rank=_rank_dict(r), env=env))

    # ---- the watcher ---------------------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        try:
            while not self.done():
                self._drain(0.05)
                self._check_ranks()
        except Exception as exc:  # a bug here must not leave ranks running or result() hanging
            logger.exception("dask-ddp job watcher failed")
            self._abort(f"the job watcher failed: {exc!r}")
            self._end("FAILED", DaskDDPError(f"dask-ddp's job watcher failed: {exc!r}; the ranks were stopped"))
        finally:
            self._watch.remove(self._watch_token)
            self._sub.close()

    def _drain(self, wait: float) -> None:
        import queue

        try:
            msg = self._sub.queue.get(timeout=wait)
        except queue.Empty:
            return
        while True:
            self._deliver(self._sub.take(msg))
            try:
                msg = self._sub.queue.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, batches: list[dict]) -> None:
        for batch in batches:
            for item in batch.get("items", []):
                self._on_item(item)
        if batches:  # wake wait()/stream() once a batch, not once an item: they redraw and re-read on each wake
            with self._cond:
                self._cond.notify_all()

    def _on_item(self, item: dict) -> None:
        with self._cond:
            self._events.append(item)
            if item.get("kind") == "metric":
                self._metric_rows.append(item)
                self._last_report[item["rank"]] = time.monotonic()
        if item.get("kind") == "log" and self.spec.echo_logs:
            Progress.write(_format_log(item), item.get("stream") == "stderr")
        kind = item.get("kind")
        if kind in ("metric", "log"):
            self._call("on_metrics" if kind == "metric" else "on_log", item)

    def _check_ranks(self) -> None:
        att = self.attempt
        for address in self._silence.check(a for a in att.plan.addresses if a not in att.lost):
            att.lost[address] = time.time()
        for r, fut in zip(att.plan.ranks, att.futures):
            if r.rank in att.outcomes:
                continue
            if r.address in att.lost:
                att.outcomes[r.rank] = _lost_outcome(r, att.lost[r.address], self._silence.silent.get(r.address))
                fut.cancel()  # pinned to a dead worker, it would wait forever
            elif fut.done():
                att.outcomes[r.rank] = self._outcome_of(r, fut)
            else:
                continue
            if att.outcomes[r.rank].status not in ("ok", "aborted"):
                self._abort(att.outcomes[r.rank].message or f"rank {r.rank} failed")
        self._check_stall(att)
        if len(att.outcomes) == len(att.plan.ranks):
            self._attempt_ended(att)

    def _outcome_of(self, r, fut) -> RankOutcome:
        try:
            out = fut.result(timeout=5)
        except BaseException as exc:  # noqa: BLE001
            if self.spec.raise_in_task:  # compat mode: the task raises the rank's error itself
                return RankOutcome(r.rank, r.address, "error", error=cloudpickle.dumps(exc), time=time.time())
            err = RankFailedError(f"the task of rank {r.rank} on worker {r.address} failed: {exc!r}",
                                  rank=r.rank, worker=r.address)
            return RankOutcome(r.rank, r.address, "error", error=cloudpickle.dumps(err), message=str(err))
        if self.spec.raise_in_task:
            return RankOutcome(r.rank, r.address, "ok", value=cloudpickle.dumps(out))
        return out

    def _check_stall(self, att: _Attempt) -> None:
        limit = self.spec.stall_timeout
        if not limit or att.stalled or len(att.outcomes) == len(att.plan.ranks):
            return
        now = time.monotonic()
        with self._cond:
            ages = {rk: now - t for rk, t in self._last_report.items() if rk not in att.outcomes}
        stale = {rk: age for rk, age in ages.items() if age > limit}
        if not stale:
            return
        rid = f"{self.run_id}-{att.index}"
        try:
            per_worker = self.client.run(dump_stacks, rid, workers=att.plan.addresses, on_error="return")
        except Exception as exc:  # noqa: BLE001
            per_worker = {"": {-1: f"(could not collect stacks: {exc!r})"}}
        stacks = {rk: text for got in per_worker.values() if isinstance(got, dict) for rk, text in got.items()}
        # Ranks that wait inside a collective wait for one that is not: blame that one, stale yet or not
        # (reports arrive up to a flush interval apart, so the waiting rank may cross the limit first)
        live = [r.rank for r in att.plan.ranks if r.rank not in att.outcomes]
        outside = [rk for rk in live if rk in stacks and not _in_collective(stacks[rk])]
        worst = max(outside, key=lambda rk: ages.get(rk, float("inf"))) if outside else max(stale, key=stale.get)
        where = (" and is not inside a collective (the others wait inside one)"
                 if outside and len(outside) < len(live) else "")
        silent = f"sent no report for {ages[worst]:.0f} s" if worst in ages else "sent no report yet"
        dump = "\n".join(f"--- rank {rk} ---\n{stacks[rk]}" for rk in sorted(stacks))
        att.stalled = StallError(
            f"job {self.run_id} stalled: rank {worst} {silent}{where} "
            f"(stall_timeout={limit} s; the clock of a rank starts at its first report). "
            f"Stack dump of every rank:\n{dump}", stacks=stacks, rank=worst,
            worker=att.plan.ranks[worst].address)
        self._abort(f"rank {worst} stalled")

    def _attempt_ended(self, att: _Attempt) -> None:
        self._await_events(att)
        outcomes = list(att.outcomes.values())
        if att.stalled is not None:
            outcomes.append(RankOutcome(att.stalled.rank, att.stalled.worker, "stalled", time=0.0,
                                        error=cloudpickle.dumps(att.stalled)))
        decision = decide(outcomes, cancelled=self._cancel_requested, attempt=att.index,
                          max_restarts=self.spec.max_restarts)
        self._cleanup(att)
        if decision.action == "finish":
            self._values = [cloudpickle.loads(att.outcomes[r].value) for r in sorted(att.outcomes)]
            self._end("FINISHED", None, decision.reason)
        elif self._cancel_requested:
            self._end("CANCELLED", JobCancelledError(f"job {self.run_id} was cancelled; every rank was stopped"),
                      decision.reason)
        elif decision.action == "restart":
            self._restart(att, decision)
        else:
            self._end("FAILED", self._root_error(att, decision), decision.reason)

    def _restart(self, att: _Attempt, decision) -> None:
        self._transition("RESTARTING", decision.reason)
        self._call("on_restart", self, att.index + 1)
        n, selection = att.plan.world_size, self.spec.workers
        bounds = planning.elastic_bounds(selection)
        if bounds is not None:  # elastic: on the workers there are now, within the bounds
            n = bounds[0]
        elif selection is None or isinstance(selection, int):
            selection = n  # the same world size, on the workers there are now
        try:
            plan = planning.make_plan(self._workers_for_restart(n), selection, self.spec.master_addr)
        except Exception as exc:  # noqa: BLE001
            err = self._root_error(att, decision)
            err.add_note(f"[dask-ddp] no restart: {n} workers were not available within "
                         f"{self.spec.restart_wait} s ({exc})")
            self._end("FAILED", err, f"restart impossible: {exc}")
            return
        if plan.world_size != att.plan.world_size:
            logger.warning("job %s: attempt %d runs on %d workers (attempt %d had %d)", self.run_id,
                           att.index + 2, plan.world_size, att.index + 1, att.plan.world_size)
        self._launch(att.index + 1, plan)

    def _workers_for_restart(self, n: int) -> list[planning.WorkerInfo]:
        """The cluster's workers but the silent ones, once there are ``n`` (or ``restart_wait`` has passed)."""
        deadline = time.monotonic() + self.spec.restart_wait
        while True:
            workers = [w for w in planning.workers_from_scheduler_info(self.client.scheduler_info(n_workers=-1))
                       if w.address not in self._silence.silent]
            if len(workers) >= n or time.monotonic() > deadline:
                return workers
            time.sleep(0.25)

    def _await_events(self, att: _Attempt, wait: float = 5.0) -> None:
        """Make sure every batch a rank published has arrived before the job reports its end."""
        deadline = time.monotonic() + wait
        pending = [o for o in att.outcomes.values() if o.last_seq >= 0]
        backfilled = False
        while time.monotonic() < deadline:
            if all(self._sub.have_all(att.index, o.rank, o.last_seq) for o in pending):
                return
            if not backfilled and time.monotonic() > deadline - wait / 2:
                self._sub.backfill()
                backfilled = True
            self._drain(0.05)
        self._deliver(self._sub.flush())  # batches whose predecessor never came: late rather than lost

    def _root_error(self, att: _Attempt, decision) -> BaseException:
        root = decision.root
        if root is None:
            return RankFailedError(f"job {self.run_id} failed: {decision.reason}")
        try:
            err = cloudpickle.loads(root.error)
        except Exception as exc:  # noqa: BLE001 - e.g. the exception's class is not importable here
            err = RankFailedError(f"rank {root.rank} on worker {root.worker} failed; its error could not be "
                                  f"unpickled on the client ({exc!r}): {root.message}",
                                  rank=root.rank, worker=root.worker)
        others = [o for o in att.outcomes.values() if o.rank != root.rank or o.status != root.status]
        if others:
            err.add_note("[dask-ddp] other ranks: " + "; ".join(
                f"rank {o.rank} {_FATE.get(o.status, o.status)}" for o in sorted(others, key=lambda o: o.rank)))
        return err

    # ---- acting --------------------------------------------------------------------------------------------
    def _on_worker_removed(self, address: str) -> None:
        att = self.attempt
        if att is not None and address in att.plan.addresses and address not in att.lost:
            att.lost[address] = time.time()

    def _abort(self, cause: str) -> None:
        att = self.attempt
        if att is None:
            return
        try:
            from distributed import Event
            Event(att.names["abort"], client=self.client).set()
        except Exception:  # noqa: BLE001 - the client may be closing; the tasks then fail on their own
            logger.warning("dask-ddp could not set the abort flag of %s", self.run_id)
        logger.info("job %s: stopping every rank of attempt %d: %s", self.run_id, att.index + 1, cause)

    def _cleanup(self, att: _Attempt) -> None:
        from distributed import Event, Variable
        for fut in att.futures:
            fut.release()
        try:
            Event(att.names["abort"], client=self.client).clear()
            Variable(att.names["port"], client=self.client).delete()
            Event(att.names["port"] + "-ready", client=self.client).clear()
        except Exception:  # noqa: BLE001
            pass

    def _end(self, state: str, error: BaseException | None, cause: str = "") -> None:
        self._error = error
        self._transition(state, cause or (str(error) if error else ""))
        if error is not None:
            self._call("on_failure", self, error)
        self._call("on_finish", self)  # before waking result(): a sink's file is complete when result() returns
        with self._cond:
            self._settled = True
            self._cond.notify_all()

    def _transition(self, new: str, cause: str) -> None:
        with self._cond:
            old, self.state = self.state, new
            self.history.append((time.time(), old, new, cause))
            self._cond.notify_all()
        logger.info("job %s: %s -> %s (%s)", self.run_id, old, new, cause)

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self._callbacks:
            if id(cb) in self._broken_callbacks:
                continue
            fn = getattr(cb, hook, None) if not _is_plain(cb) else (cb if hook in ("on_metrics", "on_log") else None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a broken callback never changes the training outcome
                self._broken_callbacks.add(id(cb))
                logger.exception("dask-ddp callback %r failed in %s; it is disabled for this job", cb, hook)


_FATE = {"ok": "finished", "aborted": "was stopped", "error": "raised", "died": "died", "lost": "lost its worker"}


def _is_plain(cb) -> bool:
    return callable(cb) and not any(hasattr(cb, h) for h in
                                    ("on_start", "on_metrics", "on_log", "on_failure", "on_restart", "on_finish"))


_COLLECTIVE_FRAMES = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")


def _in_collective(stack: str) -> bool:
    """Whether a rank's stack dump shows it inside torch.distributed or a backward pass (DDP's all-reduce)."""
    return any(frame in stack.replace("\\", "/") for frame in _COLLECTIVE_FRAMES)


def _format_log(item: dict) -> str:
    """``[rank N] line``; after a restart ``[rank N, attempt K] line`` (K counts from 1, as in ``job.history``)."""
    attempt = item.get("attempt", 0)
    where = f"rank {item['rank']}, attempt {attempt + 1}" if attempt else f"rank {item['rank']}"
    return f"[{where}] {item['line']}"


def _rank_dict(r: planning.RankSpec) -> dict:
    return dict(r.__dict__)


def _lost_outcome(r: planning.RankSpec, when: float, silent: float | None = None) -> RankOutcome:
    how = (f"sent the scheduler no heartbeat for {silent:.0f} s (ddp.worker-timeout): its machine or network "
           "went away, or the process is frozen" if silent is not None else
           "left the cluster while the job ran (killed, out of memory, or its machine went away)")
    err = WorkerLostError(f"rank {r.rank}'s worker {r.address} (name {r.name!r}) {how}; see the worker's logs, or "
                          "set max_restarts= to restart on the workers left", rank=r.rank, worker=r.address)
    return RankOutcome(r.rank, r.address, "lost", error=cloudpickle.dumps(err), message=str(err), time=when)
