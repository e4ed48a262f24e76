"""Device placement: dask-cuda's CUDA_VISIBLE_DEVICES rotation reproduced on CPU, and real GPU tests.

dask-cuda's LocalCUDACluster needs NVML and a GPU, so on CPU the same contract is
reproduced with a SpecCluster of Nannies, each given its own rotated
CUDA_VISIBLE_DEVICES and a GPU-id name. The GPU tests (marked ``gpu``) run
LocalCUDACluster and nccl for real and are skipped where no GPU is visible.
"""

from __future__ import annotations

import os
import threading

import pytest
from _cluster import wait_until
from dask.distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster

import dask_ddp
from dask_ddp import dispatch
from dask_ddp.client.cluster import scheduler_workers
from dask_ddp.rank import devices
from dask_ddp.rank.devices import Placement, assign, choose_backend

# --- pure placement rule (no GPU, no cluster) ---

A, B, C = "GPU-a", "GPU-b", "GPU-c"


@pytest.mark.parametrize("visible, indices, backend", [
    ([[A, B, C], [B, C, A], [C, A, B]], [0, 0, 0], "nccl"),  # dask-cuda's rotation: cuda:0 is each worker's own
    ([[A, B], [A, B]], [0, 1], "nccl"),                      # workers that see every GPU: cuda:LOCAL_RANK
    ([[A], [B]], [0, 0], "nccl"),                            # one GPU per host, two hosts
    ([[A], [A]], [0, 0], "gloo"),                            # two ranks, one GPU: shared, so not nccl
    ([[A, B], [A, B], [A, B]], [0, 1, 0], "gloo"),           # three ranks on two GPUs: the least used is shared
    ([[A], []], [0, None], "gloo"),                          # a rank without a GPU
    ([[], []], [None, None], "gloo"),
])
def test_assign_and_auto_backend(visible, indices, backend):
    placements = assign(visible)
    assert [p.index for p in placements] == indices
    assert choose_backend("auto", placements) == backend
    assert choose_backend("gloo", placements) == "gloo" and choose_backend("nccl", placements) == "nccl"


def test_assign_names_who_shares():
    assert assign([[A, B], [A, B], [A, B]]) == [Placement(0, A, (2,)), Placement(1, B, ()), Placement(0, A, (0,))]


def test_nccl_on_a_shared_gpu_is_refused_naming_the_ranks(monkeypatch):
    """place() through a real TCPStore; only the GPU is faked (none exists here): both ranks see one UUID."""
    import torch.distributed as dist

    monkeypatch.setattr(devices, "visible_gpus", lambda: (A,))
    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    errors = {}

    def rank(r):
        store = master if r == 0 else dist.TCPStore("127.0.0.1", master.port, 2, is_master=False)
        try:
            devices.place(store, r, 2, f"tcp://w{r}:1", "nccl")
        except dask_ddp.PlanError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 1], "every rank refuses, so none waits in init_process_group"
    for r, exc in errors.items():
        assert exc.rank == r and exc.worker == f"tcp://w{r}:1"
        text = str(exc)
        assert "needs one GPU per rank" in text and f"shares GPU {A}" in text
        assert "tcp://w0:1" in text and "tcp://w1:1" in text and "LocalCUDACluster" in text


# --- the order a rank sees its GPUs in: cuda:LOCAL_RANK is its own (faked device lists, no GPU) ---


def dask_cuda(n: int, gpus=None) -> list[list[str]]:
    """What dask-cuda's LocalCUDACluster gives its ``n`` workers: worker i sees ``gpus`` rotated to start at i."""
    gpus = gpus or [str(g) for g in range(n)]
    return [[gpus[(i + k) % len(gpus)] for k in range(len(gpus))] for i in range(n)]


def seen(visible, local_rank):
    """The list local rank ``local_rank`` sees once dask-ddp has (or has not) re-listed it."""
    return list(devices.host_order(visible, local_rank) or visible[local_rank])


@pytest.mark.parametrize("visible", [dask_cuda(n) for n in (2, 3, 4)]
                         + [dask_cuda(4)[1::2],                               # workers 1 and 3 of 4 in the job
                            dask_cuda(2, ["2", "3"]),                         # dask-cuda under CUDA_VISIBLE_DEVICES=2,3
                            dask_cuda(3, ["GPU-a", "GPU-b", "GPU-c"])],      # GPUs named by UUID
                         ids=["2 of 2", "3 of 3", "4 of 4", "1 and 3 of 4", "2,3", "uuids"])
def test_under_dask_cuda_cuda_local_rank_is_the_workers_own_gpu(visible):
    """Before, local rank k saw its worker's rotation as it was: cuda:k was k places after its own GPU."""
    lists = [seen(visible, k) for k in range(len(visible))]
    for k, gpus in enumerate(lists):
        assert gpus[k] == visible[k][0], f"cuda:LOCAL_RANK of local rank {k} is {gpus[k]}, its own is {visible[k][0]}"
        assert sorted(gpus) == sorted(visible[k]), "the same GPUs, only in another order"
    assert all(gpus == lists[0] for gpus in lists), "every rank of the host sees one order, torchrun's"
    if sorted(visible[0]) == visible[0] and len(visible) == len(visible[0]):
        assert lists[0] == visible[0], "a whole host re-listed reads as torchrun's plain CUDA_VISIBLE_DEVICES"


@pytest.mark.parametrize("visible", [
    [["0", "1", "2", "3"]],                    # one worker on the host (any layout): LOCAL_RANK 0, its own is first
    [["0"]],
    [["0", "1", "2", "3"]] * 4,                # one list shared by every worker (torchrun-like): kept
    [["0", "1"]] * 2,
    [[], []],                                  # no GPU (unset or empty CUDA_VISIBLE_DEVICES)
    [[], ["1", "0"]],                          # one rank without a GPU
    [["0"], ["0"]],                            # two workers, one GPU: shared, not one's own
    [["0"], ["1"]],                            # one GPU per worker: cuda:1 does not exist there, and is not made up
], ids=["alone of 4", "alone of 1", "shared 4", "shared 2", "no gpu", "one without", "one gpu", "one each"])
def test_layouts_without_a_gpu_of_each_workers_own_first_are_kept(visible):
    assert [devices.host_order(visible, k) for k in range(len(visible))] == [None] * len(visible)


@pytest.mark.parametrize("per_host", [1, 2, 3, 4])
def test_dask_ddps_own_device_stays_the_ranks_own_gpu(per_host):
    """Two dask-cuda hosts: with the GPUs re-listed, each rank's placement (ctx.device) is cuda:LOCAL_RANK and its
    worker's own GPU, so a script's set_device(LOCAL_RANK) and dask-ddp agree; nccl, since none is shared."""
    hosts = [dask_cuda(per_host, [f"GPU-{h}{g}" for g in range(per_host)]) for h in "ab"]
    uuids = [seen(visible, k) for visible in hosts for k in range(per_host)]
    placements = assign(uuids)
    own = [v[0] for visible in hosts for v in visible]
    assert [p.index for p in placements] == [k for _ in hosts for k in range(per_host)]
    assert [p.uuid for p in placements] == own
    assert choose_backend("auto", placements) == "nccl"


def test_ranks_agree_on_the_order_with_the_ranks_of_their_host_only():
    """The exchange through a real TCPStore: two hosts of two dask-cuda workers (ranks 0-1 and 2-3), each rank's
    environment a dict of its own (faked: no GPU, and threads share os.environ)."""
    import torch.distributed as dist

    hosts = [dask_cuda(2, ["0", "1"]), dask_cuda(2, ["2", "3"])]  # 2,3: told apart from the first host's GPUs
    envs = [{"CUDA_VISIBLE_DEVICES": ",".join(v)} for visible in hosts for v in visible]
    master = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)

    def rank(r):
        store = master if r == 0 else dist.TCPStore("127.0.0.1", master.port, 4, is_master=False)
        devices._own_gpu_at_local_rank(store, r, r % 2, 2, f"tcp://w{r}:1", envs[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "2,3", "2,3"]

# --- dask-cuda's layout on CPU, and real GPUs ---


def where_am_i():
    ctx = dask_ddp.get_context()
    return ctx.rank, int(os.environ["LOCAL_RANK"]), os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.worker, \
        str(ctx.device), ctx.backend


@pytest.mark.slow
def test_dask_cuda_rotation_on_cpu():
    """dask-cuda's layout through real rank processes: a torchrun script's cuda:LOCAL_RANK is its worker's own GPU
    (the first of the worker's CUDA_VISIBLE_DEVICES, its name); before, rank 1 saw "1,2,0" and took GPU 2."""
    n = 3
    rotate = lambda i: ",".join(str((i + k) % n) for k in range(n))  # noqa: E731 - dask-cuda's scheme
    # names are GPU ids; declared out of order so that rank order must come from the names
    # distributed's NVML diagnostics would look these GPUs up where a real (smaller) GPU host runs the test
    env = lambda i: {"CUDA_VISIBLE_DEVICES": rotate(i), "DASK_DISTRIBUTED__DIAGNOSTICS__NVML": "False"}  # noqa: E731
    workers = {str(i): {"cls": Nanny, "options": {"nthreads": 1, "name": str(i), "env": env(i)}}
               for i in (2, 0, 1)}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(n, timeout=60)
        names = {a: w["name"] for a, w in scheduler_workers(client).items()}
        out = dispatch.run(client, where_am_i, progress=False).result(timeout=180)
        for rank, (r, local_rank, cvd, worker, device, backend) in enumerate(out):
            assert r == local_rank == rank
            assert str(names[worker]) == str(rank), "rank i runs on the worker of GPU i"
            assert cvd.split(",")[local_rank] == str(names[worker]), f"rank {rank}: cuda:LOCAL_RANK of {cvd!r}"
            assert cvd == "0,1,2", "every rank of the host sees torchrun's order"
            assert device == "cpu" and backend == "gloo"  # no GPU here: auto picks gloo
        # two of the three workers: LOCAL_RANK 0 and 1 on the workers of GPUs 0 and 2
        out = dispatch.run(client, where_am_i, workers=["2", "0"], progress=False).result(timeout=180)
        for r, local_rank, cvd, worker, _, _ in out:
            assert cvd.split(",")[local_rank] == str(names[worker]), f"rank {r}: cuda:LOCAL_RANK of {cvd!r}"
        assert [o[2] for o in out] == ["0,2,1", "0,2,1"]
        leaked = client.run(lambda: ("RANK" in os.environ, os.environ["CUDA_VISIBLE_DEVICES"]))
        assert {names[a]: v for a, v in leaked.items()} == {str(i): (False, rotate(i)) for i in range(n)}, \
            "the workers keep their own environment"


@pytest.mark.gpu
def test_local_cuda_cluster_nccl():
    import torch

    dask_cuda = pytest.importorskip("dask_cuda")
    n = torch.cuda.device_count()
    with dask_cuda.LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        def gpu_allreduce():
            import torch
            import torch.distributed as dist

            ctx = dask_ddp.get_context()
            t = torch.ones(1, device=ctx.device) * (ctx.rank + 1)
            dist.all_reduce(t)
            return str(ctx.device), ctx.backend, torch.cuda.current_device(), float(t.item()), \
                os.environ["CUDA_VISIBLE_DEVICES"]

        own = _own_gpus(client)
        out = dispatch.run(client, gpu_allreduce, progress=False).result(timeout=300)
        assert len(out) == n
        for rank, (device, backend, current, total, cvd) in enumerate(out):  # one host: LOCAL_RANK is the rank
            assert device == f"cuda:{rank}" and backend == "nccl" and current == rank
            assert total == n * (n + 1) / 2
            assert cvd.split(",")[rank] == own[rank]


def _own_gpus(client) -> list[str]:
    """Each worker's own GPU (the first of its CUDA_VISIBLE_DEVICES), in rank order (by name: dask-cuda's GPU ids)."""
    names = {a: w["name"] for a, w in scheduler_workers(client).items()}
    firsts = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0])
    return [firsts[a] for a in sorted(firsts, key=lambda a: int(names[a]))]


def torchrun_style():
    """What an unchanged torchrun script does: take cuda:LOCAL_RANK."""
    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ctx = dask_ddp.get_context()
    return (str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
            str(torch.cuda.get_device_properties(ctx.device).uuid))


@pytest.mark.gpu
def test_a_torchrun_scripts_set_device_local_rank_takes_its_workers_own_gpu_under_dask_cuda():
    """Before, the rank of dask-cuda's worker 1 saw "1,2,...,0" and set_device(1) took GPU 2, another worker's."""
    import torch

    dask_cuda = pytest.importorskip("dask_cuda")
    if torch.cuda.device_count() < 2 or os.environ.get("CUDA_VISIBLE_DEVICES"):
        pytest.skip("needs 2 GPUs, numbered as the machine numbers them (CUDA_VISIBLE_DEVICES unset)")
    with dask_cuda.LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        own = [str(torch.cuda.get_device_properties(int(g)).uuid) for g in _own_gpus(client)]
        out = dispatch.run(client, torchrun_style, progress=False).result(timeout=300)
        assert [script for script, _ in out] == own, "cuda:LOCAL_RANK is the worker's own GPU"
        assert [ours for _, ours in out] == own, "and so is dask-ddp's ctx.device"


def placement_and_ddp():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    model = DDP(torch.nn.Linear(8, 1).to(ctx.device), device_ids=ctx.device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(16, 8, device=ctx.device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return str(ctx.device), ctx.backend, str(torch.cuda.get_device_properties(ctx.device).uuid), params


@pytest.mark.gpu
def test_plain_local_cluster_gives_each_rank_its_own_gpu_or_shares_with_gloo():
    """Workers that see every GPU: rank r takes cuda:r (torchrun's layout) and nccl; with fewer GPUs than
    ranks they share, auto picks gloo, and an explicit nccl is refused with the ranks named."""
    import torch

    gpus = torch.cuda.device_count()
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        out = dispatch.run(client, placement_and_ddp, progress=False).result(timeout=300)
        assert (out[0][3] == out[1][3]).all(), "DDP keeps the ranks' parameters identical"
        if gpus >= 2:
            assert [o[:2] for o in out] == [("cuda:0", "nccl"), ("cuda:1", "nccl")]
            assert out[0][2] != out[1][2]
        else:
            assert [o[:2] for o in out] == [("cuda:0", "gloo"), ("cuda:0", "gloo")]
            assert out[0][2] == out[1][2]
            job = dispatch.run(client, placement_and_ddp, backend="nccl", progress=False)
            with pytest.raises(dask_ddp.PlanError, match="needs one GPU per rank"):
                job.result(timeout=300)


def _gpu_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.mark.gpu
def test_gpu_memory_freed_after_job():
    """The device's used memory (every process's) is back to its level before the job once the job ends."""

    dask_cuda = pytest.importorskip("dask_cuda")
    with dask_cuda.LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        _gpu_used()  # this process's own CUDA context first, so that the baseline holds it
        base = _gpu_used()

        def hog():
            import torch

            x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
            x.fill_(1)
            return _gpu_used()

        [during] = dispatch.run(client, hog, progress=False).result(timeout=300)
        assert during - base >= 1 << 30, "the rank's gigabyte shows in the device's used memory"
        wait_until(lambda: _gpu_used() - base <= 256 << 20, 20, interval=0.2, must=False)
        left = _gpu_used() - base
        assert left <= 256 << 20, f"{left >> 20} MiB still used after the job: the rank process must exit"
