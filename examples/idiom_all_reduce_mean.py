"""``all_reduce_mean(x)``: the mean of a number over every rank, on every rank (one all-reduce).

The usual use: each rank evaluates its own shard of the validation set, and the job's validation loss is the
mean of the ranks' values (the mean of the shards' means is the mean of the whole set when the shards are of
equal size, as a ``DistributedSampler`` makes them). Every rank gets it, so every rank can decide alike (early
stopping, a learning-rate schedule)::

    python examples/idiom_all_reduce_mean.py --samples 1000
"""

from __future__ import annotations

import argparse

import dask_ddp


def train(samples: int = 1000) -> dict:
    """One rank: a stand-in validation loss over its shard, then the mean over all ranks."""
    import torch

    ctx = dask_ddp.get_context()
    shard = torch.arange(ctx.rank, samples, ctx.world_size, dtype=torch.float64)  # DistributedSampler's split
    local = (shard / samples).pow(2).mean()  # this rank's validation loss (a 0-d tensor)
    val_loss = dask_ddp.all_reduce_mean(local)  # the same float on every rank
    if ctx.rank == 0:
        dask_ddp.report(val_loss=val_loss)
    return {"rank": ctx.rank, "local": local.item(), "val_loss": val_loss}


def main(argv: list[str] | None = None, client=None) -> list[dict]:
    """Run the job on ``client``, or on a local cluster of 2 workers started (and stopped) here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args(argv)
    if client is not None:
        return dask_ddp.dispatch.run(client, train, args.samples, progress=False).result()
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        results = dask_ddp.dispatch.run(c, train, args.samples).result()
    for r in results:
        print(f"rank {r['rank']}: its shard {r['local']:.6f}, all ranks {r['val_loss']:.6f}")
    return results


if __name__ == "__main__":
    main()
