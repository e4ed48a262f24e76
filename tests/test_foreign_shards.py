"""MDS (Mosaic Streaming) and LitData shards, written by those libraries, read back by StreamingDataset.

Real files: ``tests/data/foreign`` was written by ``mosaicml-streaming``'s MDSWriter and ``litdata.optimize``
(``tests/data/foreign/make.py`` says how; neither library is a dependency), 23 JPEGs of 3 classes; its
``truth.json`` holds each JPEG's SHA-256 and class. Read from local disk and from moto's S3 server, through
the loader at 2 world sizes with DataLoader workers, and broken on purpose.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dask_ddp.data import SampleDecodeError, ShardDataError, StreamingDataset

HERE = Path(__file__).parent / "data" / "foreign"
TRUTH = json.loads((HERE / "truth.json").read_text())


def raw(data: bytes, ext: str) -> tuple[str, str]:
    return hashlib.sha256(bytes(data)).hexdigest(), ext


@pytest.mark.parametrize("fmt", ["mds", "litdata"])
def test_every_record_reads_back_as_the_jpeg_and_class_written(fmt):
    ds = StreamingDataset(str(HERE / fmt), decoder=raw, shuffle=False)
    assert len(ds) == len(TRUTH) and ds.layout is not None and ds.layout.fmt == fmt
    got = sorted((ds[i][0][0], ds[i][1]) for i in range(len(ds)))
    assert got == sorted((sha, cls) for cls, sha in TRUTH.values())
    assert {ds[i][0][1] for i in range(len(ds))} == {"jpg"}
    assert all(k.split("#")[0] in ds.index.shards for k in ds.index.keys)
    img, cls = StreamingDataset(str(HERE / fmt), shuffle=False)[0]  # the default decoder: PIL, RGB
    assert img.size == (20, 16) and img.mode == "RGB" and cls in (0, 1, 2)


@pytest.mark.parametrize("fmt", ["mds", "litdata"])
def test_the_loader_reads_each_record_once_per_epoch_at_any_world_size(fmt):
    seen = {}
    for world in (1, 2):
        keys = []
        for rank in range(world):
            ds = StreamingDataset(str(HERE / fmt), decoder=raw, seed=5, buffer=8)
            loader = ds.loader(3, rank=rank, world_size=world, num_workers=2, policy="pad",
                               collate_fn=lambda items: items)
            for batch in loader:
                keys += loader.batch_keys[:loader.batch_real]
                assert all(c in (0, 1, 2) for _, c in batch)
        assert sorted(keys) == sorted(ds.index.keys) and len(set(keys)) == len(TRUTH)
        seen[world] = keys
    assert sorted(seen[1]) == sorted(seen[2])


def test_read_from_s3(s3):
    import s3fs

    opts, bucket = s3["storage_options"], s3["bucket"]
    fs = s3fs.S3FileSystem(**opts)
    for fmt in ("mds", "litdata"):
        fs.put(str(HERE / fmt), f"{bucket}/{fmt}", recursive=True)
        ds = StreamingDataset(f"s3://{bucket}/{fmt}", decoder=raw, storage_options=opts, shuffle=False)
        assert sorted(ds[i][0][0] for i in range(len(ds))) == sorted(sha for _, sha in TRUTH.values())


def test_broken_foreign_shards_are_named(tmp_path):
    for fmt in ("mds", "litdata"):
        shutil.copytree(HERE / fmt, tmp_path / fmt)
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    first = index["shards"][0]["raw_data"]["basename"]
    data = bytearray((tmp_path / "mds" / first).read_bytes())
    data[0] = 9  # its sample count: not what the index says
    (tmp_path / "mds" / first).write_bytes(bytes(data))
    with pytest.raises(ShardDataError, match=f"{first}.*does not start with the 2 samples"):
        StreamingDataset(str(tmp_path / "mds"))
    (tmp_path / "mds" / first).write_bytes(bytes((HERE / "mds" / first).read_bytes()))
    second = index["shards"][1]["raw_data"]["basename"]
    good = (tmp_path / "mds" / second).read_bytes()
    ds = StreamingDataset(str(tmp_path / "mds"), shuffle=False)
    last = max(i for i, k in enumerate(ds.index.keys) if k.startswith(second))
    bad = bytearray(good)
    bad[int(ds.index.offset[last])] ^= 0x40  # the record's header: its image's size, now wrong
    (tmp_path / "mds" / second).write_bytes(bytes(bad))
    with pytest.raises(SampleDecodeError, match=f"{second}#1.*add up"):
        StreamingDataset(str(tmp_path / "mds"), shuffle=False)[last]
    (tmp_path / "mds" / second).write_bytes(good[:-5])  # the shard cut short
    with pytest.raises(ShardDataError, match=f"{second} is truncated"):
        StreamingDataset(str(tmp_path / "mds"), shuffle=False)[last]
    config = json.loads((tmp_path / "litdata" / "index.json").read_text())
    config["config"]["compression"] = "zstd"
    (tmp_path / "litdata" / "index.json").write_text(json.dumps(config))
    with pytest.raises(ShardDataError, match="compression 'zstd'.*not read"):
        StreamingDataset(str(tmp_path / "litdata"))
    index["shards"] = [{**s, "column_encodings": ["pil", "str", "int"]} for s in index["shards"]]
    (tmp_path / "mds" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardDataError, match="raw pixels"):
        StreamingDataset(str(tmp_path / "mds"))


@pytest.mark.parametrize("fmt", ["ours", "mds", "litdata"])
def test_a_shard_name_leading_outside_the_dataset_is_refused(fmt, tmp_path):
    """Shard names are joined to the root: ``../x``, an absolute name or a ``..`` segment would read outside the
    dataset (here: a genuine shard moved out of it, which the reader would have read). Refused, naming the index
    file and the name, for our index, MDS's and LitData's."""
    import re

    from test_streaming import make_folder

    from dask_ddp.data import write_shards

    root = tmp_path / "data" / fmt
    if fmt == "ours":
        make_folder(tmp_path / "src", n=12)
        write_shards(str(tmp_path / "src"), str(root), shard_size="6KB", progress=False, client=False)
    else:
        shutil.copytree(HERE / fmt, root)
    doc = json.loads((root / "index.json").read_text())
    entry = {"ours": lambda: doc["shards"], "mds": lambda: doc["shards"][0]["raw_data"],
             "litdata": lambda: doc["chunks"][0]}[fmt]()
    field = {"ours": 0, "mds": "basename", "litdata": "filename"}[fmt]
    first = entry[field]
    (tmp_path / "outside").mkdir()
    shutil.move(root / first, tmp_path / "outside" / first)  # out of the dataset: only a bad name reaches it
    for bad in (f"../../outside/{first}", str(tmp_path / "outside" / first), f"x/../../../outside/{first}",
                f"..\\..\\outside\\{first}", f"{first}\n"):
        entry[field] = bad
        (root / "index.json").write_text(json.dumps(doc))
        with pytest.raises(ShardDataError, match=re.escape(f"{root}/index.json names the shard {bad!r}")):
            StreamingDataset(str(root), shuffle=False, decoder=raw)[0]
    entry[field] = first  # the shard back in place under its own name: read as before
    shutil.move(tmp_path / "outside" / first, root / first)
    (root / "index.json").write_text(json.dumps(doc))
    ds = StreamingDataset(str(root), shuffle=False, decoder=raw)
    assert len(ds) and ds[0] is not None
