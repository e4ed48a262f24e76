"""The job's internal API for the layers above it (``client/dispatch.py``'s :func:`start`, :func:`make_spec`,
:func:`plan_ranks`, :func:`check_function`; ``wire/pickling.py``'s ``dumps_call`` and ``local_module``) and the
sweep names' scheduler-side calls, as the sweeps and the old package's front door use them.

A real LocalCluster of one worker process for what starts or plans a job; the sweep's driver is stepped against a
fake ``dispatch.start`` (as in ``tests/test_sweep_driver.py``) to see what it asks of the job: a detached sweep's
trials keep their results pickled, every sweep's trials start with the sweep's ``warm-cuda``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import dask
import pytest
from _cluster import local_client

from dask_ddp.client import dispatch
from dask_ddp.sweeps import names as sweep_names
from dask_ddp.wire import pickling
from dask_ddp.wire.errors import PlanError, SerializationError


@pytest.fixture(scope="module")
def client():
    with local_client(1) as c:
        yield c


def _touch(path: str) -> str:
    """What unpickling a :class:`Marker` runs: it leaves a file where that happened."""
    Path(path).write_text("unpickled here")
    return path


class Marker:
    """A rank's return value whose unpickling runs code (a file appears)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return _touch, (self.path,)


def returns_marker(path: str) -> Marker:
    return Marker(path)


def test_start_keeps_a_jobs_results_pickled_when_asked_and_run_does_not(client, tmp_path):
    """``start(pickled=True)`` (a detached sweep's trials): ``result()`` gives each rank's value as the bytes it
    sent, nothing of it unpickled here; ``run`` (``pickled`` left out) gives the value itself."""
    marker = tmp_path / "marker"
    job = dispatch.start(client, returns_marker, (str(marker),), {}, pickled=True, progress=False)
    [blob] = job.result(timeout=120)
    assert isinstance(blob, bytes) and not marker.exists()
    assert pickle.loads(blob) == str(marker) and marker.read_text() == "unpickled here"  # the value it was
    marker.unlink()
    assert dispatch.run(client, returns_marker, str(marker), progress=False).result(timeout=120) == [str(marker)]


def test_make_spec_takes_warm_cuda_over_the_config_and_the_config_when_none(client):
    def train():
        pass

    with dask.config.set({"ddp.warm-cuda": True}):
        assert dispatch.make_spec(client, train, (), {}).warm_cuda is True
        assert dispatch.make_spec(client, train, (), {}, warm_cuda=False).warm_cuda is False
    with dask.config.set({"ddp.warm-cuda": False}):
        assert dispatch.make_spec(client, train, (), {}, warm_cuda=True).warm_cuda is True
        spec = dispatch.make_spec(client, train, (1,), {"lr": 0.1}, name="api", max_restarts=2)
    assert (spec.warm_cuda, spec.max_restarts, spec.first_plan.world_size) == (False, 2, 1)
    assert spec.run_id.startswith("api-") and pickle.loads(spec.call)[1:] == ((1,), {"lr": 0.1})


def test_the_checks_the_sweep_makes_before_anything_ships(client):
    def gen():
        yield 1

    with pytest.raises(TypeError, match="generator function"):
        dispatch.check_function(gen)
    dispatch.check_function(print)
    assert dispatch.plan_ranks(client, None).world_size == 1
    with pytest.raises(PlanError):
        dispatch.plan_ranks(client, 2)
    with pytest.raises(SerializationError, match="keyword argument 'lock'"):
        pickling.dumps_call(print, (), {"lock": __import__("threading").Lock()})
    assert pickling.local_module(returns_marker) is sys.modules[__name__]  # a user's file: it ships by value
    assert pickling.local_module(dispatch.run) is None and pickling.local_module(pytest.fixture) is None


# ---- the sweep's driver: what it asks of the job ----------------------------------------------------------------
class _Loop:
    def add_callback(self, *args):
        pass


class _Client:
    status = "running"
    loop = _Loop()


class _Job:
    run_id, checkpoint_dir, state = "run-0", None, "RUNNING"


@pytest.mark.parametrize("detached", [False, True])
@pytest.mark.parametrize("warm_cuda", [False, True])
def test_a_sweeps_trials_start_with_its_warm_cuda_and_a_detached_ones_keep_results_pickled(monkeypatch, detached,
                                                                                           warm_cuda):
    optuna = pytest.importorskip("optuna")
    from dask_ddp.sweeps import driver as sweep_driver
    from dask_ddp.sweeps.detach import SchedulerDriver
    from dask_ddp.sweeps.trial import SweepSpec

    started = []
    monkeypatch.setattr(sweep_driver, "scheduler_workers", lambda client: {
        "tcp://10.0.0.1:4000": {"host": "10.0.0.1", "name": "0", "nthreads": 1, "status": "running"}})
    monkeypatch.setattr(sweep_driver.dispatch, "start", lambda *a, **kw: started.append(kw) or _Job())

    def train(x):
        pass

    spec = SweepSpec(name="api", fn=train, args=(), kwargs={}, fixed={}, ranks=lambda params: 1, metric="loss",
                     minimize=True, n_trials=1, max_concurrent=None, max_workers=None, workers=None,
                     max_failures=None, run_options={"max_restarts": 1}, warm_cuda=warm_cuda)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    driver = (SchedulerDriver if detached else sweep_driver.Driver)(_Client(), spec, study, space)
    driver.step()
    [kw] = started
    assert (kw["pickled"], kw["warm_cuda"], kw["max_restarts"], kw["workers"]) == (detached, warm_cuda, 1,
                                                                                   ["tcp://10.0.0.1:4000"])


# ---- a sweep's name, claimed on the scheduler ---------------------------------------------------------------------
class _Scheduler:
    def __init__(self, *clients):
        self.clients = dict.fromkeys(clients)


def test_a_sweep_name_is_claimed_and_released_on_the_scheduler_by_its_owner_only():
    name, scheduler = "api-names", _Scheduler("client-a", "client-b")
    try:
        assert sweep_names.scheduler_claim(name, "client-a", scheduler) is None
        assert "client client-a" in sweep_names.scheduler_claim(name, "client-b", scheduler)
        sweep_names.scheduler_release(name, "client-b")  # not its claim: nothing changes
        assert "this client's own" in sweep_names.scheduler_claim(name, "client-a", scheduler)
        sweep_names.scheduler_release(name, "client-a")
        assert sweep_names.scheduler_claim(name, sweep_names.DETACHED, scheduler) is None
        assert "a detached sweep" in sweep_names.scheduler_claim(name, "client-b", scheduler)
    finally:
        sweep_names.scheduler_release(name, "client-a")
        sweep_names.scheduler_release(name, sweep_names.DETACHED)
