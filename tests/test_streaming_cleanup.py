"""Nothing left behind (issue 28, item 6): 50 SIGKILLs of a process streaming through the node cache.

Each cycle forks a child of tests/stream_killer.py (one torch import for all 50) that streams real JPEG shards
with a shared node cache bounded below the dataset's size (so cache files are written and evicted while
it dies) and, in some cycles, two DataLoader workers; it is killed with SIGKILL after its third batch.
Before and after, /dev/shm and the cache folder are listed: no segment named by one of those processes'
pids, no temporary, part or lock file, only complete cache files each equal to a shard of the index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
from test_streaming import make_folder

from dask_ddp.data import write_shards
from dask_ddp.data.streaming.format import ShardIndex, crc32

CYCLES = 50
PRIVATE = f"dask-ddp-{os.geteuid()}"  # the user's private folder in a cache_dir


def test_50_kill_9_cycles_leave_no_shm_lock_or_temp_file(tmp_path):
    make_folder(tmp_path / "src", n=120)
    write_shards(str(tmp_path / "src"), str(tmp_path / "shards"), shard_size="6KB", progress=False, client=False)
    index = ShardIndex.from_json((tmp_path / "shards" / "index.json").read_bytes(), "index")
    cache, pids_file = tmp_path / "cache", tmp_path / "pids"
    shm_before = set(os.listdir("/dev/shm"))
    started = time.perf_counter()
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "stream_killer.py"), str(tmp_path / "shards"),
           str(cache), str(CYCLES), str(pids_file)]
    private = os.geteuid() == 0 and shutil.which("unshare") is not None
    if private:  # a /dev/shm of its own: every entry left there is one of these processes'
        cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"', *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    took = time.perf_counter() - started
    assert proc.returncode == 0 and f"done {CYCLES}" in proc.stdout, proc.stderr[-3000:]
    pids = {int(p) for p in pids_file.read_text().split()}
    assert len(pids) >= CYCLES
    deadline = time.monotonic() + 60  # orphaned DataLoader workers notice their parent's death and exit
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "DataLoader workers of killed children still run after 60 s"
        time.sleep(0.5)
    new_shm = set(os.listdir("/dev/shm")) - shm_before
    print(f"{CYCLES} kill -9 cycles in {took:.1f} s; {len(pids)} processes; new /dev/shm entries (any "
          f"process on this machine): {sorted(new_shm)}; cache files: {len(os.listdir(cache / PRIVATE))}")
    assert not [n for n in new_shm if any(str(p) in n for p in pids)]
    left = json.loads(proc.stdout.split("shm: ", 1)[1].splitlines()[0])
    print(f"/dev/shm {'of the killed processes alone' if private else '(shared)'} after the cycles: {left}")
    if private:
        assert left == [], "shared-memory segments or semaphores outlived their killed processes"
    from dask_ddp.data.streaming.cache import ShardCache

    # opening a cache evicts what a process killed between its write and its eviction left
    folder = Path(ShardCache(cache, 40_000).folder)  # the user's private folder in cache_dir
    names = {shard_name(index, str(tmp_path / "shards"), j): j for j in range(len(index.shards))}
    files = [n for n in os.listdir(folder) if n != ".claims"]  # .claims: the one (empty) file claims lock
    for name in files:
        assert name in names, f"{name} is not a complete cache file (a temporary, part or lock file?)"
        assert crc32((folder / name).read_bytes()) == index.crcs[names[name]], f"{name} is incomplete"
    assert sum(os.path.getsize(folder / n) for n in files) <= 40_000 + max(index.sizes)
    assert files, f"the cache was never written: the test tests nothing\n{proc.stderr[-3000:]}"
    claims = [ShardCache(cache, 40_000).claim(name) for name in names]  # no claim outlived its killed process
    assert all(c is not None for c in claims)
    for c in claims:
        c.close()


def shard_name(index: ShardIndex, root: str, j: int) -> str:
    from dask_ddp.data.streaming.cache import ShardCache

    return ShardCache.name(f"{root}/{index.shards[j]}", index.sizes[j], index.crcs[j])


def test_cached_shards_are_shared_memory_maps_that_outlive_their_eviction(tmp_path):
    """Every process of a host reads a cached shard as a read-only map of one file (its pages shared), and a
    map stays readable after the cache evicts the file under it."""
    import mmap

    from dask_ddp.data.streaming.cache import ShardCache

    cache = ShardCache(tmp_path / "cache", 3000)
    folder = Path(cache.folder)  # the user's private folder in cache_dir
    first, second = os.urandom(2000), os.urandom(2000)
    cache.put("a.tar", first)
    held = cache.get("a.tar")
    assert isinstance(held, mmap.mmap) and held[:] == first and crc32(held) == crc32(first)
    with open(folder / "a.tar", "r+b") as f:  # another process's view is the same pages
        assert mmap.mmap(f.fileno(), 0)[10:20] == held[10:20]
    cache.put("b.tar", second)  # over the limit: a.tar, used least recently, is evicted
    assert not (folder / "a.tar").exists() and cache.get("a.tar") is None
    assert held[:] == first  # the map taken before still reads the evicted file's bytes
    assert cache.get("b.tar")[:] == second



def test_threads_evicting_at_once_never_empty_the_cache(tmp_path):
    """6 threads of one process (a fetcher's prefetch threads) putting and reading 10 KB files in a 50 KB cache
    never leave it with fewer than 4 files once it held 5 (counted by name, in one ``getdents`` call).

    Each eviction listed the folder through the one descriptor the threads share; a listing then shared its
    read offset with another thread's and saw the same files several times, or none: an eviction counting
    each file twice removed them all (test_50_kill_9_cycles' cache was found empty in CI)."""
    import threading

    from dask_ddp.data.streaming.cache import ShardCache

    size, limit, threads, rounds = 10_000, 50_000, 6, 300
    cache = ShardCache(tmp_path / "cache", limit)
    folder, blob, stop = Path(cache.folder), os.urandom(size), threading.Event()

    def writer(t: int) -> None:  # put a file of its own, read two others (they become the most recently used)
        for i in range(rounds):
            cache.put(f"{t}-{i}.tar", blob)
            for j in (i - 1, i - 2):
                cache.get(f"{(t + 1) % threads}-{max(j, 0)}.tar")

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    counts = []
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        counts.append(sum(n.endswith(".tar") for n in os.listdir(folder)))
    for w in workers:
        w.join()
    full = next((k for k, n in enumerate(counts) if n * size >= limit), None)
    print(f"{len(counts)} scans; fewest files once full: {min(counts[full:]) if full is not None else None}")
    assert full is not None, "the cache never filled: the test tests nothing"
    assert not cache.broken
    assert min(counts[full:]) * size >= limit - size, f"over-evicted: fewest files {sorted(counts[full:])[:20]}"
    assert sum(n.endswith(".tar") for n in os.listdir(folder)) * size == limit
