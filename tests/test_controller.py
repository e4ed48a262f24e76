"""The job controller stepped one iteration at a time against a fake cluster: no Dask, no processes, no sleeps.

The fake stands in for :class:`dask_ddp.client.cluster.DaskCluster` (the real one is exercised by every test that starts
a cluster); it records what the controller does to it, and the tests decide what the "ranks" do and when.
The clock is the test's too, so timeouts (stall, worker silence, restart wait, event drain) pass at once.
"""

from __future__ import annotations

import cloudpickle
import pytest

import dask_ddp
from dask_ddp.client.controller import DRAIN_WAIT, Controller
from dask_ddp.client.notices import GROW_EVERY
from dask_ddp.client.record import JobRecord
from dask_ddp.wire.errors import RankFailedError
from dask_ddp.wire.outcome import RankOutcome, Status
from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info
from dask_ddp.wire.spec import LaunchSpec


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Future:
    def __init__(self, key):
        self.key, self.cancelled, self.released = key, False, False


class FakeCluster:
    """What the controller sees of a cluster; the test sets what its ranks do."""

    def __init__(self, n_workers=2):
        self.scheduler_workers = {f"tcp://10.0.0.{i + 1}:4000": {"host": f"10.0.0.{i + 1}", "name": str(i),
                                                                  "last_seen": 0.0} for i in range(n_workers)}
        self.attempts: list[list] = []  # the tasks of each attempt, as submitted
        self.results: dict[str, RankOutcome] = {}  # task key -> outcome once "done"
        self.aborted, self.cleaned, self.closed = [], [], False
        self.pending: list[dict] = []  # event batches to deliver at the next step
        self.held: list[dict] = []  # event batches only a backfill brings
        self.gone: list[str] = []
        self.retired: list[str] = []  # workers the scheduler retired (expected removals)
        self.stack_dumps: dict[int, str] = {}
        self.futures: list[Future] = []
        self.notices: list[tuple] = []  # (attempt id, addresses, cause, grace, kind) of each notify()

    # the port
    def submit(self, tasks):
        self.attempts.append(list(tasks))
        futures = [Future(t.key) for t in tasks]
        self.futures += futures
        return futures

    def outcome(self, future, task):
        return self.results.get(task.key)

    def cancel(self, future):
        future.cancelled = True

    def release(self, futures):
        for f in futures:
            f.released = True

    def abort(self, task, cancel=False):
        self.aborted.append(task.attempt_id)

    def notify(self, task, addresses, cause, grace, kind="grow"):
        self.notices.append((task.attempt_id, addresses, cause, grace, kind))

    def cleanup(self, task):
        self.cleaned.append(task.attempt_id)

    def workers(self):
        return self.scheduler_workers

    def client_closed(self):
        return False

    def removed(self):
        out, self.gone = self.gone, []
        return out

    def leaving(self):
        out, self.retired = self.retired, []
        return out

    def stacks(self, attempt_id, addresses):
        return dict(self.stack_dumps)

    def events(self, wait):
        out, self.pending = self.pending, []
        return out

    def backfill(self):
        return list(self.held)

    def close(self):
        self.closed = True

    # what the test makes the ranks do
    def task(self, rank, attempt=-1):
        return self.attempts[attempt][rank]

    def end(self, rank, status, value=None, error=None, last_seq=-1, secondary=False, attempt=-1, t=1.0):
        task = self.task(rank, attempt)
        self.results[task.key] = RankOutcome(
            rank, task.rank.address, status, value=None if value is None else cloudpickle.dumps(value),
            error=None if error is None else cloudpickle.dumps(error), time=t, last_seq=last_seq,
            secondary=secondary, message=f"rank {rank} {status}")

    def batch(self, rank, seq, *items, attempt=0):
        return {"run": "r", "rank": rank, "attempt": attempt, "seq": seq,
                "items": [dict(it, rank=rank, attempt=attempt) for it in items]}

    def heartbeat(self, *addresses, at=1.0):
        for a in addresses:
            self.scheduler_workers[a]["last_seen"] += at


def metric(step, **values):
    return {"kind": "metric", "step": step, "time": 0.0, **values}


class Recorder:
    """A callback object that records the hooks it gets."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, hook):
        if not hook.startswith("on_"):
            raise AttributeError(hook)
        return lambda *args: self.calls.append((hook, *args))


def make(n_workers=2, workers=None, **spec_kw):
    cluster, clock = FakeCluster(n_workers), Clock()
    plan = make_plan(workers_from_scheduler_info({"workers": cluster.scheduler_workers}), workers)
    spec_kw.setdefault("echo_logs", False)
    spec_kw.setdefault("worker_timeout", None)
    spec = LaunchSpec(call=b"", fn_name="train", run_id="job-1", first_plan=plan, workers=workers, **spec_kw)
    record = JobRecord("job-1")
    ctl = Controller(spec, "job-1", cluster, record, owner="JOB", clock=clock)
    ctl.start()
    return ctl, cluster, clock, record


def states(record):
    return [new for _, _, new, _ in record.history]


def run_until_ended(ctl, limit=20):
    for _ in range(limit):
        if ctl.step(0):
            return
    raise AssertionError(f"the controller did not end in {limit} steps (phase {ctl.phase})")


# ---- the happy path ------------------------------------------------------------------------------------------

def test_every_rank_returns():
    ctl, cluster, clock, record = make()
    assert states(record) == ["RUNNING"] and len(cluster.attempts) == 1
    assert [t.rank.rank for t in cluster.attempts[0]] == [0, 1] and cluster.task(0).attempt_id == "job-1-0"
    assert ctl.step(0) is False  # nothing ended yet
    cluster.end(1, "ok", value="b")
    assert ctl.step(0) is False
    cluster.end(0, "ok", value="a")
    run_until_ended(ctl)
    assert states(record) == ["RUNNING", "FINISHED"] and record.values == ["a", "b"] and record.error is None
    assert record.settled and cluster.aborted == [] and cluster.cleaned == ["job-1-0"]
    assert all(f.released for f in cluster.futures)


def test_events_are_delivered_in_order_and_waited_for_before_the_end():
    ctl, cluster, clock, record = make()
    cluster.pending = [cluster.batch(0, 1, metric(1, loss=0.5)), cluster.batch(0, 0, metric(0, loss=1.0))]
    ctl.step(0)
    assert [r["step"] for r in record.metric_rows] == [0, 1]  # seq 1 was held until seq 0 came
    cluster.held = [cluster.batch(1, 0, metric(0, loss=2.0))]  # published, but only a backfill brings it
    cluster.end(0, "ok", value=0, last_seq=1)
    cluster.end(1, "ok", value=1, last_seq=0)
    assert ctl.step(0) is False and ctl.phase == "draining"
    clock.t += DRAIN_WAIT * 0.6  # past half the drain wait: one backfill
    assert ctl.step(0) is True
    assert [(r["rank"], r["step"]) for r in record.metric_rows] == [(0, 0), (0, 1), (1, 0)]


def test_a_batch_that_never_comes_does_not_hold_the_end_forever():
    ctl, cluster, clock, record = make()
    cluster.pending = [cluster.batch(0, 1, metric(1))]  # seq 0 is lost
    cluster.end(0, "ok", value=0, last_seq=1)
    cluster.end(1, "ok", value=1)
    assert ctl.step(0) is False
    clock.t += DRAIN_WAIT + 1
    assert ctl.step(0) is True and [r["step"] for r in record.metric_rows] == [1]  # late rather than lost


# ---- failures ------------------------------------------------------------------------------------------------

def test_a_raising_rank_stops_the_others_and_is_the_root_cause():
    ctl, cluster, clock, record = make(n_workers=3)
    cluster.end(1, "error", error=ValueError("bad batch"))
    ctl.step(0)
    assert cluster.aborted == ["job-1-0"]  # the others are stopped at once
    cluster.end(0, "aborted")
    cluster.end(2, "error", error=RuntimeError("Connection reset by peer"), secondary=True, t=0.5)
    run_until_ended(ctl)
    assert states(record) == ["RUNNING", "FAILED"]
    err = record.error
    assert type(err) is ValueError and "other ranks: rank 0 was stopped; rank 2 raised" in err.__notes__[0]


def test_a_removed_worker_fails_its_rank_and_its_task_is_forgotten():
    ctl, cluster, clock, record = make()
    lost = cluster.task(1).rank.address
    cluster.gone = [lost, "tcp://10.9.9.9:1"]  # a worker of no rank of this job is ignored
    ctl.step(0)
    assert cluster.futures[1].cancelled and cluster.aborted == ["job-1-0"]
    assert ctl.attempt.outcomes[1].status == Status.LOST
    cluster.end(0, "aborted")
    run_until_ended(ctl)
    assert isinstance(record.error, dask_ddp.WorkerLostError) and record.error.worker == lost


def test_a_silent_worker_counts_as_lost_after_the_worker_timeout():
    ctl, cluster, clock, record = make(n_workers=3, worker_timeout=6)
    alive, silent = [cluster.task(r).rank.address for r in (0, 2)], cluster.task(1).rank.address
    for _ in range(5):  # 10 s: two workers' heartbeats move, one worker's does not
        cluster.heartbeat(*alive)
        clock.t += 2
        ctl.step(0)
        if ctl.attempt.outcomes:
            break
    assert ctl.attempt.outcomes[1].status == Status.LOST and "no heartbeat for" in ctl.attempt.outcomes[1].message
    assert ctl.silence.silent.keys() == {silent}


def test_a_silent_free_worker_gets_no_work_until_its_heartbeat_moves_again():
    """A free worker on a host cut off is as silent as the ranks' own: no replacement, restart or growth may
    be planned on it (a live job's spare would never start there); it may again once it is heard."""
    ctl, cluster, clock, record = make(n_workers=4, workers=3, worker_timeout=6)
    ranks = [cluster.task(r).rank.address for r in range(3)]
    free = next(a for a in cluster.scheduler_workers if a not in ranks)
    for _ in range(5):
        cluster.heartbeat(*ranks)
        clock.t += 2
        ctl.step(0)
    assert not ctl.silence.heard(free) and all(ctl.silence.heard(a) for a in ranks)
    assert ctl.attempt.outcomes == {}  # no rank lost: the free worker is no rank's
    cluster.heartbeat(*ranks, free)
    clock.t += 2
    ctl.step(0)
    assert ctl.silence.heard(free)


def test_nobody_counts_as_silent_while_no_heartbeat_moves():
    ctl, cluster, clock, record = make(worker_timeout=6)
    for _ in range(10):  # a frozen scheduler (or client): no heartbeat moves at all
        clock.t += 2
        ctl.step(0)
    assert ctl.attempt.outcomes == {}


def test_a_stall_blames_the_rank_outside_a_collective():
    ctl, cluster, clock, record = make(stall_timeout=3)
    cluster.pending = [cluster.batch(0, 0, metric(0)), cluster.batch(1, 0, metric(0))]
    ctl.step(0)
    clock.t += 2
    cluster.pending = [cluster.batch(1, 1, metric(1))]  # rank 1 reported last ...
    ctl.step(0)
    cluster.stack_dumps = {0: 'File "/x/torch/distributed/distributed_c10d.py", in all_reduce',
                           1: 'File "/u/train.py", in train\n  time.sleep(600)'}  # ... but hangs outside
    clock.t += 1.5  # rank 0 is past the limit first
    ctl.step(0)
    assert cluster.aborted == ["job-1-0"]
    cluster.end(0, "aborted")
    cluster.end(1, "aborted")
    run_until_ended(ctl)
    err = record.error
    assert isinstance(err, dask_ddp.StallError) and err.rank == 1 and "not inside a collective" in str(err)


def test_the_stall_clock_starts_at_a_ranks_first_report():
    ctl, cluster, clock, record = make(stall_timeout=3)
    clock.t += 100  # a slow start: no report yet
    ctl.step(0)
    assert cluster.aborted == [] and ctl.attempt.stalled is None


def telemetry(step):
    return {"kind": "telemetry", "step": step, "time": 0.0}


def test_a_rank_that_never_reports_is_stalled_once_its_steps_stop():
    """No report() at all (a live job's loop, a plain DDP loop): the telemetry's step is its progress. The clock
    starts at its first step, runs on while the step moves, and a step that stays put (a rank hung in a live group
    that cannot form: session 11's hang) fails the job with the stall, not after ddp.timeout."""
    ctl, cluster, clock, record = make(stall_timeout=3)
    for k in range(5):  # steps made every 2 s: never a stall
        cluster.pending = [cluster.batch(0, k, telemetry(k)), cluster.batch(1, k, telemetry(k))]
        clock.t += 2
        ctl.step(0)
    assert cluster.aborted == []
    for k in range(5, 8):  # the step stays at 4 on both ranks while telemetry keeps coming
        cluster.pending = [cluster.batch(0, k, telemetry(4)), cluster.batch(1, k, telemetry(4))]
        clock.t += 1.1
        ctl.step(0)
    assert cluster.aborted == ["job-1-0"]
    cluster.end(0, "aborted")
    cluster.end(1, "aborted")
    run_until_ended(ctl)
    assert isinstance(record.error, dask_ddp.StallError), record.error


# ---- restarts ------------------------------------------------------------------------------------------------

def test_a_restart_runs_a_new_attempt_on_the_same_number_of_workers():
    cb = Recorder()
    ctl, cluster, clock, record = make(max_restarts=1, callbacks=(cb,))
    cluster.end(0, "died")
    cluster.end(1, "aborted")
    ctl.step(0)  # the attempt ended; the workers are there: the next attempt starts in the same step
    assert states(record) == ["RUNNING", "RESTARTING", "RUNNING"] and "rank 0 on tcp://10.0.0.1:4000 died; attempt 2/2" \
        in record.history[1][3]
    assert len(cluster.attempts) == 2 and cluster.task(0).attempt == 1 and cluster.task(0).spare_early is False
    assert cluster.attempts[0][0].spare_early is True  # a job that may restart keeps spares warm
    assert ctl.attempt.index == 1 and ctl.attempt.outcomes == {}
    cluster.end(0, "ok", value=1)
    cluster.end(1, "ok", value=2)
    run_until_ended(ctl)
    assert states(record) == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"] and record.values == [1, 2]
    assert [c[0] for c in cb.calls] == ["on_start", "on_restart", "on_finish"] and cb.calls[1] == ("on_restart", "JOB", 1)
    assert cluster.cleaned == ["job-1-0", "job-1-1"]


def test_a_restart_waits_for_workers_and_fails_when_none_come():
    ctl, cluster, clock, record = make(max_restarts=1, restart_wait=60)
    lost = cluster.task(1).rank.address
    cluster.gone = [lost]
    del cluster.scheduler_workers[lost]
    cluster.end(0, "aborted")
    ctl.step(0)
    ctl.step(0)
    assert ctl.phase == "waiting" and len(cluster.attempts) == 1  # 1 worker of the 2 needed
    clock.t += 61
    run_until_ended(ctl)
    assert record.state == "FAILED" and isinstance(record.error, dask_ddp.WorkerLostError)
    assert "no restart: 2 workers were not available within 60 s" in record.error.__notes__[-1]


def test_an_elastic_job_restarts_on_the_workers_left():
    ctl, cluster, clock, record = make(n_workers=3, workers=(2, None), max_restarts=1)
    assert ctl.attempt.plan.world_size == 3
    lost = cluster.task(2).rank.address
    cluster.gone = [lost]
    del cluster.scheduler_workers[lost]
    cluster.end(0, "aborted")
    cluster.end(1, "aborted")
    ctl.step(0)
    assert ctl.attempt.index == 1 and ctl.attempt.plan.world_size == 2 and lost not in ctl.attempt.plan.addresses


def test_an_elastic_job_with_a_checkpoint_folder_grows_once_a_usable_worker_joins(tmp_path):
    ctl, cluster, clock, record = make(n_workers=3, workers=(2, None), checkpoint_dir=str(tmp_path))
    assert ctl.attempt.plan.world_size == 3 and ctl.notices.active
    new = "tcp://10.0.0.4:4000"
    cluster.scheduler_workers[new] = {"host": "10.0.0.4", "name": "3", "status": "closing_gracefully"}
    ctl.step(0)
    assert cluster.notices == []  # no rank has reported yet
    cluster.pending.append(cluster.batch(0, 0, metric(1)))
    ctl.step(0)
    assert cluster.notices == []  # the new worker is closing: not one to grow on
    cluster.scheduler_workers[new]["status"] = "running"
    ctl.step(0)
    assert cluster.notices == []  # looked at again only GROW_EVERY s later
    clock.t += GROW_EVERY
    ctl.step(0)
    clock.t += GROW_EVERY
    ctl.step(0)
    assert cluster.notices == [("job-1-0", list(ctl.attempt.plan.addresses),
                                f"1 worker(s) joined ({new}): the job grows to 4 ranks", ctl.grace, "grow")]
    assert cluster.aborted == [] and record.state == "RUNNING"


def test_a_job_without_a_checkpoint_folder_does_not_grow():
    ctl, cluster, clock, record = make(n_workers=3, workers=(2, None))
    cluster.scheduler_workers["tcp://10.0.0.4:4000"] = {"host": "10.0.0.4", "name": "3"}
    cluster.pending.append(cluster.batch(0, 0, metric(1)))
    for _ in range(3):
        ctl.step(0)
        clock.t += GROW_EVERY
    assert not ctl.notices.active and cluster.notices == []


def test_stop_sends_one_stop_notice_then_cancels_the_ranks_that_did_not_stop_in_time():
    ctl, cluster, clock, record = make()
    ctl.stop("pruned", 5.0)
    ctl.stop("again", 50.0)  # the first stop counts
    ctl.step(0)
    assert cluster.notices == [("job-1-0", list(ctl.attempt.plan.addresses), "pruned", 5.0, "stop")]
    clock.t += 5
    ctl.step(0)
    assert cluster.aborted == [] and not ctl.cancel_requested
    clock.t += 1
    ctl.step(0)
    ctl.step(0)
    assert cluster.aborted == ["job-1-0"] and ctl.cancel_requested and len(cluster.notices) == 1
    cluster.end(0, "aborted")
    cluster.end(1, "aborted")
    run_until_ended(ctl)
    assert record.state == "CANCELLED"


# ---- cancelling and callbacks --------------------------------------------------------------------------------

def test_cancel_stops_every_rank_and_ends_cancelled():
    ctl, cluster, clock, record = make()
    ctl.cancel()
    assert cluster.aborted == ["job-1-0"]
    cluster.end(0, "aborted")
    cluster.end(1, "aborted")
    run_until_ended(ctl)
    assert record.state == "CANCELLED" and isinstance(record.error, dask_ddp.JobCancelledError)


def test_cancel_while_waiting_for_workers_to_restart_on():
    ctl, cluster, clock, record = make(max_restarts=3)
    cluster.scheduler_workers.clear()
    cluster.end(0, "died")
    cluster.end(1, "aborted")
    ctl.step(0)
    assert ctl.phase == "waiting"
    ctl.cancel()
    assert ctl.step(0) is True and record.state == "CANCELLED" and len(cluster.attempts) == 1


def test_a_broken_callback_is_disabled_and_changes_nothing():
    calls = []

    class Broken:
        def on_metrics(self, event):
            calls.append(event["step"])
            raise RuntimeError("sink full")

    plain = []
    ctl, cluster, clock, record = make(callbacks=(Broken(), plain.append))
    cluster.pending = [cluster.batch(0, 0, metric(0), metric(1), {"kind": "log", "line": "hi", "stream": "stdout"})]
    ctl.step(0)
    assert calls == [0] and [e.get("step", e.get("line")) for e in plain] == [0, 1, "hi"]
    cluster.end(0, "ok", value=0)
    cluster.end(1, "ok", value=1)
    run_until_ended(ctl)
    assert record.state == "FINISHED"


def test_a_bug_in_the_controller_still_stops_the_ranks_and_ends_the_job():
    ctl, cluster, clock, record = make()

    def broken(future, task):
        raise KeyError("a bug")

    cluster.outcome = broken
    ctl.run()
    assert record.state == "FAILED" and "job watcher failed" in str(record.error)
    assert cluster.aborted == ["job-1-0"] and cluster.closed


def test_a_client_closed_under_the_job_ends_it_with_client_closed_error_not_a_watcher_bug():
    """client.close() in the notebook mid-job: the controller's next call to the cluster fails. That is the user's
    own close, not a bug of dask-ddp's (before: "dask-ddp's job watcher failed: CommClosedError(...)")."""
    ctl, cluster, clock, record = make()

    def closed(future, task):
        raise OSError("Comm already closed")

    cluster.outcome, cluster.client_closed = closed, lambda: True
    ctl.run()
    assert record.state == "FAILED" and isinstance(record.error, dask_ddp.ClientClosedError), record.error
    assert "the Dask client closed while job job-1 ran" in str(record.error)
    assert cluster.aborted == ["job-1-0"] and cluster.closed


def test_a_task_that_dask_failed_is_an_error_outcome_of_its_rank():
    """DaskCluster.outcome turns a task Dask itself failed into an ERROR outcome (it never raises)."""
    from dask_ddp.client.cluster import DaskCluster

    class DoneFuture:
        def done(self):
            return True

        def result(self, timeout=None):
            raise OSError("the worker's comm broke")

    cluster = FakeCluster()
    ctl, *_ = make()
    task = ctl.attempt.tasks[1]
    got = DaskCluster.outcome(cluster, DoneFuture(), task)
    assert got.status == Status.ERROR and got.rank == 1
    assert isinstance(cloudpickle.loads(got.error), RankFailedError) and "comm broke" in got.message


@pytest.mark.parametrize("world", [1, 4])
def test_values_come_back_in_rank_order(world):
    ctl, cluster, clock, record = make(n_workers=world)
    for rank in reversed(range(world)):
        cluster.end(rank, "ok", value=f"v{rank}")
    run_until_ended(ctl)
    assert record.values == [f"v{r}" for r in range(world)]
