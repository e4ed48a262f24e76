"""Adapters of bench_streaming.py: how each system builds its shards and reads them, one rank at a time.

Runs in: the benchmark's driver (builds) and the rank processes it spawns (loaders); never imported by
dask_ddp. Every system gets the same thing: the same JPEG bytes (class folders ``images/classNN/*.jpg`` in
the bucket), the same shard size, batches of ``batch`` decoded by :func:`decode` (PIL + ``ToTensor``) in
the DataLoader workers (the collate functions below run there), 2 DataLoader workers per rank.

A system is a pair (``BUILDERS[name]``, ``LOADERS[name]``): a builder returns the seconds its build took
(None when it is not timed), a loader returns ``(iterable_of_batches, set_epoch)`` for one rank.
"""

from __future__ import annotations

import glob
import io
import os
import time
from typing import Any, Callable, Iterable

import torch
from PIL import Image  # imported here, before the DataLoader forks its workers (else each pays for it in the epoch)
from torchvision.transforms.functional import to_tensor

_FS: dict[tuple, Any] = {}


def fs(endpoint: str) -> Any:
    """This process's s3fs filesystem on the moto endpoint (one per pid: s3fs is not fork-safe)."""
    import s3fs

    key = (os.getpid(), endpoint)
    if key not in _FS:
        _FS[key] = s3fs.S3FileSystem(skip_instance_cache=True, key="testing", secret="testing",
                                     client_kwargs={"endpoint_url": endpoint},
                                     config_kwargs={"max_pool_connections": 32})
    return _FS[key]


DECODER = os.environ.get("BENCH_DECODER", "pil")  # "tv": the peers decode with torchvision's decode_jpeg


def decode(blob: bytes) -> torch.Tensor:
    """The one transform every system gets: JPEG bytes -> RGB PIL image -> float tensor (``ToTensor``); with
    ``BENCH_DECODER=tv`` the same tensor by torchvision's ``decode_jpeg`` (bitwise equal here; the peers'
    fastest per-sample path)."""
    if DECODER == "tv":
        from torchvision.io import ImageReadMode, decode_jpeg

        return decode_jpeg(torch.frombuffer(bytearray(blob), dtype=torch.uint8), mode=ImageReadMode.RGB).to(
            torch.float32).div_(255)
    return to_tensor(Image.open(io.BytesIO(blob)).convert("RGB"))


def decode_batch(blobs: list[bytes]) -> torch.Tensor:
    """The decode ceiling's fastest path to the same tensors: every JPEG of a batch in one ``decode_jpeg`` call
    (what dask-ddp's loader does for ``ToTensor``), stacked, ``to(float32).div_(255)``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    out = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs], mode=ImageReadMode.RGB)
    return torch.stack(out).to(torch.float32).div_(255)


def collate_pairs(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate ``(jpeg_bytes, label)`` samples into a decoded batch (runs in the DataLoader worker)."""
    return torch.stack([decode(b) for b, _ in samples]), torch.tensor([int(y) for _, y in samples])


def collate_dicts(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate LitData's ``{"image": bytes, "label": int}`` samples."""
    return collate_pairs([(s["image"], s["label"]) for s in samples])


def collate_mosaic(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate Mosaic's ``{"jpg": bytes, "cls": int}`` samples."""
    return collate_pairs([(s["jpg"], s["cls"]) for s in samples])


def raw_bytes(f: io.BytesIO) -> bytes:
    """S3ImageFolder's loader here: hand the JPEG bytes on undecoded (the collate decodes them)."""
    return f.getvalue()


def _items(cfg: dict) -> list[tuple[str, int]]:
    """The source images as (key inside the bucket, label), in listing order."""
    return [(k, int(k.split("/")[-2][5:])) for k in cfg["keys"]]


# ---------------------------------------------------------------- builds


def _ld_item(item: tuple[str, int, str]) -> dict:
    """LitData ``optimize`` fn: read one source object from S3 (module-level: optimize spawns workers)."""
    key, label, endpoint = item
    return {"image": fs(endpoint).cat_file(key, max_concurrency=1), "label": label}  # 1: no HEAD before the GET


def build_litdata(cfg: dict) -> float:
    """LitData ``optimize`` from the S3 images into ``s3://BUCKET/litdata`` with 2 workers; seconds."""
    from litdata import optimize

    items = [(f"{cfg['bucket']}/{k}", y, cfg["endpoint"]) for k, y in _items(cfg)]
    start = time.perf_counter()
    optimize(fn=_ld_item, inputs=items, output_dir=f"s3://{cfg['bucket']}/litdata", num_workers=2,
             chunk_bytes=cfg["shard_bytes"], mode="overwrite")
    return time.perf_counter() - start


def build_wds(cfg: dict) -> None:
    """WebDataset tars (``.jpg`` + ``.cls``) written from the local copy, uploaded to ``s3://BUCKET/wds`` (untimed)."""
    import webdataset as wds

    out = os.path.join(cfg["tmp"], "wds")
    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "shard-%05d.tar"), maxsize=cfg["shard_bytes"], maxcount=10**9,
                         verbose=0) as sink:
        for i, (key, label) in enumerate(_items(cfg)):
            with open(os.path.join(cfg["tmp"], key), "rb") as f:
                sink.write({"__key__": f"{i:07d}", "jpg": f.read(), "cls": str(label).encode()})
    fs(cfg["endpoint"]).put(out + "/", f"{cfg['bucket']}/wds/", recursive=True)


def build_mosaic(cfg: dict) -> None:
    """Mosaic MDS shards written from the local copy, uploaded to ``s3://BUCKET/mds`` (untimed)."""
    from streaming import MDSWriter

    out = os.path.join(cfg["tmp"], "mds")
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit=cfg["shard_bytes"]) as sink:
        for key, label in _items(cfg):
            with open(os.path.join(cfg["tmp"], key), "rb") as f:
                sink.write({"jpg": f.read(), "cls": label})
    fs(cfg["endpoint"]).put(out + "/", f"{cfg['bucket']}/mds/", recursive=True)


def build_ours(cfg: dict) -> float:
    """``dask_ddp.data.write_shards`` from the S3 images on a LocalCluster of 2 worker processes; seconds."""
    from distributed import Client, LocalCluster

    from dask_ddp.data import write_shards

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.run(lambda: None)  # workers up before the clock starts
        start = time.perf_counter()
        write_shards(f"s3://{cfg['bucket']}/images", f"s3://{cfg['bucket']}/ours", shard_size=cfg["shard_bytes"],
                     client=client, storage_options=cfg["storage_options"],
                     source_options=cfg["storage_options"], progress=False)
        return time.perf_counter() - start


BUILDERS: dict[str, Callable[[dict], float | None]] = {
    "ours": build_ours, "litdata": build_litdata, "wds": build_wds, "mosaic": build_mosaic,
}


def shard_paths(cfg: dict, system: str) -> list[str]:
    """The shard objects a system wrote (bucket-relative s3fs paths), index files left out."""
    sub = {"ours": "ours", "litdata": "litdata", "wds": "wds", "mosaic": "mds"}[system]
    found = fs(cfg["endpoint"]).find(f"{cfg['bucket']}/{sub}")
    return [p for p in found if not p.endswith((".json", ".yaml"))]


# ---------------------------------------------------------------- loaders (in the rank process)


def _loader(dataset: Any, cfg: dict, collate: Callable, **kw: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=cfg["batch"], num_workers=cfg["workers"], collate_fn=collate,
                      persistent_workers=False, **kw)


def load_litdata(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """LitData StreamingDataset + StreamingDataLoader; its cache_dir keeps the chunks for the 2nd epoch."""
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(f"s3://{cfg['bucket']}/litdata", cache_dir=os.path.join(cfg["cache"], "litdata"),
                          shuffle=True, seed=0, max_cache_size="50GB")
    loader = StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"], collate_fn=collate_dicts)
    return loader, lambda epoch: None


def _s3_gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any) -> io.BytesIO:
    """WebDataset's opener for s3:// (it has none of its own): the whole object in one GET, like ``aws s3 cp -``."""
    return io.BytesIO(fs(os.environ["BENCH_S3_ENDPOINT"]).cat_file(url))


def load_wds(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """WebDataset over the tars, split by node then by worker; its cache_dir serves the 2nd epoch."""
    import importlib

    import webdataset as wds

    # the module (webdataset.gopen is also a function's name); workers that are not forked import this module again
    importlib.import_module("webdataset.gopen").gopen_schemes["s3"] = _s3_gopen
    urls = sorted(f"s3://{p}" for p in shard_paths(cfg, "wds"))
    ds = wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, empty_check=False,
                        cache_dir=os.path.join(cfg["cache"], "wds"), seed=0).shuffle(1000).to_tuple("jpg", "cls")
    return _loader(ds, cfg, collate_pairs), lambda epoch: None


def load_mosaic(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """Mosaic StreamingDataset (S3_ENDPOINT_URL points its boto3 at moto); ``local`` keeps shards for epoch 2."""
    from streaming import StreamingDataset

    os.environ["S3_ENDPOINT_URL"] = cfg["endpoint"]
    ds = StreamingDataset(remote=f"s3://{cfg['bucket']}/mds", local=os.path.join(cfg["cache"], "mosaic"),
                          shuffle=True, shuffle_seed=0, batch_size=cfg["batch"])
    return _loader(ds, cfg, collate_mosaic), lambda epoch: None


def load_folder(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """dask-ddp's S3ImageFolder: one GET per image, DistributedSampler, ``cache=`` for the 2nd epoch."""
    from torch.utils.data import DistributedSampler

    from dask_ddp.data import S3ImageFolder

    ds = S3ImageFolder(f"s3://{cfg['bucket']}/images", loader=raw_bytes, storage_options=cfg["storage_options"],
                       cache=os.path.join(cfg["cache"], "folder"))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return _loader(ds, cfg, collate_pairs, sampler=sampler), sampler.set_epoch


def load_ours(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """dask-ddp's StreamingDataset + its loader (whole batches), as a user writes it: PIL decode, ``ToTensor``."""
    from dask_ddp.data import StreamingDataset

    ds = StreamingDataset(f"s3://{cfg['bucket']}/ours", shuffle=True, seed=0, transform=to_tensor,
                          cache_dir=os.path.join(cfg["cache"], "ours"), storage_options=cfg["storage_options"])
    loader = ds.loader(cfg["batch"], num_workers=cfg["workers"])
    return loader, loader.set_epoch


def keep_bytes(data: bytes, ext: str) -> bytes:
    """The raw reader's decoder: the sample's bytes as stored (no decoding)."""
    return data


def collate_lengths(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate undecoded samples: their byte lengths (the bytes were read and handed over) and labels."""
    return torch.tensor([len(b) for b, _ in samples]).unsqueeze(1), torch.tensor([int(y) for _, y in samples])


def load_raw(cfg: dict, rank: int, world: int) -> tuple[Iterable, Callable[[int], None]]:
    """Ours as ``load_ours`` but nothing decoded: the I/O path (fetch, cache, order, hand-over) against the byte
    ceiling."""
    from dask_ddp.data import StreamingDataset

    ds = StreamingDataset(f"s3://{cfg['bucket']}/ours", shuffle=True, seed=0, decoder=keep_bytes,
                          cache_dir=os.path.join(cfg["cache"], "raw"), storage_options=cfg["storage_options"])
    loader = ds.loader(cfg["batch"], num_workers=cfg["workers"], collate_fn=collate_lengths)
    return loader, loader.set_epoch


LOADERS: dict[str, Callable[[dict, int, int], tuple[Iterable, Callable[[int], None]]]] = {
    "raw": load_raw, "ours": load_ours, "litdata": load_litdata, "wds": load_wds, "mosaic": load_mosaic,
    "folder": load_folder,
}


def clean_mosaic_shm() -> None:
    """Remove shared memory a killed Mosaic run left behind (it does not clean up after crashes)."""
    try:
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    except Exception:  # noqa: BLE001 - best effort, the next run reports Mosaic's own error
        pass


def local_files(cfg: dict) -> list[str]:
    """The local copy of the source images (for the decode ceiling)."""
    return sorted(glob.glob(os.path.join(cfg["tmp"], "images", "*", "*.jpg")))
