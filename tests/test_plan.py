"""Rank planning and the failure policy: pure functions, no cluster."""

from __future__ import annotations

import pickle
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import dask_ddp
from dask_ddp.wire.plan import (
    WorkerInfo,
    _natural_key,
    make_plan,
    parse_address,
    torchrun_env,
    workers_from_scheduler_info,
)


def w(addr, name):
    host, port = parse_address(addr)
    return WorkerInfo(addr, host, port, str(name))


@pytest.mark.parametrize("workers, expected", [
    # ports compared as numbers, not strings: 9000 < 10000
    ([w("tcp://10.0.0.1:10000", "b"), w("tcp://10.0.0.1:9000", "b")], ["tcp://10.0.0.1:9000", "tcp://10.0.0.1:10000"]),
    # hosts compared as addresses: 10.0.0.9 < 10.0.0.10
    ([w("tcp://10.0.0.10:1", "x"), w("tcp://10.0.0.9:1", "x")], ["tcp://10.0.0.9:1", "tcp://10.0.0.10:1"]),
    # dask-cuda names workers by GPU id: "2" < "10" within a host, whatever the ports
    ([w("tcp://10.0.0.1:5", "10"), w("tcp://10.0.0.1:7", "2")], ["tcp://10.0.0.1:7", "tcp://10.0.0.1:5"]),
])
def test_rank_order(workers, expected):
    assert make_plan(workers).addresses == expected


def test_local_and_node_ranks_and_master():
    ws = [w("tcp://10.0.0.2:1", "0"), w("tcp://10.0.0.1:2", "1"), w("tcp://10.0.0.1:1", "0"),
          w("tcp://10.0.0.2:2", "1")]
    plan = make_plan(ws)
    got = [(r.rank, r.host, r.local_rank, r.node_rank, r.local_world_size, r.num_nodes) for r in plan.ranks]
    assert got == [(0, "10.0.0.1", 0, 0, 2, 2), (1, "10.0.0.1", 1, 0, 2, 2),
                   (2, "10.0.0.2", 0, 1, 2, 2), (3, "10.0.0.2", 1, 1, 2, 2)]
    assert plan.master_addr == "10.0.0.1"
    assert make_plan(ws, master_addr="head").master_addr == "head"
    env = torchrun_env(plan.ranks[3], plan.master_addr, "run", 1, 3)
    assert env["GROUP_RANK"] == "1" and env["LOCAL_RANK"] == "1" and env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert all(isinstance(v, str) for v in env.values())


def test_selection_by_count_address_and_name():
    ws = [w(f"tcp://127.0.0.1:{p}", f"w{i}") for i, p in enumerate([4000, 3000, 5000])]
    assert make_plan(ws, 2).addresses == ["tcp://127.0.0.1:4000", "tcp://127.0.0.1:3000"]  # by name first
    assert make_plan(ws, ["w2", "tcp://127.0.0.1:3000"]).addresses == ["tcp://127.0.0.1:3000", "tcp://127.0.0.1:5000"]


def test_elastic_bounds():
    ws = [w(f"tcp://127.0.0.1:{p}", f"w{i}") for i, p in enumerate([4000, 3000, 5000])]
    assert make_plan(ws, (1, None)).world_size == 3
    assert make_plan(ws, (2, 3)).world_size == 3
    assert make_plan(ws, (1, 2)).addresses == ["tcp://127.0.0.1:4000", "tcp://127.0.0.1:3000"]  # the first, by name
    assert make_plan(ws[:2], (2, 4)).world_size == 2  # after a loss: what is left, if at least min
    with pytest.raises(dask_ddp.PlanError, match=r"needs at least 3 workers, the cluster has 2"):
        make_plan(ws[:2], (3, 4))
    assert make_plan(ws, ("w2", "w0")).addresses == ["tcp://127.0.0.1:4000", "tcp://127.0.0.1:5000"]  # names


@pytest.mark.parametrize("selection, message", [
    ((0, 2), "1 <= min <= max"),
    ((3, 2), "1 <= min <= max"),
    (4, "asked for 4 workers, the cluster has 3"),
    (0, "at least 1"),
    (["nope"], "unknown worker"),
    (["w0", "w0"], "same worker twice"),
    ([], "names no worker"),
    ("w0", "takes a count"),
    (True, "takes a count"),
])
def test_bad_selection(selection, message):
    ws = [w(f"tcp://127.0.0.1:{p}", f"w{i}") for i, p in enumerate([4000, 3000, 5000])]
    with pytest.raises(dask_ddp.PlanError, match=message):
        make_plan(ws, selection)


def test_no_workers():
    with pytest.raises(dask_ddp.PlanError, match="no workers"):
        make_plan([])


def test_scheduler_info_parsing():
    info = {"workers": {"tcp://[::1]:40000": {"host": "::1", "name": 3}, "tcp://127.0.0.1:1": {"name": "a"}}}
    got = sorted(workers_from_scheduler_info(info), key=lambda x: x.port)
    assert [(x.host, x.port, x.name) for x in got] == [("127.0.0.1", 1, "a"), ("::1", 40000, "3")]


def test_errors_pickle_with_fields():
    err = dask_ddp.WorkerLostError("gone", rank=3, worker="tcp://h:1")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is dask_ddp.WorkerLostError and back.rank == 3 and back.worker == "tcp://h:1"
    assert str(back) == "gone"
    stall = pickle.loads(pickle.dumps(dask_ddp.StallError("s", stacks={0: "x"}, rank=0)))
    assert stall.stacks == {0: "x"}


def test_importing_the_package_does_not_import_torch():
    """The first task of a job imports dask_ddp on the worker's event loop: torch there would stop its heartbeats
    for seconds (and slow every notebook's import)."""
    import subprocess
    import sys

    code = "import sys, dask_ddp, dask_ddp.worker.supervisor, dask_ddp.client.job; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_ten_thousand_workers_on_1250_hosts_in_one_plan():
    """A synthetic scheduler view the size of a large cluster, in the scheduler's (arbitrary) order: every
    worker gets a rank, ranks go host by host (10.0.0.9 before 10.0.0.10), worker names count as numbers
    within a host, and each host's local ranks are 0..7. The time this takes is in benchmarks/bench_plan.py."""
    rng = random.Random(0)
    view = {f"tcp://10.0.{h // 250}.{h % 250}:{40000 + g}": {"host": f"10.0.{h // 250}.{h % 250}", "name": f"gpu{g}"}
            for h in range(1250) for g in range(8)}
    shuffled = dict(rng.sample(sorted(view.items()), len(view)))
    plan = make_plan(workers_from_scheduler_info({"workers": shuffled}))
    assert plan.world_size == 10_000 and len(set(plan.addresses)) == 10_000
    assert plan.ranks[9].address == "tcp://10.0.0.1:40001" and plan.ranks[80].host == "10.0.0.10"
    assert [r.local_rank for r in plan.ranks] == list(range(8)) * 1250
    assert [r.node_rank for r in plan.ranks] == [n for n in range(1250) for _ in range(8)]
    assert {(r.local_world_size, r.num_nodes) for r in plan.ranks} == {(8, 1250)}
    assert plan.master_addr == "10.0.0.0"


def _natural_key_before(text):  # the first release's key: the new one must order names the same way
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t)


@given(st.lists(st.text(alphabet="ab09-_.٣", max_size=6), min_size=2, max_size=8))
def test_worker_names_order_as_in_the_first_release(names):
    assert sorted(names, key=_natural_key) == sorted(names, key=_natural_key_before)


def test_listing_the_workers_stops_at_no_cap():
    """Dask's scheduler_info() lists 5 workers unless asked for all: a plan must see all 8 here."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=8, processes=False, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(8)
        with pytest.raises(dask_ddp.PlanError, match="asked for 9 workers, the cluster has 8"):
            dask_ddp.dispatch.run(client, print, workers=9)
        with pytest.raises(dask_ddp.PlanError, match="asked for 9 workers, the cluster has 8"):
            dask_ddp.dispatch.warm_up(client, workers=9)
