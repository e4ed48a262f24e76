"""Preemption and growth on real clusters: a worker told to leave gives the job time to save; jobs grow.

Real parts throughout: LocalClusters of Nannies and ``dask worker`` processes started from the command
line (as in a pod), gloo process groups on loopback, checkpoints in real folders. The training function is
bitwise repeatable on CPU (fixed seeds, each step's data drawn from its step number), so a resumed run can be
compared with an uninterrupted one of the same world size.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from _cluster import CliWorkers, leftover_processes, local_client, no_running_ranks, run, wait_until

import dask_ddp
from dask_ddp.client import elastic
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.wire.notices import Notice, Stopped
from dask_ddp.wire.outcome import RankOutcome, Status


def train_steps(n_steps, pause=0.05, every=None, register=True, slow_save=0.0, fast_after=None, hold_from=None):
    """``n_steps`` DDP steps, resumable from any step; returns the final parameters, flattened.

    ``pause`` s after each step of the first attempt only: it paces the run up to a test's fault (a retirement,
    a signal, a worker that joins). From step ``hold_from`` on (the step a test waits for before its fault) the
    first attempt pauses 0.25 s a step, so that it cannot finish before a fault that a loaded machine delivers
    late (seen at load 20: a scale-down and a rank's SIGTERM that came after the job's last step). A restarted
    attempt, or any step once the file ``fast_after`` exists, runs back to back: what follows the fault proves
    nothing by its pace, and the values do not depend on it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start, step = 0, -1
    state = dask_ddp.load_checkpoint()
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1

    def snapshot():
        time.sleep(slow_save)
        return {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}

    if register:
        dask_ddp.on_preemption(snapshot)
    for step in range(start, n_steps):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if every and step % every == every - 1:
            dask_ddp.save_checkpoint({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                                     step=step)
        dask_ddp.report(step=step, loss=loss.item(), world=ctx.world_size, t=time.time())
        if not register and (p := dask_ddp.preempted()) is not None:  # right after the report of the agreed step
            dask_ddp.save_checkpoint(snapshot(), step=p.step)
            raise p
        if ctx.restart_count == 0 and not (fast_after and os.path.exists(fast_after)):
            time.sleep(max(pause, 0.25) if hold_from is not None and step >= hold_from else pause)
    return torch.cat([p.detach().flatten() for p in model.module.parameters()])


def states(job):
    return [h[2] for h in job.history]


def saved_restart(job, kind="preempted") -> str:
    """The cause of the job's one restart, checked: it went RUNNING, RESTARTING, RUNNING, FINISHED, for a
    ``kind`` ("preempted" or "grew") that lost no step."""
    assert states(job) == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
    cause = job.history[1][3]
    print("history:", cause)
    assert cause.startswith(f"{kind}:") and "0 steps lost" in cause, cause
    return cause


def steps_of(job, rank=0):
    m = job.metrics
    return sorted(m[m["rank"] == rank]["step"])


@pytest.mark.parametrize("register", [True, False])
@pytest.mark.slow
def test_retire_workers_saves_and_resumes_on_the_worker_left(tmp_path, register):
    """register: dask-ddp saves what on_preemption registered; else the code polls preempted() and saves."""
    with local_client(2) as c:
        job = run(c, train_steps, 60, checkpoint_dir=str(tmp_path), workers=(1, 2), register=register, hold_from=10)
        wait_until(lambda: len(job.metrics) >= 20, 120, what="20 reports")
        victim = job.plan.addresses[1]
        c.retire_workers([victim])
        values = job.result(timeout=180)
        assert victim in saved_restart(job)
        assert len(values) == 1 and victim not in job.plan.addresses
        assert steps_of(job, 0) == list(range(60)), "steps were lost or repeated"
        assert leftover_processes(c) == []


@pytest.fixture
def cli_cluster():
    """A scheduler (a LocalCluster without workers) and a :class:`CliWorkers` to start workers against it."""
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        workers = CliWorkers(cluster.scheduler_address)
        try:
            yield client, workers
        finally:
            workers.close()


_CLEAN = {}


def clean_run(client, folder):
    """The parameters of an uninterrupted ``train_steps(50)`` on 2 ranks: the reference both SIGTERM tests compare
    their resumed run with (bitwise repeatable, so computed once per module, on whichever 2-worker cluster asks
    first). No pause between its steps: nothing interrupts it, and the values do not depend on the pace."""
    if "50" not in _CLEAN:
        _CLEAN["50"] = run(client, train_steps, 50, pause=0.0, checkpoint_dir=str(folder)).result(timeout=300)
    return _CLEAN["50"]


def name_of(job, rank):
    return str(job.plan.ranks[rank].name)


@pytest.mark.slow
def test_sigterm_to_a_dask_worker_process_loses_no_step(cli_cluster, tmp_path):
    import torch

    client, workers = cli_cluster
    for name in ("a", "b"):
        workers.start(name)
    client.wait_for_workers(2, timeout=120)
    clean = clean_run(client, tmp_path / "clean")
    job = run(client, train_steps, 50, checkpoint_dir=str(tmp_path / "job"), hold_from=15)
    wait_until(lambda: len(job.metrics) >= 30, 120, what="15 steps")
    victim = workers.procs[name_of(job, 1)]
    t0 = time.time()
    victim.send_signal(signal.SIGTERM)  # what Kubernetes does to a pod's main process
    workers.start("c")  # the replacement
    resumed = job.result(timeout=300)
    assert victim.wait(60) is not None
    saved_restart(job)
    print(f"SIGTERM: restarted {job.history[2][0] - t0:.2f} s after the signal")
    assert all(torch.equal(a, b) for a, b in zip(clean, resumed)), "resumed training differs from the clean run"
    assert steps_of(job, 0) == list(range(50)) and steps_of(job, 1) == list(range(50))
    assert leftover_processes(client) == []


@pytest.mark.slow
def test_scale_down_saves_and_resumes_on_the_worker_left(tmp_path):
    with local_client(2) as c:
        job = run(c, train_steps, 60, checkpoint_dir=str(tmp_path), workers=(1, 2), hold_from=10)
        wait_until(lambda: len(job.metrics) >= 20, 120, what="20 reports")
        c.cluster.scale(1)
        values = job.result(timeout=180)
        saved_restart(job)
        assert len(values) == 1
        assert steps_of(job, 0) == list(range(60)), "steps were lost or repeated"
        # the resumed steps run without pauses: the job can end while the scaled-down worker still closes, and
        # leftover_processes' client.run would reach it (CommClosedError, seen once)
        wait_until(lambda: len(scheduler_workers(c)) == 1, 60, interval=0.1, what="the scaled-down worker gone")
        assert leftover_processes(c) == []


@pytest.mark.slow
def test_a_save_that_does_not_fit_falls_back_to_the_last_periodic_checkpoint(tmp_path):
    import dask

    with dask.config.set({"ddp.preemption.grace-period": 1.0}), local_client(2) as c:
        job = run(c, train_steps, 200, every=10, slow_save=4.0, checkpoint_dir=str(tmp_path), workers=(1, 2))
        wait_until(lambda: len(job.metrics) >= 2 * 24, 120, what="24 steps")
        c.retire_workers([job.plan.addresses[1]])
        job.result(timeout=180)
        assert states(job) == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
        cause = job.history[1][3]
        print("history:", cause)
        assert "was not committed within the 1 s grace period" in cause
        m = job.metrics
        resumed_at = int(m[m["attempt"] == 1]["step"].min())
        assert resumed_at % 10 == 0 and f"last periodic checkpoint (step {resumed_at - 1})" in cause
        top = int(m[m["attempt"] == 0]["step"].max())
        assert f"{top - resumed_at + 1} steps lost" in cause
        assert leftover_processes(c) == []


@pytest.mark.slow
def test_an_elastic_job_grows_when_a_worker_joins(tmp_path):
    with local_client(2) as c:
        job = run(c, train_steps, 400, checkpoint_dir=str(tmp_path), workers=(2, 3), hold_from=10)
        wait_until(lambda: len(job.metrics) >= 20, 120, what="20 reports")
        c.cluster.scale(3)
        wait_until(lambda: len(scheduler_workers(c)) == 3, 120, interval=0.1,
                   what="the third worker")
        joined = time.time()
        values = job.result(timeout=300)
        saved_restart(job, "grew")
        m = job.metrics
        first_wide = m[(m["attempt"] == 1)]["t"].min()
        took, saved = first_wide - joined, job.history[1][0] - joined
        print(f"growth: saved {saved:.1f} s and first step on 3 ranks {took:.1f} s after the worker joined")
        assert len(values) == 3 and took < 30
        assert steps_of(job, 0) == list(range(400)), "steps were lost or repeated"
        assert leftover_processes(c) == []


@pytest.mark.slow
def test_an_adaptive_cluster_closes_idle_workers_not_the_ranks(tmp_path):
    with local_client(4) as c:
        fast = tmp_path / "fast"
        job = run(c, train_steps, 200, checkpoint_dir=str(tmp_path), workers=2, fast_after=str(fast), hold_from=5)
        wait_until(lambda: len(job.metrics) >= 10, 120, what="10 reports")
        ranks = set(job.plan.addresses)
        c.cluster.adapt(minimum=2, maximum=4, interval="200ms", wait_count=2)
        wait_until(lambda: len(scheduler_workers(c)) == 2, 120, interval=0.2,
                   what="adapt() to close the idle workers")
        assert set(scheduler_workers(c)) == ranks
        fast.touch()  # the ranks were kept: the job's other steps, still under adapt(), run without pauses
        job.result(timeout=300)
        assert states(job) == ["RUNNING", "FINISHED"], job.history
        assert leftover_processes(c) == []


def _outcome(rank, status, stopped=None):
    return RankOutcome(rank, f"tcp://w{rank}", status, preempt=stopped)


def test_preemption_policy_from_outcomes():
    assert elastic.preemption([_outcome(0, Status.OK), _outcome(1, Status.OK)]) is None
    notice = Notice(2.0, "c", "tcp://w1")
    saved = Stopped(notice, step=7, saved=True, committed=True, heard=1.0, save_took=0.1, commit_time=1.5)
    p = elastic.preemption([_outcome(0, Status.PREEMPTED, saved), _outcome(1, Status.LOST)])
    assert p.safe and p.step == 7
    assert elastic.reason(p, 7, None, 25) == ("preempted: c; saved step 7 (the save took 0.10 s, notice to commit "
                                             "0.50 s); 0 steps lost")
    unsaved = elastic.preemption([_outcome(0, Status.ERROR, Stopped(notice)), _outcome(1, Status.ABORTED,
                                                                                      Stopped(notice))])
    assert not unsaved.safe and unsaved.step is None
    text = elastic.reason(unsaved, 12, 9, 1.0)
    assert "did not stop at an agreed step within the 1 s grace period" in text
    assert "last periodic checkpoint (step 9); 3 steps lost" in text
    assert "restarts from the start; 13 steps lost" in elastic.reason(unsaved, 12, None, 1.0)
    grew = elastic.preemption([_outcome(r, Status.PREEMPTED, replace(saved, notice=Notice(2.0, "c", "", "grow"),
                                                                     heard=1.0 + r)) for r in (0, 1)])
    assert elastic.reason(grew, 7, None, 25).startswith("grew: c; saved step 7")
    assert grew.heard == 1.0  # the first rank to hear it


def test_notices_cross_the_store_as_json_and_refuse_what_is_not_one():
    notice = Notice(123.5, "worker tcp://10.0.0.1:1 leaves: retire_workers", "tcp://10.0.0.1:1", "leave")
    assert Notice.from_json(notice.to_json()) == notice
    for bad in ("", "{}", "[1]", '{"deadline": "soon", "cause": "x"}', '{"deadline": 1, "cause": "x", "kind": "x"}'):
        with pytest.raises(ValueError):
            Notice.from_json(bad)
    with pytest.raises(ValueError, match="kind is one of"):
        Notice(1.0, "x", kind="boom")
    # frozen and pickled as values: what a supervisor sends and a rank's outcome carries
    stopped = Stopped(notice, step=3, saved=True, committed=True, phases=(("posted", 0.1),))
    assert pickle.loads(pickle.dumps(stopped)) == stopped
    with pytest.raises(AttributeError):
        stopped.step = 4


@pytest.mark.parametrize("bounds, world, idle, more", [((2, 3), 2, 1, 1), ((2, 3), 3, 2, 0), ((1, None), 2, 3, 3),
                                                       ((2, 4), 2, 0, 0), ((2, 4), 2, 5, 2)])
def test_grow_by(bounds, world, idle, more):
    assert elastic.grow_by(bounds, world, idle) == more


@pytest.fixture(scope="module")
def shared_pair():
    """A LocalCluster of 2 workers for the tests that leave it whole (a rank process killed, a forged notice):
    the worker processes stay, and :func:`whole_pair` checks that before each test."""
    with local_client(2) as c:
        yield c


def _whole(c, wait: float) -> bool:
    return (len(scheduler_workers(c)) == 2 and wait_until(lambda: no_running_ranks(c), wait, must=False)
            and leftover_processes(c, wait) == [])


@pytest.fixture
def whole_pair(shared_pair):
    """The shared 2-worker cluster, checked whole: its 2 workers, no rank running, no process left over. A test
    that failed and left it otherwise (it fails itself on its own leftovers) does not fail the next one: the
    workers are restarted (their ranks die with them) and the cluster is checked again."""
    shared_pair.wait_for_workers(2, timeout=60)
    if not _whole(shared_pair, 10):
        shared_pair.restart(timeout=120)
        shared_pair.wait_for_workers(2, timeout=60)
        assert _whole(shared_pair, 30), "the shared cluster is not whole after a restart of its workers"
    return shared_pair


@pytest.mark.slow
def test_sigterm_to_a_rank_process_takes_part_in_the_save(whole_pair, tmp_path):
    """The whole pod is signalled: a rank process that gets SIGTERM itself saves with the others."""
    import torch
    from _cluster import rank_process_pids

    c = whole_pair
    clean = clean_run(c, tmp_path / "clean")
    job = run(c, train_steps, 50, checkpoint_dir=str(tmp_path / "job"), hold_from=15)
    wait_until(lambda: len(job.metrics) >= 30, 120, what="15 steps")
    [pid] = rank_process_pids(c)[job.plan.addresses[1]]["running"]
    os.kill(pid, signal.SIGTERM)
    resumed = job.result(timeout=300)
    cause = saved_restart(job)
    assert "rank 1's process" in cause and "received SIGTERM" in cause
    assert all(torch.equal(a, b) for a, b in zip(clean, resumed)), "resumed training differs from the clean run"
    assert leftover_processes(c) == []


WATCHER_SCRIPT = """
import signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from dask_ddp.rank import preemption
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
preemption.start(store, "127.0.0.1", store.port, 0, 1, lambda message: None, 1.0)
time.sleep(0.3)
if sys.argv[1] == "release":
    preemption.release(store, 0, 1)
print("watcher alive:", preemption._WATCHER.is_alive(), flush=True)
del store  # rank 0's store closes, as when its process ends
time.sleep(0.5)
"""


@pytest.mark.parametrize("release", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_finished_job_lets_its_notice_watchers_go_before_the_store_closes(release):
    """Every rank's notice watcher blocks in a store wait; a store closed under it made torch print a warning
    with a C++ stack trace into the rank's output (seen at the end of 8-rank jobs). release() wakes it first."""
    out = subprocess.run([sys.executable, "-c", WATCHER_SCRIPT, "release" if release else "no"],
                         capture_output=True, text=True, timeout=120)
    print(out.stdout, out.stderr)
    if release:
        assert "watcher alive: False" in out.stdout and "recvValueWithTimeout" not in out.stderr
    else:  # the control: without release() the watcher still waits when the store closes (in a store wait it
        # printed the warning then; in the queue wait of signed notices, tests/test_notice_trust.py, it ends quietly)
        assert "watcher alive: True" in out.stdout and "recvValueWithTimeout" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.5, 2.0])
def test_closing_a_cluster_while_a_killed_worker_restarts_takes_no_connect_timeout(delay):
    """A worker process killed (SIGKILL), the cluster closed ``delay`` s later, while its Nanny notices or starts
    the new one: the Nanny's drain must not try to reach the dead worker's address, which distributed retries for
    ``distributed.comm.timeouts.connect`` (30 s) on every close (measured: 30.6 s before the fix)."""
    from dask_ddp.worker import leaving

    with local_client(2) as client:
        leaving.register(client)
        os.kill(next(iter(client.run(os.getpid).values())), signal.SIGKILL)
        time.sleep(delay)
        t0 = time.monotonic()
        client.cluster.close()
        took = time.monotonic() - t0
    print(f"closed {delay} s after the kill: {took:.1f} s")
    assert took < 15, f"closing took {took:.1f} s"


def train_without_reports(epochs, step_time):
    """DDP training that never calls report(), saves a checkpoint every epoch (5 steps) and resumes from the
    newest; returns (world size, restart count, first epoch run)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = dask_ddp.load_checkpoint()
    start = 0 if state is None else state["epoch"] + 1
    if state is not None:
        model.module.load_state_dict(state["model"])
    for epoch in range(start, epochs):
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
            time.sleep(step_time)
        dask_ddp.save_checkpoint({"model": model.module.state_dict(), "epoch": epoch}, step=epoch, keep=2)
    return ctx.world_size, ctx.restart_count, start


@pytest.mark.slow
def test_retiring_the_worker_of_code_that_registered_no_save_is_a_preemption(tmp_path):
    """Code that neither registers on_preemption nor polls preempted() (nor reports): a retirement is still a
    preemption (not counted against max_restarts=0, not named a crash); its worker is held for the grace period,
    in which a periodic checkpoint can land, and the job resumes from the newest one."""
    import dask

    from dask_ddp.checkpoint import list_checkpoints

    grace = 4.0
    with dask.config.set({"ddp.preemption.grace-period": grace}), local_client(2) as c:
        job = run(c, train_without_reports, 10, 0.2, workers=(1, 2), max_restarts=0, checkpoint_dir=str(tmp_path))
        wait_until(lambda: job.checkpoint_dir and list_checkpoints(job.checkpoint_dir), 240,
                   what="a periodic checkpoint")
        victim = job.plan.addresses[1]
        t0 = time.time()
        c.retire_workers([victim])
        out = job.result(timeout=240)
        held = job.history[1][0] - t0  # the job restarts once the retired worker let its rank go
        print(f"the retired worker was held {held:.1f} s (grace {grace} s); history: {job.history[1][3]}")
        assert states(job) == ["RUNNING", "RESTARTING", "RUNNING", "FINISHED"], job.history
        cause = job.history[1][3]
        assert cause.startswith(f"preempted: worker {victim} "), cause
        assert "lost its worker" not in cause and "attempt 2/" not in cause, cause
        assert "resuming from the last periodic checkpoint (step" in cause, cause
        assert held >= grace - 1.0, f"the worker was let go after {held:.1f} s, before the {grace} s grace period"
        assert out == [(1, 1, out[0][2])] and out[0][2] >= 1, out  # 1 rank, the 2nd attempt, from a checkpoint
        assert leftover_processes(c) == []


def train_until_stopped(marker, port_file=None):
    """Registers a save, then trains without reporting (so a notice never reaches an agreed step) until it is
    stopped; rank 0 writes the store's port to ``port_file`` and touches ``marker`` once it runs."""
    import pathlib

    dask_ddp.on_preemption(lambda: {})
    ctx = dask_ddp.get_context()
    if ctx.rank == 0:
        if port_file:
            pathlib.Path(port_file).write_text(f"{ctx.master_addr} {ctx.master_port}")
        pathlib.Path(marker).touch()
    while True:
        time.sleep(0.05)


def train_reporting(steps, port_file):
    ctx = dask_ddp.get_context()
    if ctx.rank == 0:
        import pathlib

        pathlib.Path(port_file).write_text(f"{ctx.master_addr} {ctx.master_port}")
    dask_ddp.on_preemption(lambda: {"step": 0})
    for step in range(steps):
        dask_ddp.report(step=step)
        time.sleep(0.05)
    return ctx.restart_count


@pytest.mark.slow
def test_a_notice_forged_through_the_store_does_nothing(whole_pair, tmp_path):
    """Anyone who reaches a rank's store could write dask-ddp's notice key and force restarts of a job with
    max_restarts=0 (seen: 3). Here the keys are guessed; tests/test_notice_trust.py lists them (the attempt's
    prefix is no secret) and shows that only values signed with the attempt's key count."""
    from datetime import timedelta

    import torch.distributed as dist

    port_file = tmp_path / "port"
    c = whole_pair
    job = run(c, train_reporting, 120, str(port_file), max_restarts=0)
    wait_until(lambda: port_file.exists() and len(job.metrics) >= 10, 120, what="the job running")
    host, port = port_file.read_text().split()
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    forged = Notice(time.time() + 3600, "forged", "", "leave").to_json()
    for key in ("dask_ddp/pre/notice", "dask_ddp//pre/notice", "pre/notice"):
        store.set(key, forged)
    del store
    assert job.result(timeout=180) == [0, 0]
    assert states(job) == ["RUNNING", "FINISHED"], job.history
    assert leftover_processes(c) == []


@pytest.mark.slow
def test_cancel_wins_over_a_notice_and_its_far_deadline_is_clamped(tmp_path):
    """A notice whose ranks save holds the job's abort until its deadline; cancel() must not wait for it, and a
    deadline past the grace period is cut to it (seen: a far deadline kept the job training)."""
    import dask

    from dask_ddp.rank import preemption

    marker = tmp_path / "running"
    with dask.config.set({"ddp.preemption.grace-period": 60.0}), local_client(2) as c:
        job = run(c, train_until_stopped, str(marker))
        wait_until(marker.exists, 120, what="the ranks running")
        # a notice with a deadline an hour away, as a forged or stale one would carry, from inside the job
        noticed = c.run(_notice_all, time.time() + 3600)
        assert sorted(r for ranks in noticed.values() for r in ranks) == [0, 1], noticed
        time.sleep(1.0)  # the ranks have heard it: the job's abort now waits for them
        t0 = time.monotonic()
        job.cancel()
        with pytest.raises(dask_ddp.JobCancelledError):
            job.result(timeout=120)
        took = time.monotonic() - t0
        print(f"cancel() during a notice with a far deadline: CANCELLED after {took:.2f} s")
        assert took < 15, f"cancel() waited {took:.1f} s for a notice (grace period 60 s)"
        assert leftover_processes(c) == []
    assert preemption._clamped(Notice(time.time() + 3600, "x"), 25).deadline <= time.time() + 25


def _notice_all(deadline, dask_worker=None):
    """On a worker: give each of its running ranks a notice (as a leaving worker does)."""
    host = dask_worker.plugins.get("dask-ddp")
    sups = host.running() if host is not None else []
    for sup in sups:
        sup.notice(Notice(deadline, "a notice with a far deadline", "", "grow"))
    return [s.rank for s in sups]


def test_preemption_restarts_are_capped():
    assert elastic.over_cap(99, 100, "job-1") is None
    err = elastic.over_cap(100, 100, "job-1")
    assert isinstance(err, dask_ddp.DaskDDPError) and "preempted 100 times" in str(err)
    assert "ddp.preemption.max-restarts (100)" in str(err)
