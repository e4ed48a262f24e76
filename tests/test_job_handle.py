"""One job handle for a local, a detached and an attached job: every property reads the same on each.

On a real LocalCluster (the module's ``client`` fixture): a local job's handle drives its controller in a
watcher thread here; a detached job's controller runs in the scheduler's process and ``run(..., detach=True)``
and ``attach`` give handles that follow it. Every detached job a test starts is cancelled at its end, whatever
happened (the ``detached`` fixture), so a failing test never leaves ranks running.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid

import cloudpickle
import dask
import pytest
from _cluster import no_running_ranks, run, wait_until

import dask_ddp
from dask_ddp.client import detach
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.wire.plan import make_plan, workers_from_scheduler_info
from dask_ddp.wire.spec import LaunchSpec

STEPS = 8


def steps(n):
    ctx = dask_ddp.get_context()
    for i in range(n):
        dask_ddp.report(i=float(i))
    print(f"rank {ctx.rank} done", flush=True)
    return ctx.rank


def forever():
    dask_ddp.report(started=1.0)
    while True:
        time.sleep(0.05)


def _name(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def detached(client):
    """``start(fn, *args, **kw)``: ``run(client, fn, ..., detach=True)``; every job started is cancelled (through
    the driver, not the handle under test) and its ranks waited for when the test ends."""
    run_ids: list[str] = []

    def start(fn, *args, **kwargs):
        job = run(client, fn, *args, detach=True, **kwargs)
        run_ids.append(job.run_id)
        return job

    yield start
    for run_id in run_ids:
        client.run_on_scheduler(detach._cancel, run_id)
    wait_until(lambda: no_running_ranks(client), 60, what="every rank of the test's detached jobs stopped")


def _handle(kind: str, client, detached, **kwargs):
    """A job of ``steps(STEPS)`` and the handle of kind ``kind`` on it."""
    if kind == "local":
        return run(client, steps, STEPS, **kwargs)
    job = detached(steps, STEPS, **kwargs)
    return job if kind == "detached" else dask_ddp.attach(client, job.run_id, progress=False)


@pytest.mark.parametrize("with_dir", [True, False], ids=["checkpoint_dir", "no-checkpoint_dir"])
def test_a_detached_and_an_attached_job_give_the_jobs_own_checkpoint_dir(client, detached, tmp_path, with_dir):
    where = str(tmp_path / "ckpt") if with_dir else None
    job = detached(steps, STEPS, name=_name("ckpt"), checkpoint_dir=where)
    expected = f"{where}/{job.run_id}" if with_dir else None
    assert job.checkpoint_dir == expected
    assert dask_ddp.attach(client, job.run_id, progress=False).checkpoint_dir == expected  # by run id
    assert dask_ddp.attach(client, job.name, progress=False).checkpoint_dir == expected  # by name
    assert job.result(timeout=120) == [0, 1]


def test_an_attached_handle_agrees_with_the_detached_one(client, detached):
    job = detached(steps, STEPS, name=_name("agree"))
    attached = dask_ddp.attach(client, job.name, progress=False)
    assert attached.result(timeout=120) == job.result(timeout=120) == [0, 1]
    assert (attached.name, attached.run_id, attached.state) == (job.name, job.run_id, "FINISHED") == \
        (job.name, job.run_id, job.state)
    assert attached.history == job.history and [new for _, _, new, _ in job.history][-1] == "FINISHED"
    assert attached.logs == job.logs and len(attached.metrics) == len(job.metrics) == 2 * STEPS
    assert attached.spec == job.spec  # the LaunchSpec itself crossed (the driver's echo_logs aside)
    assert attached.checkpoint_dir == job.checkpoint_dir is None


@pytest.mark.parametrize("kind", ["local", "detached", "attached"])
def test_every_property_works_the_same_on_a_local_a_detached_and_an_attached_job(client, detached, tmp_path, kind):
    import matplotlib

    matplotlib.use("Agg")
    job = _handle(kind, client, detached, name=_name(kind), checkpoint_dir=str(tmp_path))
    assert isinstance(job, dask_ddp.Job) and job.name.startswith(kind) and job.run_id.startswith(kind)
    assert isinstance(job.spec, LaunchSpec) and job.spec.run_id == job.run_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.spec.name = "other"
    assert job.checkpoint_dir == f"{tmp_path}/{job.run_id}"
    assert job.state in ("PENDING", "RUNNING", "FINISHED") and isinstance(job.history, list)
    assert job.wait(timeout=120) is True and job.done()
    assert job.result() == [0, 1] and job.state == "FINISHED"
    assert [new for _, old, new, _ in job.history if old != new][-2:] == ["RUNNING", "FINISHED"]
    assert list(job.goodput.index) == ["job", 0, 1] and job.goodput.loc[0, "productive_s"] > 0
    metrics = job.metrics
    assert len(metrics) == 2 * STEPS and list(metrics.columns[:5]) == ["rank", "attempt", "step", "time", "elapsed"]
    assert sorted(metrics["i"].unique()) == [float(i) for i in range(STEPS)]
    assert any(line.endswith("rank 1 done") for line in job.logs)
    assert len(job.events) == len(list(job.stream(timeout=10))) >= 2 * STEPS + 2
    assert job.plan.world_size == 2 and isinstance(job.futures, list)
    assert (job.attempt is None) == (kind != "local") and len(job.futures) == (2 if kind == "local" else 0)
    assert job.plot("i") is not None
    assert job.run_id in job._repr_html_() and f"{job.run_id} FINISHED ranks=2" in repr(job)
    job.cancel()  # an ended job: nothing to do
    assert job.state == "FINISHED"


def test_a_detached_job_cancelled_while_its_driver_starts_is_cancelled(client, detached):
    """cancel() right after run(): the driver in the scheduler's process is most likely still connecting its
    client; the cancel is kept and applied once the job has started, never dropped."""
    job = detached(forever, name=_name("early"))
    job.cancel(timeout=90)
    assert job.state == "CANCELLED", job.history
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result(timeout=10)
    wait_until(lambda: no_running_ranks(client), 60, what="every rank stopped")


def test_a_driver_that_cannot_start_is_a_failed_job_to_find(client):
    """A driver whose client cannot reach the scheduler: the scheduler's registry holds a FAILED job with the
    error as its outcome (called in this process, as the scheduler would)."""
    plan = make_plan(workers_from_scheduler_info({"workers": scheduler_workers(client)}))
    spec = LaunchSpec(call=b"", fn_name="train", run_id=_name("unreachable"), first_plan=plan, name="unreachable")
    with socket.socket() as held, dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        held.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused and the driver's client gives up
        address = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        try:
            scheduler = type("S", (), {"address": address, "security": None})()
            detach._start(cloudpickle.dumps(spec), dask_scheduler=scheduler)
            snap = wait_until(lambda: (s := detach._snapshot(spec.run_id, 0)) and s["settled"] and s, 30,
                              what="the driver's failure")
            assert [f["state"] for f in detach._find(spec.run_id)] == ["FAILED"]
            error, values = cloudpickle.loads(snap["outcome"])
            assert isinstance(error, Exception) and values is None and snap["state"] == "FAILED"
            assert "could not run the job" in snap["history"][-1][3]
            detach._cancel(spec.run_id)  # an ended job: nothing to cancel, and no error
        finally:
            with detach._LOCK:
                detach._DRIVERS.pop(spec.run_id, None)


def test_the_job_shows_its_state_ranks_workers_progress_and_its_dashboard_page(client):
    job = run(client, steps, 5, total=5)
    assert job.result(timeout=120) is not None
    text = repr(job)
    assert text.startswith(f"<dask_ddp.Job {job.run_id} FINISHED ranks=2 workers=2") and "step 5 of 5" in text
    page = job._repr_html_()
    assert "FINISHED" in page and "2 ranks on 2 workers (1 hosts)" in page and "step 5 of 5" in page
    link = client.dashboard_link.rsplit("/", 1)[0] + "/ddp"
    assert f'href="{link}"' in page
