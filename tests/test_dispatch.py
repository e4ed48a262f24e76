"""The launcher on a real LocalCluster with worker processes and gloo process groups."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import pytest
from _cluster import (
    leftover_processes,
    local_client,
    no_running_ranks,
    rank_process_pids,
    run,
    wait_until,
)
from dask.distributed import Client, LocalCluster

import dask_ddp
from dask_ddp import dispatch
from dask_ddp.client.cluster import scheduler_workers

TORCHRUN_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"]


# ---- functions run on the ranks (module level or local: both ship by value) -------------------------------

def train_ddp(steps, lr=0.1, seed=0):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x = torch.randn(16, 8)  # different data per rank (seed + rank)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dask_ddp.report(loss=loss, step=step)
    return ctx.rank, torch.cat([p.detach().flatten() for p in model.parameters()])


def env_and_context():
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    return {"env": {k: os.environ.get(k) for k in TORCHRUN_VARS}, "rank": ctx.rank, "local_rank": ctx.local_rank,
            "world_size": ctx.world_size, "node_rank": ctx.node_rank, "device": str(ctx.device),
            "backend": dist.get_backend(), "pg_rank": dist.get_rank(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "worker": ctx.worker, "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_")}


@pytest.mark.slow
def test_ddp_parameters_identical_after_training(client):
    job = run(client, train_ddp, 5, lr=0.05)
    values = job.result(timeout=120)
    assert [v[0] for v in values] == [0, 1]
    p0, p1 = values[0][1], values[1][1]
    assert p0.numel() == 8 * 16 + 16 + 16 + 1
    assert (p0 == p1).all(), "DDP must keep the ranks' parameters identical"
    m = job.metrics
    assert sorted(m["rank"].unique()) == [0, 1] and len(m) == 10 and m["loss"].dtype == float
    assert job.state == "FINISHED"
    assert leftover_processes(client) == []


def test_torchrun_env_and_context(client):
    job = run(client, env_and_context)
    out = job.result(timeout=120)
    addrs = job.plan.addresses
    port = out[0]["env"]["MASTER_PORT"]
    for r, got in enumerate(out):
        env = got["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(r)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_RANK"] == str(r) and env["ROLE_WORLD_SIZE"] == "2" and env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port and int(port) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == job.run_id
        assert got["rank"] == got["pg_rank"] == r and got["backend"] == "gloo" and got["device"] == "cpu"
        assert got["worker"] == addrs[r]
        assert got["malloc_trim"] is None, "the Nanny's MALLOC_TRIM_THRESHOLD_ slows training; not for ranks"
    leaked = client.run(lambda: [k for k in TORCHRUN_VARS if k in os.environ])
    assert all(v == [] for v in leaked.values()), f"env leaked into the Dask workers: {leaked}"


@pytest.mark.slow
def test_twenty_jobs_in_a_row_no_cache_no_port_left(client):
    def tiny(i):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(i)])
        dist.all_reduce(t)
        return t.item(), int(os.environ["MASTER_PORT"])

    errors = _Records()
    logging.getLogger("distributed").addHandler(errors)  # the scheduler runs in this process
    try:
        ports = []
        for i in range(20):
            values = run(client, tiny, 1).result(timeout=120)  # same function, same argument every time
            assert [v[0] for v in values] == [2.0, 2.0]
            ports.append(values[0][1])
    finally:
        logging.getLogger("distributed").removeHandler(errors)
    assert errors.records == [], "the rendezvous must not make the scheduler log errors"
    for port in set(ports):
        with socket.socket() as s:  # nothing listens any more: a connect is refused
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still bound"
    assert leftover_processes(client) == []


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(self.format(record))


@pytest.mark.slow
def test_helpers_rank_zero_first_seed_all_reduce(client):
    def helpers(path):
        import random

        ctx = dask_ddp.get_context()
        with dask_ddp.rank_zero_first():
            if ctx.rank == 0:
                time.sleep(0.5)
                with open(path, "w") as f:
                    f.write("ready")
            seen = open(path).read()  # rank 1 only gets here after rank 0 wrote it
        seed = dask_ddp.seed_everything(7)
        return seen, seed, random.random(), dask_ddp.all_reduce_mean(float(ctx.rank + 1))

    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "flag")
    out = run(client, helpers, path).result(timeout=120)
    assert [o[0] for o in out] == ["ready", "ready"]
    assert [o[1] for o in out] == [7, 8] and out[0][2] != out[1][2]
    assert [o[3] for o in out] == [1.5, 1.5]


def test_dataloader_with_workers_inside_a_rank(client):
    def load():
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        data = TensorDataset(torch.arange(40.0))
        loader = DataLoader(data, batch_size=10, num_workers=2)  # default daemonic Dask workers, no config
        return sum(float(b[0].sum()) for b in loader)

    assert run(client, load).result(timeout=120) == [780.0, 780.0]
    assert leftover_processes(client) == []


@pytest.mark.parametrize("failing", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_raising_rank_stops_the_others_fast(client, failing):
    def fail_one(bad):
        import torch
        import torch.distributed as dist

        ctx = dask_ddp.get_context()
        dist.barrier()
        if ctx.rank == bad:
            dask_ddp.report(raised_at=time.time())
            raise ValueError(f"bad batch on rank {bad}")
        while True:  # the survivor is busy in collectives with nobody to answer
            dist.all_reduce(torch.ones(1))
            time.sleep(0.01)

    job = run(client, fail_one, failing)
    with pytest.raises(ValueError, match=f"bad batch on rank {failing}") as info:
        job.result(timeout=120)
    stopped_at = job.history[-1][0]
    raised_at = job.metrics["raised_at"].dropna().iloc[0]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"rank {failing}" in notes and job.plan.addresses[failing] in notes
    assert "other ranks: rank" in notes
    tb = "".join(__import__("traceback").format_tb(info.value.__traceback__))
    assert "fail_one" in tb, "the rank's own traceback must travel with the error"
    assert stopped_at - raised_at < 5.0, f"ranks stopped {stopped_at - raised_at:.2f} s after the raise"
    print(f"all ranks stopped {stopped_at - raised_at:.2f} s after rank {failing} raised")
    assert job.state == "FAILED"
    assert leftover_processes(client) == []
    assert run(client, lambda: 1).result(timeout=120) == [1, 1]  # the cluster stays usable


def test_cancel_stops_every_rank(client):
    def forever():
        dask_ddp.report(started=1)
        while True:
            time.sleep(0.1)

    job = run(client, forever)
    wait_until(lambda: not job.metrics.empty, 60, what="the first report")
    t0 = time.time()
    job.cancel()
    took = time.time() - t0
    with pytest.raises(dask_ddp.JobCancelledError):
        job.result(timeout=10)
    assert took < 5.0, f"cancel took {took:.2f} s"
    assert job.state == "CANCELLED" and no_running_ranks(client)
    assert leftover_processes(client) == []


@pytest.mark.slow
def test_two_concurrent_jobs_on_disjoint_workers():
    with local_client(4) as c:
        addrs = sorted(scheduler_workers(c))
        results = {}

        def go(name, workers):
            results[name] = dispatch.run(c, train_ddp, 3, workers=workers, progress=False).result(timeout=180)

        threads = [threading.Thread(target=go, args=("a", addrs[:2])),
                   threading.Thread(target=go, args=("b", addrs[2:]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
        assert set(results) == {"a", "b"}
        for values in results.values():
            assert (values[0][1] == values[1][1]).all()


# ---- bad input: a clear error before anything starts ---------------------------------------------------------

def test_warm_up_starts_the_spares_the_next_job_uses(client):
    with pytest.raises(dask_ddp.PlanError, match="asked for 3 workers"):
        dispatch.warm_up(client, workers=3)
    ready = dispatch.warm_up(client, timeout=120)
    assert sorted(ready) == sorted(scheduler_workers(client)) and all(ready.values())
    spares = {addr: got["spare"] for addr, got in rank_process_pids(client).items()}
    # the zygote, and after an earlier job of the module the rank it forked ahead for the next job
    assert all(1 <= len(p) <= 2 for p in spares.values()), spares
    parents = run(client, os.getppid).result(timeout=120)
    assert set(parents) == {p[0] for p in spares.values()}, "the job's ranks must be forks of the warmed zygotes"
    def forked_ahead() -> dict | None:  # forked in the background at the job's end: it may be on its way
        got = {addr: p["spare"][1:] for addr, p in rank_process_pids(client).items()}
        return got if all(len(p) == 1 for p in got.values()) else None

    ahead = wait_until(forked_ahead, timeout=60, what="each worker's rank forked ahead for the next job")
    pids = run(client, os.getpid).result(timeout=120)
    assert sorted(pids) == sorted(p[0] for p in ahead.values()), "the next job must run in the ranks forked ahead"


def test_planning_sees_every_worker_while_the_client_refreshes_its_cache(client):
    """distributed 2026.7's Client.scheduler_info(n_workers=-1) returns the client's shared cached identity, which
    the client's own periodic refresh replaces with one that lists no workers: a refresh between the fetch and the
    return made run() say "the cluster has: none" (a CI run failed so). With a refresh every 2 ms that path gave
    an empty cluster in 68 of 500 calls; dask-ddp's own view and warm_up's plan must never."""
    import dask
    from distributed import Client

    addresses = sorted(scheduler_workers(client))
    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}):
        fast = Client(client.scheduler.address, timeout=30)
    try:
        assert [sorted(scheduler_workers(fast)) for _ in range(500)] == [addresses] * 500
        for _ in range(50):
            assert sorted(dispatch.warm_up(fast, workers=addresses, timeout=60)) == addresses
    finally:
        fast.close()


def _set_zygote(on: bool) -> None:
    import dask

    dask.config.set({"ddp.zygote": on})


@pytest.mark.slow
def test_without_the_zygote_a_job_runs_in_the_warmed_spares(client):
    """ddp.zygote: false starts each rank as a fresh interpreter; the warm spare is then the rank itself."""
    client.run(_set_zygote, False)
    try:
        ready = dispatch.warm_up(client, timeout=120)
        assert all(ready.values())
        spares = {pid for got in rank_process_pids(client).values() for pid in got["spare"]}
        values = run(client, os.getpid).result(timeout=120)
        assert len(set(values)) == 2 and set(values) <= spares, "the job must run in the warmed spares"
        assert run(client, lambda: 1).result(timeout=120) == [1, 1]
        assert leftover_processes(client) == []
    finally:
        client.run(_set_zygote, True)


def test_bad_input(client):
    lock = threading.Lock()
    with pytest.raises(TypeError, match="callable"):
        run(client, 42)
    with pytest.raises(dask_ddp.SerializationError, match="keyword argument 'data'"):
        run(client, train_ddp, 1, data=lock)
    with pytest.raises(dask_ddp.SerializationError, match="positional argument 0"):
        run(client, train_ddp, lock)
    with pytest.raises(dask_ddp.SerializationError, match="the function"):
        run(client, lambda: lock.locked())
    with pytest.raises(dask_ddp.PlanError, match="asked for 3 workers, the cluster has 2"):
        run(client, train_ddp, 1, workers=3)
    with pytest.raises(dask_ddp.PlanError, match="unknown worker"):
        run(client, train_ddp, 1, workers=["tcp://10.9.9.9:1"])
    with pytest.raises(dask_ddp.PlanError, match="unknown backend 'mpi'"):
        run(client, train_ddp, 1, backend="mpi")
    with pytest.raises(dask_ddp.PlanError, match="max_restarts"):
        run(client, train_ddp, 1, max_restarts=-1)
    assert no_running_ranks(client)


def test_closed_client():
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
        c = Client(cluster)
        c.close()
        with pytest.raises(dask_ddp.ClientClosedError, match="not connected"):
            dispatch.run(c, train_ddp, 1)


def test_an_asynchronous_client_in_its_event_loop_gets_a_clear_error_and_works_from_a_thread(client):
    """Before, run() read the coroutine an asynchronous client's scheduler_info() returns as an empty cluster
    and said "the cluster has no workers"."""
    import asyncio

    async def use():
        async with Client(client.scheduler.address, asynchronous=True) as aclient:
            for call in (lambda: dispatch.run(aclient, train_ddp, 1), lambda: dispatch.warm_up(aclient),
                         lambda: dask_ddp.attach(aclient, "x")):
                with pytest.raises(TypeError, match="asynchronous=True .* asyncio.to_thread"):
                    call()
            job = await asyncio.to_thread(dispatch.run, aclient, os.getpid, progress=False)  # what the error says
            return await asyncio.to_thread(job.result, 120)

    assert len(set(asyncio.run(use()))) == 2


@pytest.mark.slow
def test_nccl_without_gpu_fails_at_once_naming_rank_and_worker(client):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    t0 = time.time()
    job = run(client, env_and_context, backend="nccl")
    with pytest.raises(dask_ddp.PlanError, match=r"backend='nccl' needs a GPU, but rank \d on worker tcp://"):
        job.result(timeout=60)
    assert time.time() - t0 < 30


def test_get_context_outside_a_rank():
    with pytest.raises(dask_ddp.NotInRankError, match="outside a dask-ddp rank"):
        dask_ddp.get_context()
    with pytest.raises(dask_ddp.NotInRankError):
        dask_ddp.report(loss=1.0)


# ---- what ships to the ranks ----------------------------------------------------------------------------------

def test_a_function_shipped_by_value_keeps_its_file_name_in_tracebacks(tmp_path, monkeypatch):
    """cloudpickle 3.1.3 names every function it ships by value "<dynamic-code>": a failing rank's traceback then
    named no file and showed no source line (test_metrics and test_resilience failed on it). dask-ddp's pickling
    keeps each code object's own file, nested functions and comprehensions included."""
    import importlib
    import pickle
    import traceback

    import cloudpickle

    from dask_ddp.wire import pickling

    (tmp_path / "notebook_cell.py").write_text("def outer():\n    def inner():\n"
                                               "        return [1 / 0 for _ in range(1)]\n    return inner()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cell = importlib.import_module("notebook_cell")
    cloudpickle.register_pickle_by_value(cell)
    try:
        shipped = pickle.loads(pickling.dumps(cell.outer))
    finally:
        cloudpickle.unregister_pickle_by_value(cell)
    assert shipped is not cell.outer
    with pytest.raises(ZeroDivisionError) as info:
        shipped()
    text = "".join(traceback.format_exception(info.value))
    where = str(tmp_path / "notebook_cell.py")
    for line, name in ((4, "outer"), (3, "inner"), (3, "<listcomp>")):
        assert f'File "{where}", line {line}, in {name}' in text, text
    assert "return [1 / 0 for _ in range(1)]" in text and "<dynamic-code>" not in text


def test_expose_main_sets_only_top_level_names_the_ranks_main_lacks(monkeypatch):
    import types

    from dask_ddp.wire import pickling

    rank_main = types.ModuleType("__main__")
    rank_main.main = "the rank's own"
    monkeypatch.setitem(sys.modules, "__main__", rank_main)
    notebook: dict = {"__name__": "__main__"}
    exec("class Scale:\n    pass\n\nclass Data:\n    pass\n\ndef square(x):\n    return x * x\n\n"
         "def main():\n    pass\n\n"
         "def train(data):\n    def inner():\n        pass\n    return square, Scale, main, inner\n", notebook)
    data = notebook["Data"]()  # an argument of the job, of a class defined in the notebook
    assert sorted(pickling.expose_main(notebook["train"], data)) == ["Data", "Scale", "square", "train"]
    assert rank_main.square is notebook["square"] and rank_main.Scale is notebook["Scale"]
    assert rank_main.main == "the rank's own"  # never replaced
    assert not hasattr(rank_main, "inner") and pickling.expose_main(print, 3) == []
