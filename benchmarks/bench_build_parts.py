"""Where a shard build's time goes (issue 44, item 3): the listing, the source GETs at several concurrencies, the
build, against the build floor (the source images' GETs alone, one after another, from 2 processes).

Usage (the bench venv of ``bench_streaming.py``, whose moto server and images this reuses)::

    /work/bench-venv/bin/python benchmarks/bench_build_parts.py [--images 20000] [--rounds 2]

Prints one line per measure: ``listing`` (``index_folder`` of the image folder, what ``write_shards`` does
first), ``floor``, ``cat_many chunk=N`` (``dask_ddp.data.folder_index.cat_many``, the build's GETs, in 2
processes with N requests in flight) and ``build ours`` (``write_shards`` on a LocalCluster of 2 workers, as
``bench_streaming.py`` times it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_streaming as B  # noqa: E402
import streaming_peers as peers  # noqa: E402


def _cat_many_main(keys: list[str], endpoint: str, chunk: int, barrier, out) -> None:
    """The build's GETs in one process: ``cat_many`` of 400 keys at a time, ``chunk`` in flight."""
    from dask_ddp import storage
    from dask_ddp.data.folder_index import cat_many

    fs, _ = storage.open_fs("s3://bench", {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing",
                                           "secret": "testing"})
    barrier.wait()
    start, n = time.time(), 0
    for lo in range(0, len(keys), 400):
        n += sum(len(b) for b in cat_many(fs, keys[lo:lo + 400], chunk=chunk))
    out.put((start, time.time(), n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    parent, child = B.SPAWN.Pipe()
    server = B.SPAWN.Process(target=B._serve, args=(child,), daemon=True)
    server.start()
    host, port = parent.recv()
    endpoint = f"http://{host}:{port}"
    os.environ["AWS_ENDPOINT_URL"] = os.environ["S3_ENDPOINT_URL"] = endpoint
    tmp = tempfile.mkdtemp(prefix="bench-build-")
    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    cfg = {"endpoint": endpoint, "bucket": "bench", "tmp": tmp, "storage_options": opts}
    try:
        total = B.make_images(cfg, args.images, 96)
        cfg["shard_bytes"] = -(-total // 16)
        keys = [f"bench/{k}" for k in cfg["keys"]]
        from dask_ddp.data.folder_index import index_folder

        for _ in range(args.rounds):
            t = time.perf_counter()
            listing = index_folder("s3://bench/images", opts)
            B.log(f"listing {len(listing.files)} files: {time.perf_counter() - t:.2f}s")
        for _ in range(args.rounds):
            seconds, _ = B.run_pair(B._get_main, [keys[0::2], keys[1::2]], endpoint)
            B.log(f"floor (one GET after another, 2 processes): {seconds:.1f}s")
            for chunk in (256, 32, 8):
                seconds, _ = B.run_pair(_cat_many_main, [keys[0::2], keys[1::2]], endpoint, chunk)
                B.log(f"cat_many chunk={chunk}, 2 processes: {seconds:.1f}s")
            fs = peers.fs(endpoint)
            if fs.exists("bench/ours"):
                fs.rm("bench/ours", recursive=True)
            B.log(f"build ours: {peers.build_ours(cfg):.1f}s")
    finally:
        parent.send("stop")
        server.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
