"""DDP on every GPU of this machine: dask-cuda's LocalCUDACluster (one worker per GPU) and dask-ddp.

Each worker sees its own GPU as ``cuda:0`` (dask-cuda rotates
``CUDA_VISIBLE_DEVICES``), which is the device dask-ddp gives each rank
(``ctx.device``); ``backend="auto"`` picks nccl when every rank has a GPU.
Without a GPU, or without dask-cuda (``pip install 'dask-ddp[cuda]'``), the
script says why and exits 0::

    python examples/local_cuda_cluster.py --steps 100
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import dask_ddp


def why_not() -> str | None:
    """Why this example cannot run here (no CUDA GPU, no dask-cuda), or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if importlib.util.find_spec("dask_cuda") is None:
        return "dask-cuda is not installed (pip install 'dask-ddp[cuda]')"
    return None


def train(steps: int, lr: float = 0.05) -> dict:
    """One rank: a small DDP regression on the rank's own GPU; returns where it ran and its last loss."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
                .to(ctx.device), device_ids=ctx.device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randn(256, 64, device=ctx.device)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dask_ddp.report(loss=loss)
    return {"rank": ctx.rank, "device": torch.cuda.get_device_name(ctx.device), "backend": ctx.backend,
            "loss": loss.item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    reason = why_not()
    if reason:
        print(f"skipped: {reason}")
        return 0
    from dask.distributed import Client
    from dask_cuda import LocalCUDACluster

    with LocalCUDACluster(host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        job = dask_ddp.dispatch.run(client, train, args.steps, total=args.steps)
        for r in job.result():
            print(f"rank {r['rank']}: {r['device']} ({r['backend']}), final loss {r['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
