"""Jobs in a row on LocalCUDACluster (one worker per GPU), nccl: how long each takes from run() to result().

Run on a GPU machine: ``python benchmarks/gpu_jobs.py [--jobs 5]``. Each job does one nccl all-reduce on its
rank's cuda:0 and returns the device name, so a job's time is dispatch + fork + CUDA/NCCL init + teardown.
Compared in the same run with ``ddp.zygote: false`` (a fresh interpreter per rank, one warm spare).
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask
from dask_cuda import LocalCUDACluster
from distributed import Client

import dask_ddp


def one_step():
    import torch
    import torch.distributed as dist

    ctx = dask_ddp.get_context()
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    return ctx.device, ctx.backend, t.item(), torch.cuda.get_device_name(0)


def _set_zygote(on: bool) -> None:
    dask.config.set({"ddp.zygote": on})


def timed(client, jobs: int) -> list[float]:
    out = []
    for _ in range(jobs):
        t0 = time.perf_counter()
        got = dask_ddp.dispatch.run(client, one_step, progress=False).result(timeout=300)
        out.append(time.perf_counter() - t0)
        assert all(g[1] == "nccl" and str(g[0]) == "cuda:0" for g in got), got
    print("last job:", got)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=5)
    args = parser.parse_args()
    for zygote in (True, False):
        with dask.config.set({"ddp.zygote": zygote}), \
                LocalCUDACluster(dashboard_address=":0") as cluster, Client(cluster) as client:
            client.run(_set_zygote, zygote)
            dask_ddp.dispatch.warm_up(client)
            times = timed(client, args.jobs)
        print(f"zygote={zygote}: {len(times)} jobs, s each: {', '.join(f'{t:.2f}' for t in times)}; "
              f"median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
