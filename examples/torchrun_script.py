"""A plain torchrun-style DDP script: no dask-ddp inside.

It reads RANK / LOCAL_RANK / WORLD_SIZE (and MASTER_ADDR / MASTER_PORT through
``init_method="env://"``) from the environment, as torchrun sets them, and
trains a small regression model with DistributedDataParallel on synthetic
data, printing the loss on rank 0. Run it either way, unchanged::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_script.py --steps 50
    dask-ddp run --workers 2 examples/torchrun_script.py --steps 50
    dask-ddp run --scheduler tcp://127.0.0.1:8786 examples/torchrun_script.py --steps 50
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same target on every rank
    true_w = torch.randn(16, 1)
    torch.manual_seed(1 + rank)  # different samples per rank
    model = DDP(torch.nn.Linear(16, 1).to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 16)
        y = x @ true_w + 0.01 * torch.randn(args.batch_size, 1)
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights.to(device) if use_cuda else weights)
    same = all(torch.equal(g.cpu(), gathered[0].cpu()) for g in gathered)
    if rank == 0:
        print(f"done: world size {world_size}, final loss {loss.item():.4f}, ranks agree: {same}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
