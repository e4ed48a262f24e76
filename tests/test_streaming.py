"""Streaming data (issue 28) in one process and on a LocalCluster: shards written, read, ordered, resumed, checked.

Real parts: real JPEGs (16x16), tar shards on local disk and on moto's S3 server, the Dask cluster of
``client`` for write_shards, torch's DataLoader with worker processes, WebDataset's own TarWriter.
"""

from __future__ import annotations

import collections
import io
import os
import tarfile
import time

import numpy as np
import pytest
import torch
from PIL import Image

import dask_ddp
from dask_ddp.data import SampleDecodeError, ShardDataError, StreamingDataset, write_shards
from dask_ddp.data.streaming import state as stream_state
from dask_ddp.data.streaming.order import epoch_order

N = 101  # a prime: no batch size or world size divides it


def jpeg(value: int, size: int = 16) -> bytes:
    rng = np.random.default_rng(value)
    arr = (rng.integers(0, 256, (size, size, 3)) // 32 * 32).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def make_folder(root, n: int = N, classes: int = 3) -> dict:
    """``root/c<k>/img<i>.jpg``; returns {key write_shards gives it: (bytes, class)}."""
    out = {}
    for i in range(n):
        c = i % classes
        os.makedirs(f"{root}/c{c}", exist_ok=True)
        data = jpeg(i)
        with open(f"{root}/c{c}/img{i:04d}.jpg", "wb") as f:
            f.write(data)
        out[f"c{c}_img{i:04d}"] = (data, c)
    return out


def to_tensor(img):
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A local folder of 101 JPEGs in 3 classes, written as ~12 shards; yields (url, {key: (bytes, class)})."""
    root = tmp_path_factory.mktemp("stream")
    truth = make_folder(root / "src")
    summary = write_shards(str(root / "src"), str(root / "shards"), shard_size="8KB", progress=False, client=False)
    assert summary["samples"] == N and summary["shards"] >= 8, summary
    return str(root / "shards"), truth


def consume(ds, world, batch, nw=0, policy="drop_last", steps=None, state=None):
    """Every rank's loader at ``world`` ranks, in one process: [(step, rank, real keys)], and the final state."""
    loaders = [ds.loader(batch, rank=r, world_size=world, num_workers=nw, policy=policy, name=f"t{r}")
               for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    iters = [iter(ld) for ld in loaders]
    out, base = [], loaders[0].cursor // (batch * world)
    for k in range(len(loaders[0]) if steps is None else steps):
        for r, (ld, it) in enumerate(zip(loaders, iters)):
            x, y = next(it)
            assert x.shape[0] == batch and y.shape[0] == batch
            out.append((base + k, r, ld.batch_keys[:ld.batch_real]))
    states = {str(ld.state_dict()) for ld in loaders}
    assert len(states) == 1, "ranks disagree on the position"
    return out, loaders[0].state_dict()


def flat(records):
    return [k for _, _, keys in records for k in keys]


def test_write_shards_index_and_tars_hold_every_sample(shards):
    url, truth = shards
    ds = StreamingDataset(url, shuffle=False)
    assert sorted(ds.index.keys) == sorted(truth) and len(ds) == N
    for i, key in enumerate(ds.index.keys):
        j = int(ds.index.shard[i])
        with tarfile.open(f"{url}/{ds.index.shards[j]}") as tar:
            assert tar.extractfile(f"{key}.jpg").read() == truth[key][0]
            assert int(tar.extractfile(f"{key}.cls").read()) == truth[key][1] == int(ds.index.classes[i])
    assert ds.classes == ["c0", "c1", "c2"] and ds.class_to_idx == {"c0": 0, "c1": 1, "c2": 2}  # as ImageFolder's
    again = write_shards(url.replace("shards", "src"), url, shard_size="8KB", progress=False, client=False)
    assert again["written"] == 0 and again["fingerprint"] == ds.fingerprint  # a finished build is not rebuilt
    assert again["classes"] == ["c0", "c1", "c2"]  # also when the build was found complete


def test_write_shards_on_the_cluster_from_s3_resumes_a_failed_build(client, s3, tmp_path):
    import s3fs

    opts, bucket = s3["storage_options"], s3["bucket"]
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    truth = make_folder(tmp_path / "src", n=40)
    os.symlink("/nonexistent", tmp_path / "src" / "c2" / "zz-broken.jpg")  # listed, unreadable: the last part fails
    src, out = str(tmp_path / "src"), f"s3://{bucket}/shards"
    with pytest.raises(FileNotFoundError, match="zz-broken"):
        write_shards(src, out, shard_size="6KB", client=client, storage_options=opts, progress=False)
    assert not fs.exists(f"{bucket}/shards/index.json")  # no index: the build is not complete
    os.unlink(tmp_path / "src" / "c2" / "zz-broken.jpg")
    (tmp_path / "src" / "c2" / "zz-broken.jpg").write_bytes(jpeg(999))
    truth["c2_zz-broken"] = (jpeg(999), 2)
    done = write_shards(src, out, shard_size="6KB", client=client, storage_options=opts, progress=False)
    print("resumed build:", done)
    assert done["reused"] >= 3 and done["written"] >= 1 and done["samples"] == 41
    assert not fs.exists(f"{bucket}/shards/_parts")  # the parts' records go once the index is written
    ds = StreamingDataset(out, shuffle=False, storage_options=opts, transform=to_tensor)
    got = {ds.index.keys[i]: ds.fetcher.get(int(ds.index.shard[i]))[o:o + n]
           for i, (o, n) in enumerate(zip(ds.index.offset, ds.index.length))}
    assert got == {k: v[0] for k, v in truth.items()}


def check_records(url, samples):
    ds = StreamingDataset(str(url), shuffle=False, decoder=lambda b, ext: b)
    assert sorted((bytes(ds[i][0]), ds[i][1]) for i in range(len(ds))) == sorted(samples)


def test_write_shards_from_a_bag(client, tmp_path):
    import dask.bag as db

    samples = [(jpeg(i), i % 4) for i in range(30)]
    s = write_shards(db.from_sequence(samples, npartitions=3), str(tmp_path / "bag"), shard_size="5KB",
                     client=client, progress=False)
    assert s["samples"] == 30 and s["shards"] > 3
    check_records(tmp_path / "bag", samples)
    here = write_shards(db.from_sequence(samples, npartitions=2), str(tmp_path / "here"), client=False, progress=False)
    assert here["samples"] == 30  # without a cluster: threads here, each partition computed first
    check_records(tmp_path / "here", samples)


def test_write_shards_from_a_dataframe(client, tmp_path):
    dd = pytest.importorskip("dask.dataframe")  # needs pyarrow
    import pandas as pd

    samples = [(jpeg(i), i % 4) for i in range(30)]
    df = dd.from_pandas(pd.DataFrame({"key": [f"k{i}" for i in range(30)], "image": [b for b, _ in samples],
                                      "label": [c for _, c in samples]}), npartitions=2)
    assert write_shards(df, str(tmp_path / "df"), client=client, progress=False)["samples"] == 30
    check_records(tmp_path / "df", samples)


@pytest.mark.parametrize("nw", [0, 2])
def test_same_seed_same_global_order_at_world_sizes_1_to_4(shards, nw):
    url, _ = shards
    ds = StreamingDataset(url, seed=11, transform=to_tensor, buffer=16)
    order = [ds.index.keys[i] for i in epoch_order(ds.shard_sizes, 11, 0, True, 16)]
    assert sorted(order) == sorted(ds.index.keys) and order != sorted(order)
    for world in (1, 2, 3, 4):
        got = flat(consume(ds, world, 4, nw=nw if world < 3 else 0)[0])  # workers: at 1 and 2 ranks (time)
        assert got == order[:len(got)] and len(got) == N - N % (4 * world), world
    other = [ds.index.keys[i] for i in epoch_order(ds.shard_sizes, 11, 1, True, 16)]
    assert other != order and sorted(other) == sorted(order)  # the next epoch: another order, the same samples


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_equal_batch_counts_for_a_prime_number_of_samples(shards, world):
    url, _ = shards
    ds = StreamingDataset(url, transform=to_tensor)
    for policy in ("drop_last", "pad"):
        records, state = consume(ds, world, 3, policy=policy)
        per_rank = collections.Counter(r for _, r, _ in records)
        assert len(set(per_rank.values())) == 1 and len(per_rank) == world  # every rank the same batch count
        keys = flat(records)
        assert len(keys) == len(set(keys))
        want = N if policy == "pad" else N - N % (3 * world)
        assert len(keys) == want and state["epoch"] == 1 and state["cursor"] == 0


def test_state_dict_resumes_exactly_once_across_world_sizes_and_workers(shards):
    """Outside dask-ddp: state_dict()/load_state_dict() across 4 -> 3 -> 2 ranks and num_workers 2 -> 0 -> 1."""
    url, _ = shards
    ds = StreamingDataset(url, seed=5, transform=to_tensor, buffer=8)
    a, state = consume(ds, 4, 2, nw=2, policy="pad", steps=3)
    b, state = consume(ds, 3, 2, nw=0, policy="pad", steps=5, state=state)
    c, state = consume(ds, 2, 2, nw=1, policy="pad", state=state)
    keys = flat(a + b + c)
    assert collections.Counter(keys) == collections.Counter(ds.index.keys)  # 0 duplicates, 0 missing
    assert state == {**state, "epoch": 1, "cursor": 0}


def test_checkpoints_carry_the_position(shards, tmp_path):
    import gc

    url, _ = shards
    gc.collect()  # only this test's loader is live: the others' positions would be held for their names
    ds = StreamingDataset(url, transform=to_tensor)
    loader = ds.loader(4, name="carried")
    it = iter(loader)
    for _ in range(5):
        next(it)
    saved = loader.state_dict()
    dask_ddp.save_checkpoint({"step": 4}, 4, directory=str(tmp_path / "whole"))
    del it, loader
    gc.collect()
    loaded = dask_ddp.load_checkpoint(directory=str(tmp_path / "whole"))
    assert loaded == {"step": 4}  # the position is taken out of what the user gets
    assert stream_state.pending()["carried"] == saved  # no loader of that name now: held for the next one
    fresh = ds.loader(4, name="carried")
    assert fresh.state_dict() == saved and stream_state.pending() == {}
    next(iter(fresh))
    assert fresh.batch_keys == [ds.index.keys[i] for i in epoch_order(ds.shard_sizes, 0, 0)[20:24]]
    model = torch.nn.Linear(2, 2)
    dask_ddp.save_sharded({"model": model, "step": 5}, 5, directory=str(tmp_path / "sharded"))
    fresh.load_state_dict({**saved, "cursor": 0})
    state = {"model": model, "step": -1}
    assert dask_ddp.load_sharded(state, directory=str(tmp_path / "sharded")) == 5
    assert state == {"model": model, "step": 5} and fresh.state_dict()["cursor"] == 24


def test_webdataset_tars_read_back_identically(tmp_path):
    import webdataset as wds

    written = {}
    for s in range(3):
        with wds.TarWriter(str(tmp_path / f"part-{s:03d}.tar")) as sink:
            for i in range(s * 7, s * 7 + 7):
                key = f"sample{i:05d}"
                written[key] = (jpeg(i + 50), i % 5)
                sink.write({"__key__": key, "jpg": written[key][0], "cls": written[key][1]})
    ds = StreamingDataset(str(tmp_path), shuffle=False, decoder=lambda b, ext: b)
    assert list(ds.index.keys) == sorted(written) and ds.classes == []  # WebDataset tars name no classes
    assert {k: (bytes(ds[i][0]), ds[i][1]) for i, k in enumerate(ds.index.keys)} == written
    decoded = StreamingDataset(str(tmp_path), shuffle=False, transform=to_tensor)
    ref = list(wds.WebDataset(sorted(str(p) for p in tmp_path.glob("*.tar")), shardshuffle=False)
               .decode("pil").to_tuple("jpg", "cls"))
    assert len(ref) == len(decoded)
    for i, (img, cls) in enumerate(ref):
        assert torch.equal(decoded[i][0], to_tensor(img)) and decoded[i][1] == cls


def copy_of(url, tmp_path, name):
    import shutil

    return shutil.copytree(url, tmp_path / name)


def test_bad_input_names_the_shard_and_the_sample(shards, tmp_path):
    url, _ = shards
    with pytest.raises(FileNotFoundError, match="no index.json and no"):
        StreamingDataset(str(tmp_path / "nowhere"))
    bad = copy_of(url, tmp_path, "corrupt")
    ds = StreamingDataset(str(bad), shuffle=False, transform=to_tensor)
    first = ds.index.shards[0]
    data = bytearray((bad / first).read_bytes())
    data[600] ^= 0xFF
    (bad / first).write_bytes(bytes(data))
    with pytest.raises(ShardDataError, match=f"{first} is corrupt") as err:
        ds[0]
    assert err.value.shard.endswith(first)
    (bad / first).write_bytes(bytes(data[:2000]))
    with pytest.raises(ShardDataError, match=f"{first} is truncated"):
        StreamingDataset(str(bad), shuffle=False)[0]
    (bad / "index.json").write_text('{"format": "dask-ddp-shards/1", "shards": []}')
    with pytest.raises(ShardDataError, match="not a valid shard index"):
        StreamingDataset(str(bad))
    # a sample that fails to decode: raise naming it, or skip and count
    tars = tmp_path / "wds"
    tars.mkdir()
    with tarfile.open(tars / "a.tar", "w") as tar:
        for key, blob in (("good1", jpeg(1)), ("broken", b"not a jpeg"), ("good2", jpeg(2))):
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    plain = StreamingDataset(str(tars), shuffle=False)
    with pytest.raises(SampleDecodeError, match="sample 'broken'.*a.tar.*on_error='skip'") as err:
        plain[list(plain.index.keys).index("broken")]
    assert err.value.key == "broken" and err.value.shard.endswith("a.tar")
    loader = StreamingDataset(str(tars), shuffle=False, transform=to_tensor, on_error="skip").loader(3)
    batches = list(loader)
    assert len(batches) == 1 and batches[0][0].shape[0] == 2 and loader.skipped == 1
    (tars / "b").mkdir()
    with tarfile.open(tars / "b" / "b.tar", "w") as tar:
        for key in ("bad1", "bad2"):
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(ShardDataError, match="every sample of step 0 on rank 0 failed to decode"):
        list(StreamingDataset(str(tars / "b"), on_error="skip").loader(2))


def test_resume_from_s3_streams_within_5_s_without_rereading(s3, tmp_path):
    import s3fs

    opts, bucket = s3["storage_options"], s3["bucket"]
    make_folder(tmp_path / "src", n=N)
    write_shards(str(tmp_path / "src"), f"s3://{bucket}/sh", shard_size="4KB", storage_options=opts,
                 progress=False, client=False)
    ds = StreamingDataset(f"s3://{bucket}/sh", storage_options=opts, transform=to_tensor, buffer=4)
    total = sum(ds.index.sizes)
    loader = ds.loader(4, name="resume")
    it = iter(loader)
    for _ in range(15):  # 60 of 101 samples
        next(it)
    state = loader.state_dict()
    del it, loader
    started = time.perf_counter()
    fresh = StreamingDataset(f"s3://{bucket}/sh", storage_options=opts, transform=to_tensor, buffer=4)
    resumed = fresh.loader(4, name="resume")
    resumed.load_state_dict(state)
    it = iter(resumed)
    next(it)
    took = time.perf_counter() - started
    rest = list(it)
    print(f"resume to the first batch: {took:.3f} s; bytes read {fresh.fetcher.bytes_read} of {total}")
    assert took < 5.0 and len(rest) == 25 - 15 - 1
    assert fresh.fetcher.bytes_read < 0.6 * total  # what the first 60 samples needed is not read again
    assert s3fs  # the endpoint above is moto's


def test_random_access_reads_ranges_and_in_order_reads_whole_shards(s3, tmp_path):
    opts, bucket = s3["storage_options"], s3["bucket"]
    truth = make_folder(tmp_path / "src", n=N)
    url = f"s3://{bucket}/ranged"
    write_shards(str(tmp_path / "src"), url, shard_size="6KB", storage_options=opts, progress=False, client=False)
    ds = StreamingDataset(url, storage_options=opts, decoder=lambda b, ext: bytes(b))
    picks = [97, 3, 51, 20, 88]  # a random sampler's order: each from another shard, out of order
    assert len({int(ds.index.shard[i]) for i in picks}) == len(picks)
    for i in picks:
        assert ds[i] == truth[ds.index.keys[i]]
    needed = sum(int(ds.index.length[i]) for i in picks)
    assert ds.fetcher.bytes_read == needed  # the samples' bytes alone, one ranged GET each
    before = ds.fetcher.bytes_read
    for i in range(4):  # in order from 0: the whole shard, kept for the next samples
        assert ds[i] == truth[ds.index.keys[i]]
    whole = sum(ds.index.sizes[j] for j in {int(ds.index.shard[i]) for i in range(4)})
    assert ds.fetcher.bytes_read - before == whole
    assert ds[2] == truth[ds.index.keys[2]]  # out of order again, but its shard is held: a slice, no GET
    assert ds.fetcher.bytes_read - before == whole
    warm = StreamingDataset(url, storage_options=opts, decoder=lambda b, ext: bytes(b), cache_dir=tmp_path / "c")
    for i in range(4):  # in order: whole shards, into the node cache
        warm[i]
    cold = StreamingDataset(url, storage_options=opts, decoder=lambda b, ext: bytes(b), cache_dir=tmp_path / "c")
    assert cold[2] == truth[cold.index.keys[2]] and cold[1] == truth[cold.index.keys[1]]
    assert cold.fetcher.bytes_read == 0 and int(cold.index.shard[2]) in cold.fetcher.futures  # the cached shard,
    # checked once and held for its next samples


class SlowDown(OSError):
    code = "SlowDown"  # what storage.error_code reads: S3's throttling answer (moto cannot throttle on demand)


def test_throttled_reads_are_retried_with_backoff_then_named(shards, caplog):
    url, _ = shards
    ds = StreamingDataset(url, shuffle=False, transform=to_tensor, retries=3)
    ds.fetcher.local = False  # the local folder stands in for a store: read by GETs (cat_file), not mapped
    real, calls = ds.fetcher.fs.cat_file, []

    def throttled(path, *a, **kw):
        calls.append(path)
        if len(calls) <= 2:
            raise SlowDown("Please reduce your request rate")
        return real(path, *a, **kw)

    ds.fetcher.fs.cat_file = throttled
    assert ds[0][1] == int(ds.index.classes[0]) and len(calls) == 3
    assert "retrying shard" in caplog.text
    ds = StreamingDataset(url, shuffle=False, retries=1)
    ds.fetcher.local = False
    ds.fetcher.fs.cat_file = lambda path, *a, **kw: (_ for _ in ()).throw(SlowDown("Please reduce"))
    with pytest.raises(SlowDown) as err:
        ds[0]
    assert any(ds.index.shards[0] in note and "attempt 2 of 2" in note for note in err.value.__notes__)


def test_prefetch_is_a_byte_budget_over_the_mean_shard_or_a_number_of_shards(shards):
    """The default (256MB) on small shards fetches 16 ahead (the cap) with 8 threads; a budget of 3 shards' bytes
    fetches 3; an int is shards and threads as before; a budget under 2 shards still fetches 2."""
    shards, _ = shards
    idx = StreamingDataset(shards).index
    mean = sum(idx.sizes) // len(idx.sizes)
    assert len(idx.sizes) > 3 and mean < 256e6 / 16, (len(idx.sizes), mean)
    default = StreamingDataset(shards)
    assert (default.ahead, default.threads) == (16, 8)
    assert StreamingDataset(shards, prefetch=f"{3 * mean}B").ahead == 3
    assert (StreamingDataset(shards, prefetch=5).ahead, StreamingDataset(shards, prefetch=5).threads) == (5, 5)
    assert StreamingDataset(shards, prefetch="1KB").ahead == 2
    for bad in (-1, "lots", "0MB", 1.5):
        with pytest.raises(ValueError, match="prefetch must be"):
            StreamingDataset(shards, prefetch=bad)
    seen, _ = consume(StreamingDataset(shards, seed=1, prefetch="1KB", transform=to_tensor), 2, 4)
    assert flat(seen) == flat(consume(StreamingDataset(shards, seed=1, transform=to_tensor), 2, 4)[0])  # the same
