"""Runs in: the user's shell (``dask-ddp demo``: data, cluster, job) and every rank (:func:`train`).

``dask-ddp demo``: a real image-classification training with DDP, from images on S3, in one command.

Nothing is downloaded. scikit-learn's bundled 8x8 digits (1,797 images) are
written as PNGs in an ImageFolder tree (``train/<digit>/<i>.png``,
``test/<digit>/<i>.png``, every fifth image in ``test``) and uploaded to an
S3 endpoint (an embedded moto server on 127.0.0.1 unless ``--data`` names a
bucket). A small CNN is trained with DistributedDataParallel on a local Dask
cluster (or ``--scheduler``), each rank reading its share through
:class:`dask_ddp.data.S3ImageFolder` with a ``DistributedSampler`` and a
``DataLoader(num_workers=2)``. The dataset is listed once, here, and ships
to the ranks with its listing; the first epoch reads from S3 into a
per-job local cache that later epochs read from. Loss and accuracy stream
back with :func:`dask_ddp.report`; each epoch is checkpointed with
:func:`dask_ddp.save_checkpoint`; the metrics end in a CSV file.

torch, torchvision (through :mod:`dask_ddp.data`), scikit-learn, moto and fsspec
are imported in the functions that use them: 0.1 s to seconds to import, the
last two optional (``dask-ddp[demo]``), while ``dask-ddp --help`` and every rank
of ``dask-ddp run`` (through the ``dask_ddp.cli`` package) import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Callable, Iterator

import dask_ddp
from dask_ddp.cli.common import (
    EXIT_FAILED,
    add_cluster_arguments,
    open_client,
    usage_error,
    wait_for,
)
from dask_ddp.wire.errors import PlanError

__all__ = ["run_demo", "digits_images", "upload", "embedded_s3", "build_model", "train", "add_parser", "main"]

BUCKET = "dask-ddp-demo"
CREDENTIALS = {"key": "testing", "secret": "testing"}  # moto accepts any; these are its documented ones

DESCRIPTION = """\
Train a small CNN with PyTorch DDP on scikit-learn's 8x8 digits, read as PNG
images from S3, on a local Dask cluster: an embedded S3 server (moto) on
127.0.0.1 is started and filled unless --data names a bucket prefix. Prints
the loss of every epoch and ends with the test accuracy (about 95% or more)
and where the checkpoints and metrics went. Nothing is downloaded.
"""

EPILOG = """\
examples:
  dask-ddp demo                                   # 2 local workers, embedded S3, 5 epochs, about a minute
  dask-ddp demo --epochs 2 --out /tmp/demo
  dask-ddp demo --scheduler tcp://127.0.0.1:8786  # workers on this machine (the embedded S3 is on 127.0.0.1)
  dask-ddp demo --data s3://my-bucket/digits --endpoint-url http://127.0.0.1:9000   # uploads if missing
"""


def add_parser(commands) -> None:
    """Add the ``demo`` command and its options to ``commands`` (what ``add_subparsers`` returned).

    Raises
    ------
    argparse.ArgumentError
        ``commands`` has a ``demo`` command already.
    """
    parser = commands.add_parser(
        "demo", help="train a CNN with DDP on digits read from S3 (all local, about a minute)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(parser, "a LocalCUDACluster with a GPU and dask-cuda, else a LocalCluster")
    parser.add_argument("--epochs", type=int, default=5, help="epochs to train (default 5)")
    parser.add_argument("--data", metavar="URL",
                        help="s3://bucket/prefix holding train/ and test/ ImageFolder trees (uploaded there if "
                             "train/ is missing); credentials from the environment; default: an embedded "
                             "S3 server on 127.0.0.1")
    parser.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint for --data (e.g. MinIO)")
    parser.add_argument("--out", default="dask-ddp-demo", metavar="DIR",
                        help="folder for the metrics CSV and, unless --checkpoint-dir, the checkpoints "
                             "(default ./dask-ddp-demo)")
    parser.add_argument("--checkpoint-dir", metavar="URL",
                        help="where checkpoints go (any fsspec URL the workers can write; default OUT/checkpoints)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed CLI arguments; return the exit code (0, 1 failed, 2 usage, 130 interrupted).

    Raises
    ------
    KeyboardInterrupt
        Outside the training itself (the CLI turns it into exit code 130).
    """
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            return usage_error("demo", f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data is not None and not args.data.startswith(("s3://", "s3a://")):
        return usage_error("demo", f"--data takes an s3:// URL, got {args.data!r}")
    options = {"client_kwargs": {"endpoint_url": args.endpoint_url}} if args.endpoint_url else {}
    try:
        result = run_demo(epochs=args.epochs, workers=args.workers, data=args.data, storage_options=options,
                          scheduler=args.scheduler, out=args.out, checkpoint_dir=args.checkpoint_dir,
                          batch_size=args.batch_size, lr=args.lr, connect_timeout=args.connect_timeout)
    except PlanError as exc:  # e.g. more --workers than the cluster has
        return usage_error("demo", str(exc))
    except OSError as exc:  # the scheduler, the S3 endpoint or the bucket cannot be reached
        print(f"dask-ddp demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return result["exit_code"]


def run_demo(*, epochs: int = 5, workers: int | None = None, data: str | None = None,
             storage_options: dict | None = None, scheduler: str | None = None, out: str = "dask-ddp-demo",
             checkpoint_dir: str | None = None, batch_size: int = 32, lr: float = 0.01,
             connect_timeout: float = 30, echo: Callable[[str], None] = print) -> dict:
    """Run the whole demo; return ``exit_code``, ``test_accuracy``, ``checkpoint``, ``metrics``, ``seconds`` in a dict.

    Parameters are those of ``dask-ddp demo`` (see ``dask-ddp demo --help``);
    ``data=None`` starts the embedded S3 server, ``scheduler=None`` a local cluster.

    Raises
    ------
    OSError
        The scheduler or the S3 endpoint cannot be reached; PermissionError or
        FileNotFoundError for ``data`` (the message names the URL).
    PlanError
        ``workers`` is more than the cluster has.
    """
    started = time.monotonic()
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    checkpoint_dir = checkpoint_dir or os.path.join(out, "checkpoints")
    with contextlib.ExitStack() as stack:
        if data is None:
            data, storage_options = _embedded_data(stack, scheduler, echo)
        storage_options = dict(storage_options or {})
        _ensure_digits(data, storage_options, echo)
        client = stack.enter_context(open_client(scheduler, workers, connect_timeout=connect_timeout))
        job, metrics = _start(client, data, storage_options, checkpoint_dir, out, epochs, batch_size, lr,
                              workers if scheduler else None, echo)
        code = wait_for(job, "dask-ddp demo")
        metrics.on_finish(job)  # idempotent: the file is whole now, whenever the job's own call runs
    return _summary(job, code, metrics.url, time.monotonic() - started, echo)


def _embedded_data(stack: contextlib.ExitStack, scheduler: str | None, echo) -> tuple[str, dict]:
    endpoint = stack.enter_context(embedded_s3())
    echo(f"embedded S3 server (moto) at {endpoint}")
    if scheduler:
        echo("note: it listens on 127.0.0.1 only, so the workers of --scheduler must run on this machine "
             "(else give --data s3://...)")
    return f"s3://{BUCKET}/digits", dict(CREDENTIALS, client_kwargs={"endpoint_url": endpoint})


def _start(client, data, storage_options, checkpoint_dir, out, epochs, batch_size, lr, workers, echo):
    """List the data once, start the job with a CSV sink for its metrics; return ``(job, sink)``."""
    from dask_ddp.client import dispatch  # here, not at the top: `dask-ddp --help` imports no distributed
    from dask_ddp.client.cluster import scheduler_workers
    from dask_ddp.observe.sinks import CSVSink

    train_set, test_set = _datasets(data, storage_options)
    world = workers or len(scheduler_workers(client))
    steps = epochs * math.ceil(math.ceil(len(train_set) / world) / batch_size)  # per rank: the bar's end
    echo(f"training {epochs} epochs on {world} ranks: {len(train_set)} train / {len(test_set)} test images "
         f"from {data}; checkpoints to {checkpoint_dir}")
    metrics = CSVSink(os.path.join(out, "metrics.csv"))  # rows stream in as the ranks report
    job = dispatch.run(client, train, train_set, test_set, epochs, batch_size, lr, workers=workers, total=steps,
                       checkpoint_dir=checkpoint_dir, callbacks=[metrics], name=f"demo-{uuid.uuid4().hex[:6]}",
                       checkpoint_options=_checkpoint_options(checkpoint_dir, storage_options))
    return job, metrics


def _summary(job, code: int, metrics_url: str, seconds: float, echo) -> dict:
    result = {"exit_code": code, "seconds": seconds, "metrics": metrics_url, "test_accuracy": None,
              "checkpoint": None}
    if code == 0:
        first = job.result(progress=False)[0]
        result.update(test_accuracy=first["test_accuracy"], checkpoint=first["checkpoint"])
        echo(f"test accuracy: {first['test_accuracy']:.3f} ({first['correct']}/{first['test_images']} test "
             f"images), {first['epochs']} epochs on {job.plan.world_size} ranks in {seconds:.0f} s")
        echo(f"checkpoint: {first['checkpoint']}")
    echo(f"metrics: {metrics_url} ({len(job.metrics)} rows: {', '.join(job.metrics.columns)})")
    return result


def _checkpoint_options(checkpoint_dir: str, storage_options: dict) -> dict:
    # an s3:// checkpoint dir beside the data takes the data's endpoint and credentials
    return dict(storage_options) if checkpoint_dir.startswith(("s3://", "s3a://")) else {}


# ---- data --------------------------------------------------------------------------------------------------

def digits_images(test_every: int = 5) -> dict[str, bytes]:
    """scikit-learn's 8x8 digits as PNG bytes keyed ``train/<digit>/<i>.png`` / ``test/<digit>/<i>.png``.

    Every ``test_every``-th image goes to ``test`` (an 80/20 split for 5),
    which keeps every class in both splits.

    Raises
    ------
    ValueError
        ``test_every`` is less than 2.
    ImportError
        scikit-learn is not installed (``pip install 'dask-ddp[demo]'``).
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    if test_every < 2:
        raise ValueError(f"test_every must be >= 2 (every n-th image is a test image), got {test_every}")
    digits = load_digits()
    files = {}
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        buf = io.BytesIO()
        Image.fromarray((image * (255 / 16)).round().astype(np.uint8), mode="L").save(buf, format="PNG")
        files[f"{'test' if i % test_every == 0 else 'train'}/{label}/{i:04d}.png"] = buf.getvalue()
    return files


def upload(files: dict[str, bytes], url: str, storage_options: dict | None = None) -> None:
    """Write ``files`` (relative key -> bytes) under the fsspec ``url``, concurrently; create the bucket if needed.

    Raises
    ------
    PermissionError, OSError
        The endpoint refused the writes or cannot be reached.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    bucket = root.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.pipe({f"{root.rstrip('/')}/{key}": blob for key, blob in files.items()})


def _ensure_digits(data: str, storage_options: dict, echo) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(data, **storage_options)
    if fs.exists(f"{root}/train"):
        echo(f"using the images under {data}")
        return
    t = time.monotonic()
    files = digits_images()
    upload(files, data, storage_options)
    echo(f"uploaded {len(files)} digit images (8x8 PNG, ImageFolder layout) to {data} "
         f"in {time.monotonic() - t:.0f} s")


def _transform():
    from torchvision import transforms

    return transforms.Compose([transforms.Grayscale(), transforms.ToTensor()])


def _datasets(data: str, storage_options: dict):
    """Both splits, listed once here; the listings travel to the ranks inside the pickled datasets."""
    from dask_ddp.data.image_folder import S3ImageFolder

    return tuple(S3ImageFolder(f"{data}/{split}", transform=_transform(), storage_options=storage_options)
                 for split in ("train", "test"))


@contextlib.contextmanager
def embedded_s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a port the OS picks) for the block; yields its endpoint URL.

    Raises
    ------
    ImportError
        moto is not installed (``pip install 'dask-ddp[demo]'``).
    """
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise ImportError("the demo's embedded S3 server needs moto: pip install 'dask-ddp[demo]' "
                          "(or give --data s3://...)") from exc
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# ---- the training function (runs on every rank) ------------------------------------------------------------

def build_model():
    """The demo's CNN for 1x8x8 images: two 3x3 convolutions, a 2x2 max-pool, two linear layers (about 40k weights).

    Raises nothing.
    """
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train(train_set, test_set, epochs: int, batch_size: int, lr: float) -> dict:
    """One rank of the demo's training (the function given to ``dask_ddp.dispatch.run``).

    Returns ``{"rank", "epochs", "test_accuracy", "correct", "test_images", "checkpoint"}``;
    the accuracy is over the whole test split (every rank returns the same).

    Raises
    ------
    NotInRankError
        Outside a dask-ddp rank.
    OSError
        Reading the images failed (the message names the URL).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    ctx = dask_ddp.get_context()
    dask_ddp.seed_everything(0)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.local_world_size))  # ranks share the host's cores
    cache = os.path.join(tempfile.gettempdir(), f"dask-ddp-demo-cache-{ctx.run_id}")
    train_set, test_set = _with_cache(train_set, cache), _with_cache(test_set, cache)
    model = DDP(build_model().to(ctx.device), device_ids=ctx.device_ids)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, batch_size, sampler=sampler, num_workers=2, persistent_workers=True)
    checkpoint = None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        started, losses, correct, seen = time.monotonic(), 0.0, 0, 0
        for x, y in loader:
            x, y = x.to(ctx.device), y.to(ctx.device)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hits = int((logits.argmax(1) == y).sum())
            losses, correct, seen = losses + loss.item() * len(y), correct + hits, seen + len(y)
            dask_ddp.report(loss=loss, accuracy=hits / len(y), epoch=epoch)
        loss_mean, acc_mean = dask_ddp.all_reduce_mean(losses / seen), dask_ddp.all_reduce_mean(correct / seen)
        state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1}
        checkpoint = dask_ddp.save_checkpoint(state, step=epoch + 1, keep=2) or checkpoint
        if ctx.rank == 0:
            print(f"epoch {epoch + 1}/{epochs}: loss {loss_mean:.4f}, train accuracy {acc_mean:.3f} "
                  f"({time.monotonic() - started:.1f} s)")
    hits, total = _evaluate(model.module, test_set, ctx)
    torch.distributed.barrier()  # every rank on this host is done with the cache
    if ctx.local_rank == 0:
        shutil.rmtree(cache, ignore_errors=True)
    return {"rank": ctx.rank, "epochs": epochs, "test_accuracy": hits / total, "correct": hits,
            "test_images": total, "checkpoint": checkpoint}


def _with_cache(dataset, cache: str):
    """The same dataset (same listing: no new LIST) reading through a local cache after the first epoch."""
    from dask_ddp.data.image_folder import S3ImageFolder

    return S3ImageFolder(dataset.root, transform=dataset.transform, storage_options=dataset.storage_options,
                         index=dataset.index, cache=cache)


def _evaluate(model, test_set, ctx) -> tuple[int, int]:
    """Correct predictions and images over the whole test split: each rank takes every world_size-th image."""
    import torch
    from torch.utils.data import DataLoader, Subset

    mine = Subset(test_set, range(ctx.rank, len(test_set), ctx.world_size))
    counts = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(mine, batch_size=128):
            x, y = x.to(ctx.device), y.to(ctx.device)
            counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=ctx.device)])
    torch.distributed.all_reduce(counts)
    return int(counts[0]), int(counts[1])
