"""Gradient accumulation with DDP: ``model.no_sync()`` on every micro-batch but the last of a step.

Each ``backward()`` of a DDP model all-reduces its gradients. When a step accumulates several micro-batches,
only the last needs it: inside ``model.no_sync()`` the gradients accumulate locally, and the last micro-batch's
``backward()`` all-reduces the sum. Same parameters, one all-reduce per step instead of one per micro-batch
(a comm hook counts them here)::

    python examples/idiom_gradient_accumulation.py --micro-batches 4 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib

import dask_ddp


def batches(rank: int, steps: int, micro_batches: int, size: int = 16) -> list:
    """This rank's data: ``steps`` lists of ``micro_batches`` (x, y) pairs, the same on every run."""
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    w = torch.arange(1.0, 9.0).unsqueeze(1) / 8
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro_batches):
            x = torch.randn(size, 8, generator=g)
            step.append((x, x @ w + 0.1 * torch.randn(size, 1, generator=g)))
        out.append(step)
    return out


def train(micro_batches: int = 4, steps: int = 5, lr: float = 0.1) -> dict:
    """One rank: ``steps`` optimizer steps of ``micro_batches`` micro-batches each; returns the parameters and
    how many gradient all-reduces ran."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).to(ctx.device), device_ids=ctx.device_ids)
    syncs = []

    def counting_allreduce(state, bucket):  # DDP's own all-reduce, counted
        syncs.append(bucket.index())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, micro in enumerate(batches(ctx.rank, steps, micro_batches)):
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():  # all-reduce only on the last
                loss = torch.nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)) / len(micro)
                loss.backward()
        opt.step()
        dask_ddp.report(loss=loss.item() * len(micro), step=step)
    return {"rank": ctx.rank, "all_reduces": syncs.count(0),
            "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()]}


def main(argv: list[str] | None = None, client=None) -> list[dict]:
    """Run the job on ``client``, or on a local cluster of 2 workers started (and stopped) here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if client is not None:
        return dask_ddp.dispatch.run(client, train, args.micro_batches, args.steps, progress=False).result()
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        results = dask_ddp.dispatch.run(c, train, args.micro_batches, args.steps).result()
    for r in results:
        print(f"rank {r['rank']}: {r['all_reduces']} all-reduces for {args.steps} steps of "
              f"{args.micro_batches} micro-batches")
    return results


if __name__ == "__main__":
    main()
