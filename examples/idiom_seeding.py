"""Seeding with DDP: ``seed_everything(seed)`` seeds Python, NumPy and torch with ``seed + rank``.

Each rank draws its own random numbers (augmentations, dropout, shuffles of its own data), and a run repeats
exactly when started again with the same seed. The model's initial parameters still agree on every rank: DDP
broadcasts rank 0's when it wraps the model. ``per_rank=False`` seeds every rank alike::

    python examples/idiom_seeding.py --seed 0
"""

from __future__ import annotations

import argparse
import random

import dask_ddp


def train(seed: int = 0) -> dict:
    """One rank: seeds, builds a DDP model, draws some random numbers; returns all of them."""
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    used = dask_ddp.seed_everything(seed)  # seed + rank
    model = DDP(torch.nn.Linear(4, 2).to(ctx.device), device_ids=ctx.device_ids)  # rank 0's parameters
    return {"rank": ctx.rank, "seed": used,
            "initial": [round(v, 6) for p in model.parameters() for v in p.detach().cpu().flatten().tolist()],
            "torch": torch.rand(3).tolist(), "numpy": np.random.rand(3).tolist(), "python": random.random()}


def main(argv: list[str] | None = None, client=None) -> list[dict]:
    """Run the job on ``client``, or on a local cluster of 2 workers started (and stopped) here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if client is not None:
        return dask_ddp.dispatch.run(client, train, args.seed, progress=False).result()
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        results = dask_ddp.dispatch.run(c, train, args.seed).result()
    for r in results:
        print(f"rank {r['rank']}: seed {r['seed']}, first torch draw {r['torch'][0]:.4f}, "
              f"first initial parameter {r['initial'][0]:.4f}")
    return results


if __name__ == "__main__":
    main()
