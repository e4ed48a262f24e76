"""What the scheduler knows of dask-ddp jobs: their state, and each rank's latest telemetry and step times.

Runs in: the scheduler's process (fed by :class:`~dask_ddp.dashboard.plugin.DDPDashboard`'s ``log_event``
hook; read by the page and the Prometheus collector). Pure bookkeeping, no I/O: tests feed it messages.

Two kinds of messages arrive:

- on a job's own topic (``dask-ddp-<run_id>``), the ranks' event batches
  ``{"run", "rank", "attempt", "seq", "items": [...]}`` (items packed as bytes; a host's hub sends several
  as ``{"run", "batches": [...]}``): items of kind ``"telemetry"`` (one a second per
  rank) update the rank's row and its step-time history; the last ``"metric"`` item of a batch updates
  its step and when it was last seen; items of kind ``"dropped"`` count what the ranks' limits dropped;
- on ``dask-ddp-jobs``, what the client's controller says: ``{"kind": "job", "run", "name", "state",
  "attempt", "time", "ranks": [{"rank", "worker", "host", "device"}]}`` at every state transition and
  ``{"kind": "straggler", "run", "rank", "worker", "host", "cause", "time", "message"}``, and what a
  sweep's driver says (:mod:`dask_ddp.sweeps.view`): ``{"kind": "sweep", "sweep", "state", "time",
  "n_trials", "trials": {state: count}, "busy", "room", "occupancy"}``, kept in ``sweeps``.

Everything is bounded: the last ``keep_jobs`` jobs (ended ones are dropped first), ``history`` step times
per rank, ``MAX_STRAGGLERS`` straggler messages per job, and the ranks of a job: those of its plan (the
controller's message lists them), at most ``MAX_RANKS``, or ``MAX_UNPLANNED`` while no plan was heard; an
item about any other rank number (rank code can send any) is dropped and counted in ``JobView.ignored``. A
message that does not parse is ignored, never raised: it arrives on the scheduler's event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from dask_ddp.dashboard.jobs import JOB_TOPIC_PREFIX, JOBS_TOPIC
from dask_ddp.wire.events import items_of, unpack
from dask_ddp.wire.goodput import RANK_CATEGORIES, checked, ratio

__all__ = ["DashboardState", "JobView", "RankView", "ENDED", "rank_rows"]

ENDED = ("FINISHED", "FAILED", "CANCELLED")
MAX_STRAGGLERS = 20
MAX_RANKS = 4096  # ranks held per job at most, whatever its plan says
MAX_UNPLANNED = 256  # ... and while the scheduler has heard no plan of the job (its controller's message comes first)
TELEMETRY_FIELDS = ("step_time", "input_wait", "collective_wait", "samples_per_s", "cpu_percent", "rss_bytes",
                    "gpu_util", "gpu_mem_bytes", "gpu_mem_peak_bytes", "last_report_age", "ckpt_step", "ckpt_stall_s",
                    "ckpt_waited_s", "ckpt_upload_s", "ckpt_bytes", "ckpt_mb_s")


@dataclass
class RankView:
    """One rank of a job's current attempt, as the scheduler last heard of it."""

    rank: int
    worker: str | None = None
    host: str | None = None
    device: str | None = None
    step: int | None = None
    seen: float | None = None  # unix time of the rank's latest item (telemetry or report)
    telemetry: dict = field(default_factory=dict)  # its latest telemetry item
    history: deque = field(default_factory=lambda: deque(maxlen=120))  # (unix time, step time s)
    straggler: str | None = None  # "input" or "compute" once the job named it a straggler
    dropped: int = 0  # reports and lines its limits dropped this attempt (ddp.events.max-*)
    goodput: dict = field(default_factory=dict)  # its process's latest ledger: {category: seconds}


@dataclass
class JobView:
    """One job: its name, state and attempt, and the ranks of its current attempt."""

    run: str
    name: str
    state: str = "RUNNING"
    attempt: int = 0
    started: float = 0.0
    updated: float = 0.0  # time of the latest job message (older ones arriving late are ignored)
    ranks: dict[int, RankView] = field(default_factory=dict)
    stragglers: deque = field(default_factory=lambda: deque(maxlen=MAX_STRAGGLERS))
    dropped: int = 0  # reports and lines its ranks' limits dropped, all attempts
    world: int | None = None  # the current attempt's planned world size (None: no plan heard yet)
    ignored: int = 0  # items about ranks outside the plan (or past MAX_RANKS), dropped here

    def holds(self, rank: int) -> bool:
        """Whether the page keeps rank ``rank`` of this job: one of its plan, at most ``MAX_RANKS`` (or
        ``MAX_UNPLANNED`` before a plan was heard); an item about another is counted in ``ignored``."""
        if 0 <= rank < min(MAX_RANKS, MAX_UNPLANNED if self.world is None else self.world):
            return True
        self.ignored += 1
        return False

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def goodput(self) -> float | None:
        """The productive share of the current ranks' processes' time together (None before any ledger)."""
        together: dict[str, float] = {}
        for view in self.ranks.values():
            for k, v in view.goodput.items():
                together[k] = together.get(k, 0.0) + v
        return ratio(together)


class DashboardState:
    """The latest jobs and their ranks, fed by :meth:`feed`; thread-safe (the page reads from Bokeh callbacks).

    Parameters
    ----------
    keep_jobs : int
        Jobs held; past it the oldest ended job goes (the oldest job when none has ended).
    history : int
        Step-time points held per rank for the chart.
    """

    def __init__(self, keep_jobs: int = 20, history: int = 120):
        self.keep_jobs, self.history = max(1, int(keep_jobs)), max(2, int(history))
        self.jobs: OrderedDict[str, JobView] = OrderedDict()
        self.sweeps: OrderedDict[str, dict] = OrderedDict()  # sweep name -> its latest message (see _sweep)
        self.lock = threading.Lock()
        self.version = 0  # bumped on every change: readers redraw only when it moved

    # ---- feeding -------------------------------------------------------------------------------------------
    def feed(self, topic: str, msg) -> bool:
        """Take one message logged on ``topic``; True if it was a dask-ddp message this state used."""
        if not isinstance(topic, str) or not topic.startswith(JOB_TOPIC_PREFIX) or not isinstance(msg, dict):
            return False
        try:
            with self.lock:
                if topic == JOBS_TOPIC:
                    used = self._job_message(msg)
                else:  # a rank's batch, or a host hub's event of several (ddp.events.per-host)
                    used = any([self._batch(topic, batch) for batch in unpack(msg) if isinstance(batch, dict)])
                self.version += used
                return used
        except Exception:  # noqa: BLE001 - a malformed message (a user's odd report) must never reach the scheduler
            return False

    def _job_message(self, msg: dict) -> bool:
        kind, run = msg.get("kind"), msg.get("run")
        if kind == "sweep":
            return self._sweep(msg)
        if not isinstance(run, str):
            return False
        if kind == "job":
            return self._job(run, msg)
        if kind == "straggler":
            return self._straggler(run, msg)
        return False

    def _sweep(self, msg: dict) -> bool:
        name, at = msg.get("sweep"), float(msg.get("time") or time.time())
        if not isinstance(name, str) or at < self.sweeps.get(name, {}).get("time", 0.0):
            return False
        got = msg.get("trials")
        trials: dict = got if isinstance(got, dict) else {}
        self.sweeps[name] = {"sweep": name, "state": str(msg.get("state") or "RUNNING"), "time": at,
                             "n_trials": int(msg.get("n_trials") or 0), "busy": int(msg.get("busy") or 0),
                             "room": int(msg.get("room") or 0), "occupancy": msg.get("occupancy"),
                             "trials": {str(k): int(v) for k, v in trials.items()}}
        self.sweeps.move_to_end(name)
        while len(self.sweeps) > self.keep_jobs:
            ended = next((k for k, v in self.sweeps.items() if v["state"] in ENDED), next(iter(self.sweeps)))
            del self.sweeps[ended]
        return True

    def _job(self, run: str, msg: dict) -> bool:
        at = float(msg.get("time") or time.time())
        job = self._get(run, msg.get("name"), at)
        if at < job.updated:
            return False  # an older transition arriving late
        job.updated, job.state = at, str(msg.get("state") or job.state)
        job.name = str(msg.get("name") or job.name)
        attempt = int(msg.get("attempt") or 0)
        if attempt != job.attempt or not job.ranks:
            job.attempt, job.ranks = attempt, {}
        planned = msg.get("ranks") or ()
        if planned:  # the attempt's plan: its ranks are the only ones the page keeps
            job.world = len(planned)
            for extra in [rk for rk in job.ranks if rk >= job.world]:
                del job.ranks[extra]
        for r in planned[:MAX_RANKS]:
            view = self._rank(job, int(r["rank"]))
            if view is not None:
                view.worker, view.host = r.get("worker") or view.worker, r.get("host") or view.host
                view.device = r.get("device") or view.device
        return True

    def _straggler(self, run: str, msg: dict) -> bool:
        job = self._get(run, None, float(msg.get("time") or time.time()))
        view = self._rank(job, int(msg["rank"]))
        if view is None:
            return False
        view.straggler = str(msg.get("cause") or "unknown")
        view.worker, view.host = msg.get("worker") or view.worker, msg.get("host") or view.host
        job.stragglers.append({k: msg.get(k) for k in ("rank", "worker", "host", "cause", "time", "message")})
        return True

    def _batch(self, topic: str, msg: dict) -> bool:
        if not isinstance(msg.get("items"), (bytes, list, tuple)):  # msgpack delivers lists as tuples
            return False
        items = items_of(msg)
        run = topic[len(JOB_TOPIC_PREFIX):]
        attempt = int(msg.get("attempt") or 0)
        job = self.jobs.get(run)
        if job is not None and attempt < job.attempt:
            return False  # a late batch of an attempt that was replaced
        used = False
        for item in items:
            if item.get("kind") == "telemetry":
                used = self._telemetry(self._get(run, None, item.get("time")), attempt, item) or used
            elif item.get("kind") == "dropped":
                job = self._get(run, None, item.get("time"))
                view = self._rank(self._at_attempt(job, attempt), int(item["rank"]))
                if view is not None:
                    count = int(item.get("count") or 0)
                    job.dropped += count
                    view.dropped += count
                    used = True
        last = next((i for i in reversed(items) if i.get("kind") == "metric"), None)
        if last is not None:
            view = self._rank(self._at_attempt(self._get(run, None, last.get("time")), attempt), int(last["rank"]))
            if view is not None:
                view.step, view.seen = last.get("step", view.step), _max(view.seen, last.get("time"))
                used = True
        return used

    def _telemetry(self, job: JobView, attempt: int, item: dict) -> bool:
        view = self._rank(self._at_attempt(job, attempt), int(item["rank"]))
        if view is None:
            return False
        view.telemetry = {k: item.get(k) for k in TELEMETRY_FIELDS}
        view.goodput = checked(item) or view.goodput  # a rank's code could send anything
        at = item.get("time")
        if item.get("step") is not None:
            view.step = item["step"]
        view.seen = _max(view.seen, at)
        if item.get("step_time") is not None and at is not None:
            view.history.append((float(at), float(item["step_time"])))
        return True

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _get(self, run: str, name, at) -> JobView:
        job = self.jobs.get(run)
        if job is None:
            at = float(at or time.time())
            # the run id is the job's name made safe plus 8 hex digits: the best name until the job says its own
            job = self.jobs[run] = JobView(run, str(name or run.rsplit("-", 1)[0]), started=at)
            self._trim()
        return job

    def _at_attempt(self, job: JobView, attempt: int) -> JobView:
        if attempt > job.attempt:  # the ranks report a restart before the controller's message arrived
            job.attempt, job.ranks, job.world = attempt, {}, None  # its plan may differ: heard with that message
        return job

    def _rank(self, job: JobView, rank: int) -> RankView | None:
        """The view of ``rank`` in ``job`` (made on first use); None for a rank the job does not hold."""
        view = job.ranks.get(rank)
        if view is None:
            if not job.holds(rank):
                return None
            view = job.ranks[rank] = RankView(rank, history=deque(maxlen=self.history))
        return view

    def orphaned(self, runs: list[str]) -> None:
        """The jobs ``runs`` ended without saying so (their client left while they ran, and their ranks stop with
        it): shown CANCELLED."""
        with self.lock:
            for run in runs:
                job = self.jobs.get(run)
                if job is not None and not job.ended:
                    job.state, job.updated = "CANCELLED", time.time()
                    self.version += 1

    def _trim(self) -> None:
        while len(self.jobs) > self.keep_jobs:
            ended = next((run for run, job in self.jobs.items() if job.ended), None)
            self.jobs.pop(ended if ended is not None else next(iter(self.jobs)))

    # ---- reading -------------------------------------------------------------------------------------------
    def snapshot(self) -> list[JobView]:
        """The jobs held, newest first (the views themselves: read them under :attr:`lock`)."""
        with self.lock:
            return sorted(self.jobs.values(), key=lambda j: j.started, reverse=True)


def _max(a, b):
    if b is None:
        return a
    return float(b) if a is None else max(a, float(b))


def rank_rows(job: JobView, now: float | None = None) -> dict[str, list]:
    """The per-rank table of ``job`` as columns (one entry per rank, in rank order); call under the state's lock.

    ``last_seen`` is seconds since the rank's latest item; ``goodput`` the productive share of its process's
    time and ``goodput_<category>_s`` its seconds in each category; missing values are None (the page shows
    blanks).
    """
    now = time.time() if now is None else now
    views = [job.ranks[r] for r in sorted(job.ranks)]
    cols: dict[str, list] = {k: [] for k in ("rank", "worker", "host", "device", "step", "last_seen", "straggler",
                                             "dropped", "goodput", *TELEMETRY_FIELDS,
                                             *(f"goodput_{c}_s" for c in RANK_CATEGORIES))}
    for v in views:
        t = v.telemetry
        device = v.device or (None if not t else "cuda" if t.get("gpu_mem_bytes") is not None else "cpu")
        for key, value in (("rank", v.rank), ("worker", v.worker), ("host", v.host), ("device", device),
                           ("step", v.step), ("last_seen", None if v.seen is None else max(0.0, now - v.seen)),
                           ("straggler", v.straggler), ("dropped", v.dropped), ("goodput", ratio(v.goodput))):
            cols[key].append(value)
        for c in RANK_CATEGORIES:
            cols[f"goodput_{c}_s"].append(v.goodput.get(c))
        for key in TELEMETRY_FIELDS:
            cols[key].append(t.get(key))
    return cols
