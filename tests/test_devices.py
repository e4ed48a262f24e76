"""Device placement: dask-cuda's CUDA_VISIBLE_DEVICES rotation reproduced on CPU, and real GPU tests.

dask-cuda's LocalCUDACluster needs NVML and a GPU, so on CPU the same contract is
reproduced with a SpecCluster of Nannies, each given its own rotated
CUDA_VISIBLE_DEVICES and a GPU-id name. The GPU tests (marked ``gpu``) run
LocalCUDACluster and nccl for real and are skipped where no GPU is visible.
"""

from __future__ import annotations

import os

import pytest
from dask.distributed import Client, Nanny, Scheduler, SpecCluster

import dask_ddp
from dask_ddp import dispatch


def where_am_i():
    ctx = dask_ddp.get_context()
    return ctx.rank, ctx.local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.worker, str(ctx.device), ctx.backend


def test_dask_cuda_rotation_on_cpu():
    n = 3
    rotate = lambda i: ",".join(str((i + k) % n) for k in range(n))  # noqa: E731 - dask-cuda's scheme
    # names are GPU ids; declared out of order so that rank order must come from the names
    workers = {str(i): {"cls": Nanny, "options": {"nthreads": 1, "name": str(i),
                                                  "env": {"CUDA_VISIBLE_DEVICES": rotate(i)}}}
               for i in (2, 0, 1)}
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(n, timeout=60)
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        out = dispatch.run(client, where_am_i, progress=False).result(timeout=180)
        for rank, (r, local_rank, cvd, worker, device, backend) in enumerate(out):
            assert r == local_rank == rank
            assert str(names[worker]) == str(rank), "rank i runs on the worker of GPU i"
            assert cvd == rotate(rank), "the rank sees its worker's rotated CUDA_VISIBLE_DEVICES"
            assert device == "cpu" and backend == "gloo"  # no GPU here: auto picks gloo
        leaked = client.run(lambda: "RANK" in os.environ)
        assert not any(leaked.values())


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

        out = dispatch.run(client, gpu_allreduce, progress=False).result(timeout=300)
        assert len(out) == n
        for rank, (device, backend, current, total, cvd) in enumerate(out):
            assert device == "cuda:0" and backend == "nccl" and current == 0
            assert total == n * (n + 1) / 2
            assert cvd.split(",")[0] == str(rank)


@pytest.mark.gpu
def test_gpu_memory_freed_after_job():
    import torch

    dask_cuda = pytest.importorskip("dask_cuda")
    with dask_cuda.LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
        def hog():
            import torch
            x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
            return x.numel()

        dispatch.run(client, hog, progress=False).result(timeout=300)
        free, total = torch.cuda.mem_get_info(0)
        assert total - free < (1 << 30), "the rank process's GPU memory must be released when it exits"
