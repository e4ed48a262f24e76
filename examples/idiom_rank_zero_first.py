"""``rank_zero_first()``: rank 0 runs a block first (a download, a preprocessing step), the others after it.

The other ranks wait at a barrier until rank 0 leaves the block, then run it themselves and find what rank 0
left behind (a file in a folder every rank sees: on one machine any folder, across hosts shared storage)::

    python examples/idiom_rank_zero_first.py /tmp/dask-ddp-cache
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dask_ddp


def download(path: Path) -> None:
    """Stands for a slow download: writes the data set's file atomically (a reader never sees half of it)."""
    time.sleep(0.5)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps({"classes": ["cat", "dog"], "samples": list(range(100))}))
    tmp.replace(path)


def train(cache_dir: str) -> dict:
    """One rank: gets the data set once per job (rank 0 downloads, the others reuse the file)."""
    ctx = dask_ddp.get_context()
    path = Path(cache_dir) / "dataset.json"
    with dask_ddp.rank_zero_first():
        downloaded = not path.exists()
        if downloaded:  # only rank 0 gets here with no file: the others wait for it at the barrier
            path.parent.mkdir(parents=True, exist_ok=True)
            download(path)
        data = json.loads(path.read_text())
    return {"rank": ctx.rank, "downloaded": downloaded, "samples": len(data["samples"])}


def main(argv: list[str] | None = None, client=None) -> list[dict]:
    """Run the job on ``client``, or on a local cluster of 2 workers started (and stopped) here."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cache_dir")
    args = parser.parse_args(argv)
    if client is not None:
        return dask_ddp.dispatch.run(client, train, args.cache_dir, progress=False).result()
    from dask.distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        results = dask_ddp.dispatch.run(c, train, args.cache_dir).result()
    for r in results:
        print(f"rank {r['rank']}: {'downloaded' if r['downloaded'] else 'reused'} {r['samples']} samples")
    return results


if __name__ == "__main__":
    main()
