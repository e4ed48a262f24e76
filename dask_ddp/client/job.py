"""The handle of a running DDP job: what ``dask_ddp.dispatch.run`` returns.

Runs in: the client (the notebook). States (every transition is logged on the
``dask_ddp`` logger with its cause and kept in :attr:`Job.history`)::

    PENDING -> RUNNING -> FINISHED
                       -> FAILED       (a rank raised/died, a worker left, a stall; no restarts left)
                       -> CANCELLED    (job.cancel())
                       -> RESTARTING -> RUNNING   (max_restarts not used up)

The handle only reads a :class:`~dask_ddp.client.record.JobRecord` and acts through a control
(:mod:`dask_ddp.client.control`) that fills it: by default a local one, whose watcher thread runs the
job's :class:`~dask_ddp.client.controller.Controller`; for a detached or attached job a remote one,
that polls the job's driver in the scheduler's process (:mod:`dask_ddp.client.detach`). Either way
the handle, its spec (the job's :class:`~dask_ddp.wire.spec.LaunchSpec`) and every property are the same.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

import pandas as pd

from dask_ddp.checkpoint.folder import job_folder
from dask_ddp.client.attempt import Attempt
from dask_ddp.client.control import Control, LocalControl
from dask_ddp.client.goodput import COLUMNS as GOODPUT_COLUMNS
from dask_ddp.client.record import ENDED, format_log
from dask_ddp.observe.display import job_html, progress_text
from dask_ddp.observe.progress import Progress
from dask_ddp.observe.sinks import plot_metrics
from dask_ddp.wire.notices import grace_period
from dask_ddp.wire.spec import LaunchSpec
from dask_ddp.wire.task import topic_of

if TYPE_CHECKING:
    from distributed import Client

    from dask_ddp.wire.plan import RankPlan

__all__ = ["Job"]

LEAD = ["rank", "attempt", "step", "time", "elapsed"]


class Job:
    """A DDP job started by :func:`dask_ddp.dispatch.run`; returned at once, while the ranks start.

    The same handle follows a detached job (``run(..., detach=True)``, :func:`dask_ddp.attach`): its
    ``futures`` are empty and ``attempt`` is None (they live with the job's driver in the scheduler's
    process), and Ctrl-C while waiting leaves it running.

    Attributes
    ----------
    run_id : str
        The job's id (name made safe plus 8 random hex); it names its checkpoint folder.
    checkpoint_dir : str or None
        This job's own checkpoint folder, ``<checkpoint_dir>/<run_id>`` (None without
        ``checkpoint_dir=``): pass it as ``directory=`` to load this job's checkpoints
        elsewhere, e.g. to resume it in a later job.
    state : str
        PENDING, RUNNING, RESTARTING, FINISHED, FAILED or CANCELLED.
    history : list of (time, old, new, cause)
    futures : list of distributed.Future
        The rank tasks of the current attempt, in rank order (empty for a detached job).
    spec : LaunchSpec
        What the job was launched with (frozen).
    """

    def __init__(self, client: Client, spec: LaunchSpec, control: Control | None = None) -> None:
        """The handle of job ``spec`` on ``client``'s cluster, acting through ``control`` (default: a
        :class:`~dask_ddp.client.control.LocalControl`, which drives the job from this process)."""
        self.client, self.spec = client, spec
        self.run_id = spec.run_id
        self.name = spec.name or spec.fn_name
        self.topic = topic_of(self.run_id)
        self._control = LocalControl(client, spec) if control is None else control
        self._control.bind(self)
        self._record = self._control.record

    def _start(self) -> "Job":
        self._control.start()
        return self

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str | None:
        if self.spec.checkpoint_dir is None:
            return None
        return job_folder(self.spec.checkpoint_dir, self.run_id)

    @property
    def state(self) -> str:
        return self._record.state

    @property
    def history(self) -> list[tuple[float, str, str, str]]:
        return self._record.history

    @property
    def attempt(self) -> Attempt | None:
        """The current attempt (its ``index``, ``plan``, ``futures`` and ``outcomes``), or None before the first."""
        return self._control.attempt

    @property
    def futures(self) -> list:
        return list(self.attempt.futures) if self.attempt else []

    @property
    def plan(self) -> RankPlan | None:
        """The :class:`~dask_ddp.wire.plan.RankPlan` of the current attempt (None before the first)."""
        return self._control.plan

    def done(self) -> bool:
        """True once the job has FINISHED, FAILED or been CANCELLED (and its on_finish callbacks have run)."""
        return self._record.settled

    # ---- waiting -------------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None, *, progress: bool | None = None) -> bool:
        """Block until the job ends or ``timeout`` seconds pass, with a progress bar; True if it ended.

        Never raises for a failed job (see :meth:`result`).

        Raises
        ------
        KeyboardInterrupt
            Ctrl-C, or the notebook's interrupt, while it waits: the job is cancelled first (its ranks stop
            within a second; a detached job keeps running), and a note on the exception says so.
        """
        if self._in_callback("wait() or result()"):  # on_failure / on_finish: the outcome is known
            return True
        show = self.spec.progress if progress is None else progress
        bar = Progress(self, total=self.spec.total) if show else None
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._record.cond
        try:
            with cond:
                while not self.done():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    cond.wait(0.2 if left is None else min(0.2, left))
                    if bar:
                        bar.update()
        except KeyboardInterrupt as exc:
            self._interrupted(exc)
            raise
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
        KeyboardInterrupt
            Ctrl-C or the notebook's interrupt: the job is cancelled (see :meth:`wait`).
        """
        if not self.wait(timeout, progress=progress):
            raise TimeoutError(f"job {self.run_id} still {self.state} after {timeout} s; it keeps running: "
                               "call result() again or cancel()")
        if self._record.error is not None:
            raise self._record.error
        return list(self._record.values or ())

    def _in_callback(self, what: str) -> bool:
        """True inside one of the job's callbacks once the job has its outcome (on_failure, on_finish), False
        outside them.

        Raises
        ------
        RuntimeError
            Inside a callback before the job's end: waiting there would wait forever, since the callbacks run in
            the thread that drives the job.
        """
        if not self._control.in_driver_thread():
            return False
        if self._record.state in ENDED:
            return True
        raise RuntimeError(f"job {self.run_id}: {what} inside one of the job's callbacks would wait forever (the "
                           "callbacks run in the thread that drives the job): call job.cancel() to stop it early, "
                           "and read job.state / job.metrics, or wait in on_finish")

    def _interrupted(self, exc: KeyboardInterrupt) -> None:
        """Ctrl-C while waiting: a local job is cancelled without waiting, a detached one keeps running; a note
        on ``exc`` says which."""
        if not self.done():
            self._control.interrupted(exc)

    def cancel(self, timeout: float = 30) -> None:
        """Stop every rank (their processes are killed) and wait for them; result() then raises JobCancelledError.

        Inside one of the job's callbacks (early stopping in ``on_metrics``) it returns at once: the ranks are
        stopped once the callback returns.
        """
        if self.done():
            return
        self._control.cancel()
        if not self._control.in_driver_thread():
            self.wait(timeout, progress=False)

    def stop(self, cause: str = "job.stop() was called", grace: float | None = None) -> None:
        """Stop every rank at one agreed step, without a restart, and return at once (``wait()`` waits).

        The ranks get a ``stop`` notice (the preemption protocol): each stops at the same ``report()``, saving
        what the code registered with :func:`dask_ddp.on_preemption` first; the job then ends CANCELLED with
        ``stopped_step`` set. Ranks that do not reach a report within ``grace`` seconds (default
        ``ddp.preemption.grace-period``) are stopped as by :meth:`cancel`. A detached job is cancelled.
        """
        if not self.done():
            self._control.stop(cause, grace_period() if grace is None else float(grace))

    @property
    def stopped_step(self) -> int | None:
        """The step every rank stopped at after :meth:`stop` (None: not stopped so, or not yet)."""
        return self._control.record.stopped_step

    # ---- what the ranks sent -------------------------------------------------------------------------------
    @property
    def metrics(self) -> pd.DataFrame:
        """A pandas DataFrame of the reports so far: rank, attempt, step, time, elapsed, then the reported keys.

        ``time`` is when the rank reported (a UTC timestamp), ``elapsed`` the seconds since the job was
        started. The latest ``ddp.events.max-rows`` (100,000) reports, within ``ddp.events.max-record-bytes``
        (past it the older half is thinned: every other row dropped); a sink keeps the whole history.
        """
        with self._record.cond:
            rows = list(self._record.metric_rows)
        df = pd.DataFrame(rows, columns=None if rows else LEAD[:-1])
        seconds = df["time"].astype(float)
        df["elapsed"] = seconds - self._record.created
        df["time"] = pd.to_datetime(seconds, unit="s", utc=True)
        return df[LEAD + [c for c in df.columns if c not in LEAD and c != "kind"]]

    @property
    def goodput(self) -> pd.DataFrame:
        """Where the job's wall time went, so far: a DataFrame indexed by ``"job"`` then each rank, with the
        seconds of productive steps, start-up, waiting for data, checkpoint stalls, recovery, steps redone and
        other (``productive_s`` ... ``other_s``), their sum ``wall_s`` and ``goodput``, the productive share.

        The job's row covers the wall time since ``dispatch.run``; a rank's row its place in each attempt. The
        ranks' shares come from their telemetry: with ``ddp.telemetry.enabled: false`` the table has no rows.
        ``docs/guide/metrics.md`` says what each category holds.
        """
        rows = self._record.goodput_rows() if self.spec.telemetry_interval is not None else []
        return pd.DataFrame(rows, columns=GOODPUT_COLUMNS).set_index("rank")

    @property
    def dropped(self) -> dict[int, int]:
        """Per rank, how many reports and log records its limits dropped (``ddp.events.max-*``: a report with
        too many keys, a name too long, too many bytes, or past the rank's bytes per flush interval); ``{}``
        when none. ``history`` names each reason once, and the total at the end."""
        with self._record.cond:
            return dict(self._record.dropped)

    @property
    def logs(self) -> list[str]:
        """The ranks' output lines and log records so far, as ``[rank N] line`` (the latest ``ddp.events.max-lines``).

        Lines of a later attempt read ``[rank N, attempt K] line`` (K from 1, as in :attr:`history`).
        """
        with self._record.cond:
            return [format_log(e) for e in self._record.log_items]

    @property
    def events(self) -> list[dict]:
        """The latest events (metrics and logs, within ``ddp.events.max-record-bytes``), in arrival order."""
        with self._record.cond:
            return list(self._record.events)

    def stream(self, timeout: float | None = None) -> Iterator[dict]:
        """Iterate over events as they arrive, from the first held, until the job ends and all are seen.

        A reader slower than the ranks by more than the events held skips the ones dropped meanwhile.

        Raises
        ------
        RuntimeError
            Inside one of the job's callbacks before its end (in ``on_finish`` it yields every event and ends).
        """
        n, deadline = 0, None if timeout is None else time.monotonic() + timeout
        record = self._record
        if self._in_callback("stream()"):  # on_failure / on_finish: every event has arrived
            yield from record.events_since(0)[0]
            return
        while True:
            with record.cond:
                while n >= record.n_events and not self.done():
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    record.cond.wait(0.2)
                finished = self.done()
            batch, n = record.events_since(n)
            yield from batch
            if finished and not batch:
                return

    def plot(self, y: str | list[str] | None = None, x: str = "step", ax: Any = None) -> Any:
        """Plot reported metrics per rank with matplotlib (every numeric key but ``epoch`` by default).

        Raises
        ------
        ValueError
            Nothing reported yet, or ``x``/``y`` names a column the metrics do not have.
        """
        return plot_metrics(self.metrics, y=y, x=x, ax=ax)

    def _repr_html_(self) -> str:
        """The job in a notebook: state, attempt and the per-rank table (step time, waits, memory, GPU, ...)."""
        return job_html(self)

    def __repr__(self) -> str:
        plan = self.plan
        ranks = plan.world_size if plan else "?"
        workers = f" workers={len({r.address for r in plan.ranks})}" if plan else ""
        step = progress_text(self)
        return f"<dask_ddp.Job {self.run_id} {self.state} ranks={ranks}{workers}" + (f" {step}>" if step else ">")
