"""Mixed precision with DDP: ``torch.autocast``, with a ``GradScaler`` and float16 on GPU, bfloat16 on CPU.

The forward pass runs in the low-precision type inside ``torch.autocast``; parameters, gradients and the
optimizer stay in float32, and DDP all-reduces float32 gradients. float16 has a narrow range, so on GPU the
loss is scaled before ``backward()`` and the gradients unscaled before the step (``GradScaler``); bfloat16
has float32's range and needs no scaler (a disabled scaler passes everything through)::

    python examples/idiom_mixed_precision.py --steps 40
"""

from __future__ import annotations

import argparse

import dask_ddp


def train(steps: int = 40, lr: float = 0.05) -> dict:
    """One rank: a small regression with autocast; returns the types seen and the first and last loss."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    on_gpu = ctx.device.type == "cuda"
    low = torch.float16 if on_gpu else torch.bfloat16
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
                .to(ctx.device), device_ids=ctx.device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cuda", enabled=on_gpu)  # float16 needs loss scaling; bfloat16 does not
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)).to(ctx.device)  # one task, all ranks
    losses = []
    for step in range(steps):
        x = torch.randn(64, 16, device=ctx.device)
        with torch.autocast(device_type=ctx.device.type, dtype=low):
            out = model(x)  # matmuls in `low`
        loss = torch.nn.functional.mse_loss(out.float(), x @ target)  # the loss in float32
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the (scaled) float32 gradients
        scaler.step(opt)  # unscales; skips the step if a gradient overflowed
        scaler.update()
        losses.append(loss.item())
        dask_ddp.report(loss=losses[-1], step=step)
    params = [p.detach().float().cpu() for p in model.parameters()]
    return {"rank": ctx.rank, "device": str(ctx.device), "autocast_dtype": str(out.dtype),
            "param_dtype": str(params[0].dtype), "grad_dtype": str(next(model.parameters()).grad.dtype),
            "first_loss": losses[0], "last_loss": losses[-1], "checksum": float(sum(p.sum() for p in params))}


def main(argv: list[str] | None = None, client=None) -> list[dict]:
    """Run the job on ``client``, or on a local cluster of 2 workers started (and stopped) here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    if client is not None:
        return dask_ddp.dispatch.run(client, train, args.steps, progress=False).result()
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        results = dask_ddp.dispatch.run(c, train, args.steps).result()
    for r in results:
        print(f"rank {r['rank']} on {r['device']}: forward in {r['autocast_dtype']}, parameters and gradients "
              f"in {r['grad_dtype']}; loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    return results


if __name__ == "__main__":
    main()
