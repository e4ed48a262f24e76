"""Train a small model with DistributedDataParallel on every worker of a Dask cluster.

The job pod of ``daskjob.yaml`` runs this script (mounted from a ConfigMap);
the operator sets ``DASK_SCHEDULER_ADDRESS`` there. Elsewhere pass
``--scheduler``::

    python train.py --scheduler tcp://dask-ddp-gpu-scheduler:8786 --workers 2

Each Dask worker runs one rank: on GPU workers (``dask cuda worker``) the
ranks use NCCL on ``cuda:0``, the worker's own GPU; on CPU workers, gloo.
``train`` is defined in this file, so cloudpickle ships it to the workers by
value and the workers need only the image, not this script.
"""

from __future__ import annotations

import argparse
import os

import torch
from dask.distributed import Client
from torch.nn.parallel import DistributedDataParallel

import dask_ddp


def train(epochs: int, lr: float = 0.05, batch_size: int = 64) -> float:
    """Fit y = sum(x) with a linear layer; return this rank's last loss."""
    ctx = dask_ddp.get_context()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(torch.nn.Linear(16, 1).to(ctx.device), device_ids=ctx.device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1000 + ctx.rank)  # a different shard per rank
    x = torch.randn(1024, 16, generator=data)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(epochs):
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb.to(ctx.device)), yb.to(ctx.device))
            loss.backward()
            optimizer.step()
        dask_ddp.report(loss=loss.item(), epoch=epoch)
    return loss.item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", default=os.environ.get("DASK_SCHEDULER_ADDRESS"),
                        help="Dask scheduler address (default: $DASK_SCHEDULER_ADDRESS)")
    parser.add_argument("--workers", type=int, required=True, help="workers to wait for: one rank each")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds to wait for the scheduler, then for the workers (images pull, GPU nodes scale up)")
    args = parser.parse_args(argv)
    if not args.scheduler:
        parser.error("no scheduler: pass --scheduler or set DASK_SCHEDULER_ADDRESS")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with Client(args.scheduler, timeout=args.timeout) as client:
        client.wait_for_workers(args.workers, timeout=args.timeout)
        job = dask_ddp.dispatch.run(client, train, args.epochs, lr=args.lr)
        losses = job.result()
        print("final loss per rank:", losses)


if __name__ == "__main__":
    main()
