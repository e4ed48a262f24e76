"""Images/s into the GPU from a StreamingDataset: JPEGs decoded on the GPU (nvJPEG) against the CPU path (PIL).

Usage (on a GPU machine; ``--device cpu`` runs the same code on the CPU as a check of the script)::

    python benchmarks/bench_streaming_gpu.py [--images 4000] [--small 20000] [--workers 4,12] [--batch 128]
        [--rounds 2] [--device cuda] [--out RESULTS_streaming_gpu.md]

Two datasets of seeded photo-like JPEGs written as shards by ``write_shards`` on local disk (read once before
timing, so the page cache holds them: this measures the decode path, not S3): ``--images`` ImageNet-like
500x375 JPEGs (~110 KB) resized to 224x224, and ``--small`` 96x96 JPEGs (~4 KB, the CPU benchmark's size) kept
at their size. One process, one rank, batch ``--batch``; per epoch, images/s until the last batch is a float
tensor on the device (``torch.cuda.synchronize``), DataLoader workers' start included on both sides:

- ``cpu, W workers``: ``StreamingDataset``'s default decoder (PIL, RGB) and a PIL bilinear resize in ``W``
  DataLoader workers, ``pil_to_tensor``, pinned memory, ``.to(device, non_blocking=True)``, ``/ 255``;
- ``gpu, W workers``: ``decoder=encoded_bytes``, ``collate_fn=collate_encoded`` (the workers only cut bytes out
  of shards into one buffer a batch), then ``decode_images(batch, device, size=(224, 224))`` in the rank
  (nvJPEG, antialiased bilinear resize on the GPU), ``/ 255``.

One untimed epoch of each path first (CUDA's and nvJPEG's start, the page cache, the disk's writeback of the
fresh shards: the first run on an H200 saw round 0 at a quarter of round 1 without it); then rounds that
alternate the order of the paths; the table gives the median and each round.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dask_ddp.data import StreamingDataset, collate_encoded, decode_images, encoded_bytes, write_shards

SIZE = (224, 224)


def photo(i: int, h: int, w: int) -> bytes:
    """A smooth gradient with noise: ~110 KB at 500x375, quality 92 (ImageNet's mean JPEG is about that)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(i)
    arr = np.stack([(x * 0.5 + i * 7) % 256, (y * 0.6 + i * 3) % 256, (x * 0.3 + y * 0.2 + i) % 256], -1)
    arr = arr + rng.integers(0, 72 if h > 100 else 24, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def _write(args: tuple) -> int:
    root, i, h, w = args
    data = photo(i, h, w)
    Path(f"{root}/c{i % 10}/im{i:06d}.jpg").write_bytes(data)
    return len(data)


def make(root: str, n: int, h: int, w: int) -> tuple[str, float]:
    for c in range(10):
        os.makedirs(f"{root}/src/c{c}", exist_ok=True)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        sizes = list(pool.map(_write, [(f"{root}/src", i, h, w) for i in range(n)], chunksize=64))
    write_shards(f"{root}/src", f"{root}/shards", shard_size="64MB", client=False, progress=False)
    for p in Path(f"{root}/shards").iterdir():
        p.read_bytes()  # into the page cache
    return f"{root}/shards", statistics.mean(sizes)


class PilResize:
    """PIL bilinear resize then ``pil_to_tensor`` (uint8 CHW), or no resize when ``size`` is None."""

    def __init__(self, size):
        self.size = size

    def __call__(self, img):
        from torchvision.transforms.functional import pil_to_tensor

        if self.size is not None:
            img = img.resize((self.size[1], self.size[0]), Image.BILINEAR)
        return pil_to_tensor(img)


def epoch(url: str, path: str, workers: int, batch: int, device: str, size) -> float:
    """Images/s of one epoch into ``device`` as float batches."""
    if path == "cpu":
        ds = StreamingDataset(url, transform=PilResize(size), seed=1)
        loader = ds.loader(batch, num_workers=workers, rank=0, world_size=1, pin_memory=device == "cuda")
    else:
        ds = StreamingDataset(url, decoder=encoded_bytes, seed=1)
        loader = ds.loader(batch, num_workers=workers, rank=0, world_size=1, collate_fn=collate_encoded)
    n, t = 0, time.perf_counter()
    for data, _ in loader:
        if path == "cpu":
            x = data.to(device, non_blocking=True).float().div_(255)
        else:
            x = decode_images(data, device=device, size=size).float().div_(255)
        n += x.shape[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--small", type=int, default=20000)
    ap.add_argument("--workers", default="4,12")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run it on a GPU machine, or with --device cpu to check the script")
    workers = [int(w) for w in a.workers.split(",")]
    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    lines = [f"# Images/s into the {a.device} from StreamingDataset: GPU decode vs the CPU path", "",
             f"`python benchmarks/bench_streaming_gpu.py --images {a.images} --small {a.small} --workers {a.workers} "
             f"--batch {a.batch} --rounds {a.rounds}` on {name}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
             f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. One rank, batch {a.batch}; medians of "
             f"{a.rounds} alternating rounds (each round in brackets).", ""]
    with tempfile.TemporaryDirectory(prefix="bench-gpu-decode-") as tmp:
        for label, n, (h, w), size in (("500x375 JPEGs resized to 224x224", a.images, (375, 500), SIZE),
                                       ("96x96 JPEGs", a.small, (96, 96), None)):
            if n <= 0:
                continue
            t = time.perf_counter()
            url, mean = make(f"{tmp}/{h}x{w}", n, h, w)
            print(f"{label}: {n} images, {mean / 1e3:.1f} KB each, made in {time.perf_counter() - t:.1f} s", flush=True)
            runs: dict[str, list[float]] = {}
            for path in ("cpu", "gpu"):
                epoch(url, path, max(workers), a.batch, a.device, size)  # untimed warm-up
            for r in range(a.rounds):
                paths = [("cpu", W) for W in workers] + [("gpu", W) for W in workers]
                for path, W in (paths if r % 2 == 0 else paths[::-1]):
                    ips = epoch(url, path, W, a.batch, a.device, size)
                    runs.setdefault(f"{path}, {W} workers", []).append(ips)
                    print(f"  round {r}: {path}, {W} workers: {ips:,.0f} images/s", flush=True)
            best_cpu = max(statistics.median(v) for k, v in runs.items() if k.startswith("cpu"))
            lines += [f"## {label}: {n:,} images, {mean / 1e3:.1f} KB each", "",
                      "| path | images/s | vs the best CPU path |", "|---|---:|---:|"]
            for k, v in runs.items():
                med = statistics.median(v)
                lines.append(f"| {k} | **{med:,.0f}** ({' / '.join(f'{x:,.0f}' for x in v)}) | {med / best_cpu:.2f}x |")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
