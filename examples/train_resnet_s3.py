"""Transfer learning of a torchvision ResNet-18 on an ImageFolder in S3, with dask-ddp.

The images live in S3 as ``<root>/<class>/<image>`` (torchvision's ImageFolder
layout). The folder is listed once, on the client, by
``dask_ddp.data.S3ImageFolder``; the dataset (listing included) ships to every
rank, which reads its share of each epoch through a ``DistributedSampler``
and ``DataLoader(num_workers=2)``. The ResNet-18's classifier is replaced for
the dataset's classes; ``--weights DEFAULT`` starts from torchvision's
ImageNet weights (rank 0 downloads them first, the others then read the
cache) and ``--freeze-backbone`` trains the new classifier only. The
default, ``weights=None``, is a random initialisation: nothing is downloaded.

Run it on a local cluster of 2 workers, or on any cluster with ``--scheduler``::

    python examples/train_resnet_s3.py s3://my-bucket/flowers/train --epochs 3
    python examples/train_resnet_s3.py s3://bucket/train --endpoint-url http://127.0.0.1:9000 \\
        --scheduler tcp://10.0.0.5:8786 --weights DEFAULT --freeze-backbone --image-size 224
"""

from __future__ import annotations

import argparse
import sys

import dask_ddp
from dask_ddp.data import S3ImageFolder

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build_model(num_classes: int, weights: str | None = None, freeze_backbone: bool = False):
    """A torchvision ResNet-18 with a new ``num_classes``-way classifier.

    Raises
    ------
    ValueError
        ``weights`` is not a name torchvision knows (e.g. ``"DEFAULT"``, ``"IMAGENET1K_V1"``).
    """
    import torch
    from torchvision.models import resnet18

    model = resnet18(weights=weights)
    if freeze_backbone:
        for p in model.parameters():
            p.requires_grad_(False)
    model.fc = torch.nn.Linear(model.fc.in_features, num_classes)  # new layers train in any case
    return model


def make_transform(image_size: int):
    """Resize to ``image_size`` squared, random horizontal flip, ImageNet normalisation."""
    from torchvision import transforms

    return transforms.Compose([transforms.Resize((image_size, image_size)), transforms.RandomHorizontalFlip(),
                               transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def train(dataset, epochs: int, batch_size: int, lr: float, weights: str | None, freeze_backbone: bool,
          loader_workers: int = 2) -> dict:
    """One rank: fine-tune ResNet-18 on its share of ``dataset``; report loss and accuracy every step.

    Returns ``{"rank", "loss", "accuracy", "images", "checkpoint"}`` for the last
    epoch, loss and accuracy averaged over all ranks.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    with dask_ddp.rank_zero_first():  # with weights=..., one download; the others find it in the cache
        model = build_model(len(dataset.classes), weights, freeze_backbone).to(ctx.device)
    model = DDP(model, device_ids=ctx.device_ids)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size, sampler=sampler, num_workers=loader_workers,
                        persistent_workers=loader_workers > 0)
    checkpoint = None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        total_loss, correct, seen = 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hits = int((logits.argmax(1) == y).sum())
            total_loss, correct, seen = total_loss + loss.item() * len(y), correct + hits, seen + len(y)
            dask_ddp.report(loss=loss, accuracy=hits / len(y), epoch=epoch)
        loss_mean = dask_ddp.all_reduce_mean(total_loss / max(seen, 1))
        acc_mean = dask_ddp.all_reduce_mean(correct / max(seen, 1))
        if ctx.rank == 0:
            print(f"epoch {epoch + 1}/{epochs}: loss {loss_mean:.4f}, accuracy {acc_mean:.3f}", flush=True)
        if ctx.checkpoint_dir:
            state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1,
                     "classes": list(dataset.classes)}
            checkpoint = dask_ddp.save_checkpoint(state, step=epoch + 1, keep=2) or checkpoint
    return {"rank": ctx.rank, "loss": loss_mean, "accuracy": acc_mean, "images": seen, "checkpoint": checkpoint}


def main(data_url: str, storage_options: dict | None = None, epochs: int = 1, image_size: int = 32,
         batch_size: int = 16, lr: float = 1e-3, weights: str | None = None, freeze_backbone: bool = False,
         client=None, scheduler: str | None = None, n_workers: int = 2, checkpoint_dir: str | None = None,
         loader_workers: int = 2, progress: bool = True) -> dict:
    """List the ImageFolder at ``data_url`` once, train on every worker of the cluster, return rank 0's result.

    The cluster is ``client``, else the scheduler at ``scheduler``, else a
    local ``LocalCluster(n_workers, threads_per_worker=1)`` started and
    stopped here. The returned dict (see :func:`train`) also holds ``metrics``,
    the job's per-step DataFrame.

    Raises
    ------
    FileNotFoundError, PermissionError
        ``data_url`` is missing or refused (the message names it).
    Exception
        The root cause when a rank failed, re-raised with its type.
    """
    import contextlib

    from dask.distributed import Client, LocalCluster

    dataset = S3ImageFolder(data_url, transform=make_transform(image_size), storage_options=storage_options)
    print(f"{len(dataset)} images of {len(dataset.classes)} classes under {data_url}", flush=True)
    with contextlib.ExitStack() as stack:
        if client is None and scheduler is None:
            cluster = stack.enter_context(LocalCluster(n_workers=n_workers, threads_per_worker=1,
                                                       host="127.0.0.1", dashboard_address="127.0.0.1:0"))
        client = client or stack.enter_context(Client(scheduler or cluster))
        job = dask_ddp.dispatch.run(client, train, dataset, epochs, batch_size, lr, weights, freeze_backbone,
                                    loader_workers, checkpoint_dir=checkpoint_dir, progress=progress,
                                    checkpoint_options=_options_for(checkpoint_dir, storage_options))
        first = job.result()[0]
        return dict(first, metrics=job.metrics)


def _options_for(url: str | None, storage_options: dict | None) -> dict | None:
    """The data's storage options serve an s3:// checkpoint folder too (same endpoint and credentials)."""
    return storage_options if url and url.startswith(("s3://", "s3a://")) else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_url", help="s3://bucket/prefix of an ImageFolder tree (<class>/<image>)")
    parser.add_argument("--endpoint-url", help="S3 endpoint (MinIO, moto, ...); credentials from the environment")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=32, help="default 32 (224 for ImageNet weights)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weights", default=None, help="torchvision weights name, e.g. DEFAULT (downloads)")
    parser.add_argument("--freeze-backbone", action="store_true", help="train the new classifier only")
    parser.add_argument("--scheduler", help="Dask scheduler address; default a local cluster")
    parser.add_argument("--workers", type=int, default=2, help="size of the local cluster (default 2)")
    parser.add_argument("--checkpoint-dir", help="fsspec URL for a checkpoint per epoch")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    options = {"client_kwargs": {"endpoint_url": args.endpoint_url}} if args.endpoint_url else None
    result = main(args.data_url, options, epochs=args.epochs, image_size=args.image_size,
                  batch_size=args.batch_size, lr=args.lr, weights=args.weights,
                  freeze_backbone=args.freeze_backbone, scheduler=args.scheduler, n_workers=args.workers,
                  checkpoint_dir=args.checkpoint_dir)
    print(f"final: loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f}"
          + (f", checkpoint {result['checkpoint']}" if result["checkpoint"] else ""))
    sys.exit(0)
