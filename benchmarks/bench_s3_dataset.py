"""Throughput of one DataLoader epoch over S3 (moto on 127.0.0.1): S3ImageFolder against its baselines.

Usage::

    python benchmarks/bench_s3_dataset.py [--n 2000] [--batch 64] [--workers 2] [--repeat 1]

Starts a moto S3 server in its own process (so it does not share a GIL with the
client being measured), uploads ``n`` random-ish 128x128 JPEGs in 10 classes,
writes the same files to a temporary local folder, then times one epoch
(batch ``--batch``, ``--workers`` DataLoader workers, ``ToTensor`` only) for:

a. ceiling: every object fetched by one s3fs ``cat`` (GET only, no decoding)
b. dpd: dask-pytorch-ddp 0.2.2's approach, re-implemented here (boto3 listing;
   per item a new boto3 resource, a download into a temp file, PIL)
c. local: torchvision ``ImageFolder`` on the local copy
d. cold: ``S3ImageFolder``
e. cached: ``S3ImageFolder(cache=...)``, second epoch (the first fills the cache)

Each ratio is taken within a round, between neighbouring runs (the reference
is timed just before and just after, and their mean is used); with
``--repeat N`` the median of the N rounds' ratios is reported (all rounds are
printed). This keeps the drifting load of other processes on a shared machine
out of the ratios as far as it can.
"""

from __future__ import annotations

import argparse
import io
import logging
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from PIL import Image

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


def _serve(conn) -> None:
    """Child process: a moto server on 127.0.0.1, on a port it binds itself, until told to stop."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    conn.recv()
    server.stop()


def _jpeg(rng: np.random.RandomState, label: int) -> bytes:
    """A 128x128 JPEG: a class-tinted gradient plus noise (compresses like a photo, ~10 KB)."""
    y, x = np.mgrid[0:128, 0:128]
    base = np.stack([x * (1 + label % 3), y * (1 + label % 4), (x + y) // 2], axis=-1) % 256
    pixels = np.clip(base + rng.randint(-40, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class DpdStyleDataset:
    """dask-pytorch-ddp 0.2.2's S3ImageFolder, re-implemented (endpoint from AWS_ENDPOINT_URL_S3)."""

    def __init__(self, bucket: str, prefix: str, transform=None):
        import boto3

        self.bucket, self.transform = bucket, transform
        pages = boto3.client("s3").get_paginator("list_objects").paginate(Bucket=bucket, Prefix=prefix)
        self.files = [obj["Key"] for page in pages for obj in page["Contents"]]
        self.classes = sorted({os.path.basename(os.path.dirname(f)) for f in self.files})
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx: int):
        import boto3

        path = self.files[idx]
        label = self.class_to_idx[os.path.basename(os.path.dirname(path))]
        with tempfile.TemporaryFile() as f:
            boto3.resource("s3").Bucket(self.bucket).download_fileobj(path, f)
            f.seek(0)
            img = Image.open(f).convert("RGB")
        return (self.transform(img) if self.transform else img), label


def _epoch(dataset, batch: int, workers: int) -> float:
    """Seconds for one full pass of a DataLoader over ``dataset`` (worker start-up included)."""
    from torch.utils.data import DataLoader

    start, seen = time.perf_counter(), 0
    for _, y in DataLoader(dataset, batch_size=batch, num_workers=workers):
        seen += len(y)
    assert seen == len(dataset), (seen, len(dataset))
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="number of images")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all five runs; ratios are per-round medians")
    args = parser.parse_args(argv)

    import s3fs
    import torch
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import ToTensor

    from dask_ddp.data import S3ImageFolder

    parent, child = mp.get_context("spawn").Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(child,), daemon=True)
    server.start()
    host, port = parent.recv()
    endpoint = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint  # for the boto3-only baseline
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, s3fs {s3fs.__version__}, "
          f"{os.cpu_count()} cpus, moto at {endpoint} (own process); n={args.n} batch={args.batch} "
          f"workers={args.workers}", flush=True)

    rng = np.random.RandomState(0)
    files = {f"train/class{i % 10}/img{i:05d}.jpg": _jpeg(rng, i % 10) for i in range(args.n)}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"max_pool_connections": 64}, **opts)
    fs.mkdir("bench")
    start = time.perf_counter()
    fs.pipe({f"bench/{k}": v for k, v in files.items()})
    print(f"uploaded {args.n} objects ({sum(map(len, files.values())) / 1e6:.1f} MB) "
          f"in {time.perf_counter() - start:.1f}s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for rel, blob in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, "local", rel)), exist_ok=True)
            with open(os.path.join(tmp, "local", rel), "wb") as f:
                f.write(blob)
        tf, rates = ToTensor(), {}

        def report(name, seconds, extra=""):
            rates.setdefault(name, []).append(args.n / seconds)
            print(f"{name:8s} {args.n / seconds:8.1f} images/s  ({seconds:6.2f}s){extra}", flush=True)

        paths = [f"bench/{k}" for k in files]
        local = ImageFolder(os.path.join(tmp, "local", "train"), transform=tf)

        def ceiling():
            start = time.perf_counter()
            fs.cat(paths, max_concurrency=1)  # GET only: max_concurrency=1 skips s3fs's HEAD
            return time.perf_counter() - start

        for round_ in range(1, args.repeat + 1):
            # Each compared pair is measured as A B A, and B is set against the mean of the two A's:
            # on a shared machine the load of other processes drifts less within such a bracket.
            print(f"-- round {round_}/{args.repeat} (load average {os.getloadavg()[0]:.1f})", flush=True)
            before = ceiling()
            start = time.perf_counter()
            cold = S3ImageFolder("s3://bench/train", transform=tf, storage_options=opts)
            listed = time.perf_counter() - start
            seconds = _epoch(cold, args.batch, args.workers)
            after = ceiling()
            report("ceiling", (before + after) / 2, f"  s3fs cat of all objects, no decoding "
                   f"(mean of {args.n / before:.1f} before and {args.n / after:.1f} after cold)")
            report("cold", seconds, f"  S3ImageFolder (listing {listed:.2f}s)")

            start = time.perf_counter()
            dpd = DpdStyleDataset("bench", "train/", transform=tf)
            listed = time.perf_counter() - start
            report("dpd", _epoch(dpd, args.batch, args.workers), f"  dask-pytorch-ddp 0.2.2 style (listing {listed:.2f}s)")

            cached = S3ImageFolder("s3://bench/train", transform=tf, storage_options=opts, index=cold.index,
                                   cache=os.path.join(tmp, f"cache{round_}"))
            fill = _epoch(cached, args.batch, args.workers)
            print(f"{'(fill)':8s} {args.n / fill:8.1f} images/s  ({fill:6.2f}s)  first epoch with cache=, filling it")
            before = _epoch(local, args.batch, args.workers)
            seconds = _epoch(cached, args.batch, args.workers)
            after = _epoch(local, args.batch, args.workers)
            report("local", (before + after) / 2, f"  torchvision ImageFolder on local disk "
                   f"(mean of {args.n / before:.1f} before and {args.n / after:.1f} after cached)")
            report("cached", seconds, "  S3ImageFolder(cache=...), 2nd epoch")

    print(f"\nmedian of {args.repeat} round(s), images/s: "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in rates.items()))
    for name, num, den, goal in [("cold/ceiling", "cold", "ceiling", 0.9), ("cold/dpd", "cold", "dpd", 2.0),
                                 ("cached/local", "cached", "local", 0.9)]:
        per_round = [a / b for a, b in zip(rates[num], rates[den])]
        ratio = statistics.median(per_round)
        print(f"{name:13s} {ratio:5.2f}  (goal >= {goal}: {'met' if ratio >= goal else 'NOT met'}; "
              f"per round: {', '.join(f'{r:.2f}' for r in per_round)})")
    parent.send("stop")
    server.join(timeout=10)


if __name__ == "__main__":
    main()
