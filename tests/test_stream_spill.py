"""Shards read from a remote store without a node cache are held in anonymous temporary files mapped read-only
(``stream_fetch``'s spill): a reader's window of shards is clean, reclaimable page cache rather than its own
memory, and nothing is ever named in ``TMPDIR`` (``O_TMPFILE``), so a ``kill -9`` leaves nothing behind.

Real parts: moto's S3 server on 127.0.0.1, shards written by ``write_shards``, a reader in a fresh process (its
anonymous memory, ``RssAnon``, measured without this test process's own heap in the way).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dask_ddp.data import write_shards

SHARD = 4 << 20  # bytes a shard
SHARDS = 10

READER = r"""
import json, os, sys, time
from dask_ddp.data.streaming.format import ShardIndex
from dask_ddp.data.streaming.fetch import ShardFetcher
import fsspec

url, opts, spill, hold = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
fs = fsspec.filesystem("s3", **opts)
index = ShardIndex.from_json(fs.cat_file(url.removeprefix("s3://") + "/index.json").decode(), url)
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
fetcher = ShardFetcher(url, index.shards, index.sizes, index.crcs, opts, None, keep=len(index.shards), spill=spill)
fetcher.get(0)  # the first GET warms s3fs's client up (its own memory) before the baseline
base = anon()
held = [fetcher.get(j) for j in range(len(index.shards))]
assert [len(b) for b in held] == list(index.sizes)
print(json.dumps({"growth": anon() - base, "kinds": sorted({type(b).__name__ for b in held})}), flush=True)
if hold:
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def remote(s3_server, tmp_path_factory):
    import uuid

    import boto3

    bucket = f"spill-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    opts = {"client_kwargs": {"endpoint_url": s3_server}, "key": "testing", "secret": "testing"}
    rng = __import__("random").Random(0)
    samples = [{"image": rng.randbytes(SHARD // 4 - 2048), "label": i % 3} for i in range(SHARDS * 4)]
    url = f"s3://{bucket}/big"
    write_shards(__import__("dask.bag", fromlist=["bag"]).from_sequence(samples, npartitions=SHARDS), url,
                 shard_size=SHARD, storage_options=opts, client=False, progress=False)
    return url, opts


def _reader(remote, tmp_path, spill: bool, hold: bool = False) -> subprocess.Popen:
    url, opts = remote
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", READER, url, json.dumps(opts), "1" if spill else "0",
                             "1" if hold else "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait(60)
        pytest.fail(f"the reader failed: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def test_a_spilled_window_of_shards_is_not_the_readers_own_memory(remote, tmp_path):
    kept = _reader(remote, tmp_path, spill=False)
    spilled = _reader(remote, tmp_path, spill=True)
    try:
        in_memory, mapped = _result(kept), _result(spilled)
    finally:
        for p in (kept, spilled):
            p.kill()
            p.wait(30)
    window = SHARD * SHARDS
    print(f"anonymous memory for {SHARDS} shards of {SHARD >> 20} MiB: held {in_memory['growth'] >> 20} MiB, "
          f"spilled {mapped['growth'] >> 20} MiB")
    assert in_memory["kinds"] == ["bytes"] and mapped["kinds"] == ["mmap"]
    assert in_memory["growth"] > 0.8 * window, "held in memory, the shards are the reader's own memory"
    assert mapped["growth"] < 0.3 * window, "spilled, the reader must not hold its shards in its own memory"
    assert os.listdir(tmp_path) == []


def test_a_killed_reader_leaves_nothing_in_its_tmpdir(remote, tmp_path):
    proc = _reader(remote, tmp_path, spill=True, hold=True)
    try:
        assert _result(proc)["kinds"] == ["mmap"]
        maps = open(f"/proc/{proc.pid}/maps").read()
        spilled = {line.split()[-2] for line in maps.splitlines() if str(tmp_path) in line and "(deleted)" in line}
        assert len(spilled) == SHARDS, f"each shard in a file of its own that has no name: {spilled}"
        assert os.listdir(tmp_path) == [], "an O_TMPFILE file never has a name in TMPDIR"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait(30)
    time.sleep(0.1)
    assert os.listdir(tmp_path) == []


def test_a_local_shard_is_mapped_where_it_is(tmp_path):
    """A local folder's shards are mapped read-only in place (no copy, pages shared by the host's readers) and
    checked as fetched ones: a shard changed under the index is named."""
    from dask_ddp.data import StreamingDataset

    samples = [(bytes([i]) * 3000, i % 2) for i in range(12)]
    write_shards(__import__("dask.bag", fromlist=["bag"]).from_sequence(samples, npartitions=3), str(tmp_path / "sh"),
                 shard_size="4KB", client=False, progress=False)
    ds = StreamingDataset(str(tmp_path / "sh"), decoder=lambda data, ext: bytes(data), shuffle=False)
    blobs = [ds.fetcher.get(j) for j in range(len(ds.index.shards))]
    assert {type(b).__name__ for b in blobs} == {"mmap"}
    assert sorted(ds[i][0] for i in range(len(ds))) == sorted(s for s, _ in samples)
    name = ds.index.shards[0]
    del blobs, ds  # nothing of this process reads the mapped file while it is rewritten below
    data = bytearray((tmp_path / "sh" / name).read_bytes())
    data[600] ^= 0xFF
    (tmp_path / "sh" / name).write_bytes(bytes(data))
    fresh = StreamingDataset(str(tmp_path / "sh"), decoder=lambda data, ext: bytes(data), shuffle=False)
    with pytest.raises(Exception, match=name):
        fresh.fetcher.get(0)
