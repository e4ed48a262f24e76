"""Streaming data from S3 (moto on 127.0.0.1): dask-ddp's StreamingDataset against LitData, WebDataset, Mosaic.

Usage (in the benchmark venv, see below)::

    /work/bench-venv/bin/python benchmarks/bench_streaming.py [--images 20000] [--repeat 2]
        [--only ours,raw,litdata,wds,mosaic,folder,ceiling,decode,floor] [--quick]
        [--out benchmarks/RESULTS_streaming.md]

One command: starts a moto S3 server in its own process, generates ``--images`` seeded 96x96 JPEGs
(a few KB each) in 10 class folders, uploads them to ``s3://bench/images``, builds each system's shards
from the same images into the same server (timed: ours with ``write_shards`` on a LocalCluster of 2
worker processes, LitData's ``optimize`` with 2 workers; WebDataset's and Mosaic's writers run untimed
from the local copy), then, per round, for each system: 2 rank processes (gloo group, RANK/WORLD_SIZE
env) x 2 DataLoader workers, batch 64, the same transform (PIL decode + ``ToTensor`` in the workers'
collate), images/s of a cold first epoch (fresh cache) and a second epoch (cache where the system has
one). Beside them:

- ``raw``: ours with nothing decoded (the sample's bytes handed to the collate, which counts them): the I/O
  path (fetch, node cache, order, hand-over to the rank) against the byte ceiling;
- ``folder``: dask-ddp's ``S3ImageFolder`` (one GET per image, DistributedSampler, ``cache=``);
- ``ceiling``: the byte ceiling, s3fs ``cat`` of the same shard objects (ours when built, else LitData's)
  from 2 processes at once, no decoding, as images/s (images / seconds) and MB/s;
- ``decode``: the decode ceiling, 2 processes decoding the same JPEGs from memory with the same collate;
- ``floor``: the build floor, 2 processes GETting every source image once, one GET after another (what any
  builder reading the images from S3 must do, nothing packed or written).

A system that fails is reported as failed with its reason; the run goes on. The table (per-round
figures, medians, ratios, goals) goes to ``--out`` with the command, load average and versions.

Setup (peers need their own venv: mosaicml-streaming pins numpy below the main venv's)::

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install torch==2.14.1 torchvision==0.29.1
    /work/bench-venv/bin/pip install litdata webdataset mosaicml-streaming s3fs 'moto[server]' dask distributed \\
        pillow tqdm tblib psutil cloudpickle msgpack pyyaml pandas bokeh prometheus_client cryptography
    /work/bench-venv/bin/pip uninstall -y obstore   # LitData 0.2.76 refuses http:// endpoints through obstore
    /work/bench-venv/bin/pip install -e . --no-deps

Endpoints: LitData and boto3 read ``AWS_ENDPOINT_URL``, Mosaic ``S3_ENDPOINT_URL``; WebDataset has no
s3:// opener, so one (a whole-object s3fs GET, like ``pipe:aws s3 cp URL -``) is put in
``webdataset.gopen.gopen_schemes["s3"]``; s3fs and dask-ddp take ``storage_options``.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import streaming_peers as peers  # noqa: E402
from bench_s3_dataset import _serve  # noqa: E402 - the moto server process, as that benchmark runs it

for _k, _v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_REGION": "us-east-1"}.items():
    os.environ.setdefault(_k, _v)

READERS = ["ours", "raw", "litdata", "wds", "mosaic", "folder"]
PEERS = ["litdata", "wds", "mosaic"]
SPAWN = mp.get_context("spawn")


def _jpeg(rng: np.random.RandomState, label: int, size: int) -> bytes:
    """A size x size JPEG: a class-tinted gradient plus noise (compresses like a photo)."""
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * (1 + label % 3), y * (1 + label % 4), (x + y) // 2], axis=-1) % 256
    pixels = np.clip(base + rng.randint(-30, 30, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def make_images(cfg: dict, n: int, size: int) -> int:
    """Write n seeded JPEGs under tmp/images/classNN/ and upload them to s3://bench/images; total bytes."""
    rng, keys, blobs = np.random.RandomState(0), [], {}
    for i in range(n):
        key = f"images/class{i % 10:02d}/img{i:06d}.jpg"
        blob = _jpeg(rng, i % 10, size)
        os.makedirs(os.path.dirname(os.path.join(cfg["tmp"], key)), exist_ok=True)
        with open(os.path.join(cfg["tmp"], key), "wb") as f:
            f.write(blob)
        keys.append(key)
        blobs[f"{cfg['bucket']}/{key}"] = blob
    fs = peers.fs(cfg["endpoint"])
    fs.mkdir(cfg["bucket"])
    start = time.perf_counter()
    fs.pipe(blobs)
    total = sum(map(len, blobs.values()))
    log(f"uploaded {n} images ({total / 1e6:.1f} MB, {total / n / 1e3:.1f} KB each) "
        f"in {time.perf_counter() - start:.1f}s")
    cfg["keys"] = keys
    return total


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(system: str, rank: int, world: int, port: int, cfg: dict, out) -> None:
    """One rank: gloo group, the system's loader, ``cfg['epochs']`` timed epochs; results onto ``out``."""
    import torch.distributed as dist

    # A spawned child inherits "spawn" as its default start method; a rank started by torchrun or dask-ddp has
    # Linux's default, fork, and so do its DataLoader workers (each spawned worker would import torch in the epoch).
    mp.set_start_method("fork", force=True)
    os.environ.update(BENCH_S3_ENDPOINT=cfg["endpoint"], RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AWS_ENDPOINT_URL=cfg["endpoint"])
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
        loader, set_epoch = peers.LOADERS[system](cfg, rank, world)
        for epoch in range(cfg["epochs"]):
            set_epoch(epoch)
            dist.barrier()
            start, seen, shape = time.time(), 0, None
            for x, y in loader:
                seen += len(y)
                shape = tuple(x.shape[1:])
            out.put((rank, epoch, seen, start, time.time(), shape, None))
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported as this system's failure
        out.put((rank, -1, 0, 0.0, 0.0, None, _reason(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reason(e: BaseException) -> str:
    """One line for the table: the exception, with the last line of a DataLoader worker's traceback."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({last.filename.split('/')[-1]}:{last.lineno})" if last else ""
    text = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "") if lines else ""
    return f"{type(e).__name__}: {text[:400]}{where}"


def run_ranks(system: str, cfg: dict) -> dict:
    """Run one system's 2 ranks; per epoch images/s (all ranks' images / first start to last end), or an error."""
    out, port = SPAWN.Queue(), _free_port()
    procs = [SPAWN.Process(target=_rank_main, args=(system, r, cfg["world"], port, cfg, out), daemon=False)
             for r in range(cfg["world"])]
    for p in procs:
        p.start()
    msgs, deadline, error = [], time.monotonic() + cfg["timeout"], None
    try:
        while len(msgs) < cfg["world"] * cfg["epochs"] and error is None:
            try:
                msg = out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                error = f"timed out after {cfg['timeout']}s"
                break
            if msg[6] is not None:
                error = f"rank {msg[0]}: {msg[6]}"
            msgs.append(msg)
    finally:
        for p in procs:
            p.join(timeout=30 if error is None else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if error:
        return {"error": error}
    result = {}
    for epoch in range(cfg["epochs"]):
        ms = [m for m in msgs if m[1] == epoch]
        seen = sum(m[2] for m in ms)
        seconds = max(m[4] for m in ms) - min(m[3] for m in ms)
        result[epoch] = {"seen": seen, "seconds": seconds, "rate": seen / seconds, "shape": ms[0][5]}
    return result


def _get_main(keys: list[str], endpoint: str, barrier, out) -> None:
    """Build floor, one process: one GET after another of its share of the source images (what every builder
    reading them from S3 must do; nothing packed or written)."""
    fs = peers.fs(endpoint)
    barrier.wait()
    start = time.time()
    n = sum(len(fs.cat_file(k, max_concurrency=1)) for k in keys)  # 1: no HEAD before the GET
    out.put((start, time.time(), n))


def _cat_main(paths: list[str], endpoint: str, barrier, out) -> None:
    """Byte ceiling, one process: s3fs cat of its share of the shard objects (GET only, nothing decoded)."""
    fs = peers.fs(endpoint)
    barrier.wait()
    start = time.time()
    got = fs.cat(paths, max_concurrency=1)  # max_concurrency=1: no HEAD before each GET
    out.put((start, time.time(), sum(map(len, got.values()))))


def _decode_main(files: list[str], batch: int, barrier, out) -> None:
    """Decode ceiling, one process: the same collate over JPEG bytes already in memory."""
    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker
    blobs = []
    for path in files:
        with open(path, "rb") as f:
            blobs.append((f.read(), 0))
    barrier.wait()
    start = time.time()
    for i in range(0, len(blobs), batch):  # the fastest path to the same tensors: a batch in one decode_jpeg call
        peers.decode_batch([b for b, _ in blobs[i:i + batch]])
    out.put((start, time.time(), len(blobs)))


def run_pair(target, shares: list[list], *args) -> tuple[float, int]:
    """Run ``target(share, *args, barrier, out)`` in 2 processes at once; (seconds first start to last end, total)."""
    barrier, out = SPAWN.Barrier(len(shares)), SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(share, *args, barrier, out)) for share in shares]
    for p in procs:
        p.start()
    try:
        res = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return max(r[1] for r in res) - min(r[0] for r in res), sum(r[2] for r in res)


def build_all(cfg: dict, systems: list[str], report: dict) -> None:
    """Build each system's shards once; timed builds and failures go into ``report``; then the build floor."""
    for system in [s for s in ("ours", "litdata", "wds", "mosaic") if s in systems]:
        log(f"building {system} shards")
        try:
            seconds = peers.BUILDERS[system](cfg)
            paths = peers.shard_paths(cfg, system)
            report["build"][system] = {"seconds": seconds, "shards": len(paths)}
            log(f"built {system}: {len(paths)} shards" + (f" in {seconds:.1f}s" if seconds else " (untimed)"))
        except BaseException as e:  # noqa: BLE001 - a failed peer is reported, the run goes on
            report["errors"][system] = f"build: {_reason(e)}"
            log(f"{system} build FAILED: {report['errors'][system]}")
    if "floor" in systems:
        keys = [f"{cfg['bucket']}/{k}" for k in cfg["keys"]]
        seconds, _ = run_pair(_get_main, [keys[0::2], keys[1::2]], cfg["endpoint"])
        report["build"]["floor"] = {"seconds": seconds, "shards": 0}
        log(f"build floor: {len(keys)} GETs from 2 processes in {seconds:.1f}s")


def one_round(cfg: dict, systems: list[str], report: dict, round_: int) -> None:
    """One round: every reader (fresh caches), then the byte and decode ceilings."""
    report["load"].append(os.getloadavg()[0])
    for system in [s for s in READERS if s in systems and s not in report["errors"]]:
        if system == "raw" and "ours" not in report["build"]:
            continue
        cfg["cache"] = os.path.join(cfg["tmp"], f"cache-{round_}-{system}")
        for sub in ("", system):
            os.makedirs(os.path.join(cfg["cache"], sub), exist_ok=True)
        if system == "mosaic":
            peers.clean_mosaic_shm()
        res = run_ranks(system, cfg)
        if "error" in res:  # once more, with a fresh cache: a peer's flaky start is noted, not fatal
            report["notes"].append(f"{system}, round {round_}: failed once and was run again: {res['error']}")
            log(f"{system} failed, running it again: {res['error']}")
            shutil.rmtree(cfg["cache"], ignore_errors=True)
            for sub in ("", system):
                os.makedirs(os.path.join(cfg["cache"], sub), exist_ok=True)
            res = run_ranks(system, cfg)
        shutil.rmtree(cfg["cache"], ignore_errors=True)
        if "error" in res:
            report["errors"][system] = f"round {round_}: {res['error']}"
            log(f"{system} FAILED: {res['error']}")
            continue
        for epoch, key in ((0, "cold"), (1, "warm")):
            report["rates"].setdefault(system, {}).setdefault(key, []).append(res[epoch]["rate"])
        report["seen"][system] = [res[e]["seen"] for e in res]
        log(f"{system}: cold {res[0]['rate']:.0f} img/s ({res[0]['seen']} images, {res[0]['seconds']:.1f}s), "
            f"2nd {res[1]['rate']:.0f} img/s ({res[1]['seen']}), batch shape {res[0]['shape']}")
    source = next((s for s in ("ours", "litdata", "wds", "mosaic") if s in report["build"]), None)
    if "ceiling" in systems and source:
        paths = peers.shard_paths(cfg, source)
        seconds, nbytes = run_pair(_cat_main, [paths[0::2], paths[1::2]], cfg["endpoint"])
        report["rates"].setdefault("ceiling", {}).setdefault("cold", []).append(cfg["n"] / seconds)
        report["ceiling_of"], report["ceiling_mbs"] = source, nbytes / seconds / 1e6
        log(f"byte ceiling ({source}'s {len(paths)} shards): {nbytes / seconds / 1e6:.0f} MB/s "
            f"= {cfg['n'] / seconds:.0f} img/s")
    if "decode" in systems:
        files = peers.local_files(cfg)
        seconds, n = run_pair(_decode_main, [files[0::2], files[1::2]], cfg["batch"])
        report["rates"].setdefault("decode", {}).setdefault("cold", []).append(n / seconds)
        log(f"decode ceiling: {n / seconds:.0f} img/s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--size", type=int, default=96, help="image side in pixels")
    parser.add_argument("--shards", type=int, default=16, help="shard size = total image bytes / this")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of all readers; medians reported")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--only", default=",".join(READERS + ["ceiling", "decode", "floor"]))
    parser.add_argument("--quick", action="store_true", help="smoke run: 2,000 images, 1 round")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one system's ranks may take")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "RESULTS_streaming.md"))
    parser.add_argument("--append", action="store_true", help="append this run to --out instead of replacing it")
    parser.add_argument("--decoder", choices=("pil", "tv"), default="pil",
                        help="the peers' per-sample decode: PIL + ToTensor, or decode_jpeg (same tensors)")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.repeat = min(args.images, 2000), 1
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    os.environ["BENCH_DECODER"] = peers.DECODER = args.decoder  # the spawned readers import it from the env
    import streaming_report

    parent, child = SPAWN.Pipe()
    server = SPAWN.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    host, port = parent.recv()
    endpoint = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = endpoint
    tmp = tempfile.mkdtemp(prefix="bench-streaming-")
    cfg = {"endpoint": endpoint, "bucket": "bench", "tmp": tmp, "n": args.images, "batch": args.batch, "workers": 2,
           "world": 2, "epochs": 2, "timeout": args.timeout,
           "storage_options": {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}}
    report = {"build": {}, "errors": {}, "notes": [], "rates": {}, "seen": {}, "load": [os.getloadavg()[0]],
              "args": args,
              "argv": sys.argv, "systems": systems}
    try:
        log(f"moto at {endpoint}; {args.images} images of {args.size}px; systems {systems}")
        total = make_images(cfg, args.images, args.size)
        cfg["shard_bytes"] = report["shard_bytes"] = -(-total // args.shards)
        report["total_bytes"] = total
        build_all(cfg, systems, report)
        for round_ in range(1, args.repeat + 1):
            log(f"-- round {round_}/{args.repeat}")
            one_round(cfg, systems, report, round_)
        report["load"].append(os.getloadavg()[0])
    finally:
        parent.send("stop")
        server.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    text = streaming_report.render(report)
    print(text)
    with open(args.out, "a" if args.append else "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
