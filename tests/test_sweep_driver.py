"""The sweep's driver stepped one iteration at a time against a fake cluster and a fake clock: no Dask, no processes.

As ``tests/test_controller.py`` does for the job controller: the fake client answers the scheduler's workers, the
fake ``dispatch.start`` records each trial's job (its workers, its name, ``resume_from``) and the test decides when a
trial's job reports and ends, by posting to the driver's inbox what the job's callbacks would post
(:class:`~dask_ddp.sweeps.trial.TrialHooks`). The study is a real Optuna study in memory; the trials' queue is the
driver's :class:`~dask_ddp.sweeps.queue.TrialQueue`.
"""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from dask_ddp.sweeps import driver as sweep_driver  # noqa: E402
from dask_ddp.sweeps.driver import Driver  # noqa: E402
from dask_ddp.sweeps.trial import SweepSpec  # noqa: E402

State = optuna.trial.TrialState
SPACE = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def monotonic(self):
        return self.t

    def time(self):
        return self.t


class Loop:
    def add_callback(self, *args):  # the dashboard's messages: dropped
        pass


class FakeClient:
    status = "running"
    loop = Loop()


class FakeJob:
    def __init__(self, number, kwargs):
        self.number, self.kwargs = number, kwargs
        self.run_id, self.checkpoint_dir = f"run-{number}", f"memory://ckpt/run-{number}"
        self.state, self.stopped_step, self.cancelled = "RUNNING", None, False

    def result(self, timeout=None, progress=True):
        if self.state != "FINISHED":
            raise RuntimeError(f"job {self.run_id} {self.state}")

    def cancel(self, timeout=None):
        self.cancelled = True


class Cluster:
    """The workers the scheduler lists and the jobs the driver started, in order."""

    def __init__(self, n_workers):
        self.workers = {f"tcp://10.0.0.{i + 1}:4000": {"host": f"10.0.0.{i + 1}", "name": str(i), "nthreads": 1,
                                                        "status": "running"} for i in range(n_workers)}
        self.jobs: list[FakeJob] = []

    def start(self, client, fn, args, kwargs, *, workers, name, callbacks, progress, **options):
        job = FakeJob(int(name.rpartition("trial")[2]), {**kwargs, **options, "workers": workers})
        self.jobs.append(job)
        return job


@pytest.fixture
def cluster(monkeypatch):
    cluster = Cluster(2)
    clock = Clock()
    monkeypatch.setattr(sweep_driver, "scheduler_workers", lambda client: cluster.workers)
    monkeypatch.setattr(sweep_driver.dispatch, "start", cluster.start)
    monkeypatch.setattr(sweep_driver, "time", clock)
    cluster.clock = clock
    return cluster


def make_driver(n_trials, ranks=lambda params: 1, **kw):
    def train(x, resume_from=None):
        pass

    spec = SweepSpec(name="fake", fn=train, args=(), kwargs={}, fixed={}, ranks=ranks, metric="loss", minimize=True,
                     n_trials=n_trials, max_concurrent=None, max_workers=None, workers=None, max_failures=None,
                     run_options={}, resume_arg=True, **kw)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    return Driver(FakeClient(), spec, study, SPACE)


def finish(driver, job, loss):
    """What a trial's job posts: rank 0's report of the metric, then its end."""
    job.state = "FINISHED"
    driver.inbox.put(("metric", job.number, {"rank": 0, "step": 1, "loss": loss, "time": 0.0}))
    driver.inbox.put(("end", job.number, job))


def states(driver):
    return {t.number: t.state for t in driver.study.get_trials(deepcopy=False)}


def test_trials_fill_the_free_workers_and_each_end_is_told(cluster):
    driver = make_driver(n_trials=3)
    assert driver.step(wait=0) is False
    assert [j.number for j in cluster.jobs] == [0, 1]  # one rank each, one a worker
    assert sorted(w for j in cluster.jobs for w in j.kwargs["workers"]) == sorted(cluster.workers)
    assert driver.queue.waiting() == [2]  # asked ahead of a free slot
    assert driver.step(wait=0) is False and len(cluster.jobs) == 2  # no free worker: it waits
    finish(driver, cluster.jobs[0], 0.5)
    assert driver.step(wait=0) is False
    assert [j.number for j in cluster.jobs] == [0, 1, 2]
    assert cluster.jobs[2].kwargs["workers"] == cluster.jobs[0].kwargs["workers"]  # the freed worker
    finish(driver, cluster.jobs[1], 0.25)
    finish(driver, cluster.jobs[2], 0.75)
    assert driver.step(wait=0) is True
    assert (driver.state, driver.cause) == ("FINISHED", "all 3 trials ended")
    assert states(driver) == {0: State.COMPLETE, 1: State.COMPLETE, 2: State.COMPLETE}
    assert [driver.trials[n].value for n in range(3)] == [0.5, 0.25, 0.75]
    assert driver.queue.untold() == [] and driver.queue.waiting() == []


def test_a_resumed_trial_starts_next_from_the_checkpoint_and_does_not_count(cluster):
    cluster.workers.pop(sorted(cluster.workers)[1])  # one worker
    driver = make_driver(n_trials=2)
    driver.step(wait=0)
    assert [j.number for j in cluster.jobs] == [0] and driver.queue.waiting() == [1]
    finish(driver, cluster.jobs[0], 0.5)
    driver.resume(0, None, {"x": 0.125})
    driver.step(wait=0)
    assert [j.number for j in cluster.jobs] == [0, 2]  # ahead of trial 1, which waited
    resumed = driver.trials[2]
    assert (resumed.resumed_from, resumed.params["x"]) == (0, 0.125)
    assert cluster.jobs[1].kwargs["resume_from"] == "memory://ckpt/run-0"
    assert driver.queue.asked == 2 and driver.queue.waiting() == [1]
    finish(driver, cluster.jobs[1], 0.1)
    driver.step(wait=0)
    finish(driver, cluster.jobs[2], 0.2)
    assert driver.step(wait=0) is True
    assert driver.cause == "all 2 trials ended"  # the resumed trial is not counted against n_trials
    assert states(driver) == {0: State.COMPLETE, 1: State.COMPLETE, 2: State.COMPLETE}


def test_stop_cancels_the_line_and_the_running_trials(cluster):
    driver = make_driver(n_trials=4, ranks=lambda params: 2)  # one trial at a time on two workers
    driver.step(wait=0)
    assert [j.number for j in cluster.jobs] == [0] and driver.queue.waiting() == [1, 2]
    driver.stop("CANCELLED", "sweep.cancel() was called")
    assert driver.step(wait=0) is False  # stopping: the running trial's ranks have not stopped yet
    assert cluster.jobs[0].cancelled and driver.queue.waiting() == []
    assert [driver.trials[n].state for n in (1, 2)] == ["CANCELLED", "CANCELLED"]
    assert driver.trials[1].error == "never started: sweep.cancel() was called"
    cluster.jobs[0].state = "CANCELLED"
    driver.inbox.put(("end", 0, cluster.jobs[0]))
    assert driver.step(wait=0) is True
    assert (driver.state, driver.trials[0].state) == ("CANCELLED", "CANCELLED")
    assert states(driver) == {0: State.FAIL, 1: State.FAIL, 2: State.FAIL}
    assert driver.queue.untold() == []


def test_a_trial_too_big_for_the_cluster_fails_naming_the_room_and_the_sweep_goes_on(cluster):
    driver = make_driver(n_trials=2, ranks=lambda params: 3 if params["x"] > 0.5 else 1)
    sizes = {}
    for _ in range(4):
        driver.step(wait=0)
        for job in cluster.jobs:
            if job.state == "RUNNING":
                finish(driver, job, 0.5)
        sizes = {n: r.ranks for n, r in driver.trials.items()}
        if driver.state != "RUNNING":
            break
    big = [n for n, size in sizes.items() if size == 3]
    assert big and len(sizes) == 2, sizes  # the seed gives one trial of each size
    for n in big:
        assert driver.trials[n].state == "FAILED"
        assert "needs 3 ranks, but the sweep may use only 2 workers now" in driver.trials[n].error
    assert all(driver.trials[n].state == "COMPLETE" for n in sizes if n not in big)
    assert driver.failures == len(big)
