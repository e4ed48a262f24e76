"""Helper of tests/test_streaming_cleanup.py: fork a streaming child, SIGKILL it mid-epoch, CYCLES times.

Usage: python stream_killer.py SHARDS_URL CACHE_DIR CYCLES PIDS_FILE. The parent imports torch once; each
cycle forks a child that streams with a node cache (a limit below the dataset's size, so files are
written and evicted all the time), 0 or 2 DataLoader workers, and is killed with SIGKILL once it has
handed out a few batches. Every pid that ever streamed (children and their DataLoader workers) is written
to PIDS_FILE, one a line; the parent prints ``done N`` at the end.
"""

import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed  # noqa: F401 - imported once here, not in each forked child

from dask_ddp.data import StreamingDataset


def to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def child(url: str, cache: str, cycle: int, pids_file: str, write_fd: int) -> None:
    ds = StreamingDataset(url, seed=cycle, transform=to_tensor, cache_dir=cache, cache_limit=40_000)
    nw = 2 if cycle % 5 == 0 else 0  # DataLoader workers in some cycles (they start slowly)
    loader = ds.loader(4, num_workers=nw, worker_init_fn=_note_worker(pids_file))
    with open(pids_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    for k, _ in enumerate(loader):
        if k == 2:
            os.write(write_fd, b"x")  # mid-epoch: the parent kills us now, prefetch threads busy
    os.write(write_fd, b"x")
    time.sleep(60)


def _note_worker(pids_file: str):
    def init(_):
        with open(pids_file, "a") as f:
            f.write(f"{os.getpid()}\n")
    return init


def main() -> None:
    url, cache, cycles, pids_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    for cycle in range(cycles):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                child(url, cache, cycle, pids_file, w)
            finally:
                os._exit(0)
        os.close(w)
        if not os.read(r, 1):
            raise SystemExit(f"cycle {cycle}: the child died before streaming")
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    print(f"done {cycles}", flush=True)


if __name__ == "__main__":
    main()
