"""``write_shards``: pack a folder of images, a dask.bag or a Dask DataFrame into tar shards, on the cluster.

Runs in: the client (planning, the progress bar, the index) and the Dask workers (each task writes its
part: one shard of a folder, or the shards of one partition).

Each part writes its tars, then a small record of them (``_parts/part-NNNNN.json``: names, sizes, CRC-32s
and samples). A build run again skips every part whose record is there and whose tars have the recorded
sizes, so a failed build resumes where it stopped; the index is written last (its presence means the build
is complete), then the records are removed. A finished build is not rebuilt.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from dask_ddp import storage
from dask_ddp.data.folder_index import cat_many, index_folder, normalize_root
from dask_ddp.data.streaming.format import IMAGE_EXTS, INDEX_NAME, ShardIndex, crc32, pack_tar

__all__ = ["write_shards", "parse_size"]

PARTS = "_parts"


def parse_size(size: int | str) -> int:
    """``"128MB"`` -> 128_000_000 (also ``KiB``/``MiB``/``GiB``, ``KB``/``GB``, plain ints); ValueError otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise ValueError(f"shard_size takes bytes or a size such as '128MB' or '64MiB', got {size!r}")
    unit = (1024 if m[3] else 1000) ** ("KMGT".find(m[2].upper()) + 1) if m[2] else 1
    return max(1, int(float(m[1]) * unit))


def write_shards(source: Any, url: str | os.PathLike, *, shard_size: int | str = "128MB", client: Any = None,
                 storage_options: Mapping[str, Any] | None = None, source_options: Mapping[str, Any] | None = None,
                 progress: bool = True, overwrite: bool = False) -> dict:
    """Write ``source`` as tar shards (WebDataset layout) plus ``index.json`` at ``url``; return a summary.

    Parameters
    ----------
    source : an image-folder URL or path (class folders, as ``ImageFolder`` / ``S3ImageFolder``), a
        ``dask.bag`` of samples, or a Dask DataFrame. A sample is a dict with the bytes under ``"image"``
        (or ``"data"``, or an extension such as ``"jpg"``), the class under ``"cls"`` (or ``"label"``,
        ``"target"``; default -1) and optionally ``"key"`` and ``"ext"``; or a tuple ``(bytes, class)``.
    url : fsspec URL or local folder to write to.
    shard_size : about this many bytes per shard (``"128MB"``, ``"64MiB"`` or an int).
    client : the Dask client whose workers do the work (default: the current one; without one, or with
        ``client=False``, threads in this process).
    storage_options, source_options : fsspec options of ``url`` and of a folder ``source``.
    progress : show a progress bar over the parts (tqdm).
    overwrite : rebuild even when ``url`` holds a complete build (else that build is returned as is).

    Returns
    -------
    dict
        ``url``, ``samples``, ``shards``, ``bytes``, ``classes`` (folder source), ``written`` and ``reused``
        (parts built now and parts found done from an earlier run; both 0 when the build was complete),
        ``seconds`` and ``fingerprint``.

    Raises
    ------
    FileNotFoundError, PermissionError
        ``source`` or ``url`` cannot be read or written (the URL named, never a secret).
    TypeError, ValueError
        An unknown source, a sample without bytes, a bad ``shard_size``; the message names the sample.
    """
    started, size = time.perf_counter(), parse_size(shard_size)
    out, out_opts = normalize_root(url), dict(storage_options or {})
    fs, root = storage.open_fs(out, out_opts)
    index_path = f"{root}/{INDEX_NAME}"
    if not overwrite and storage.call(lambda: fs.exists(index_path), out, storage_options=out_opts):
        data = storage.call(lambda: fs.cat_file(index_path), out, storage_options=out_opts)
        done = ShardIndex.from_json(data, f"{out}/{INDEX_NAME}")
        return _summary(out, done, 0, 0, started, list(done.names) or None)
    tasks, classes = _plan(source, size, source_options)
    storage.call(lambda: fs.makedirs(f"{root}/{PARTS}", exist_ok=True), out, doing="creating it",
                 storage_options=out_opts)
    parts, reused = _run(tasks, out, out_opts, client, progress)
    index = _index(parts, classes or ())
    storage.call(lambda: fs.pipe_file(index_path, index.to_json()), out, doing="writing its index",
                 storage_options=out_opts)
    storage.call(lambda: fs.rm(f"{root}/{PARTS}", recursive=True), out, storage_options=out_opts)
    return _summary(out, index, len(tasks) - reused, reused, started, classes)


def _summary(url: str, index: ShardIndex, written: int, reused: int, started: float, classes: Any) -> dict:
    return {"url": url, "samples": len(index), "shards": len(index.shards), "bytes": sum(index.sizes),
            "classes": classes, "written": written, "reused": reused,
            "seconds": round(time.perf_counter() - started, 3), "fingerprint": index.fingerprint}


def _plan(source: Any, size: int, source_options: Mapping[str, Any] | None) -> tuple[list[tuple], list | None]:
    """``[(fn, part number, arg), ...]`` (one task per part) and the class names of a folder source."""
    if isinstance(source, (str, os.PathLike)):
        return _plan_folder(normalize_root(source), size, dict(source_options or {}))
    if hasattr(source, "to_delayed"):  # a dask.bag or a Dask DataFrame: one part per partition
        return [(_write_records, i, (d, size)) for i, d in enumerate(source.to_delayed())], None
    raise TypeError(f"write_shards takes an image-folder URL, a dask.bag or a Dask DataFrame, got "
                    f"{type(source).__name__}")


def _plan_folder(src: str, size: int, opts: dict) -> tuple[list[tuple], list]:
    listing = index_folder(src, opts)
    classes = sorted(d for d in listing.dirs if "/" not in d)
    cls_of = {c: i for i, c in enumerate(classes)}
    files = [(rel, n) for rel, n in listing.files if "/" in rel and rel.rsplit(".", 1)[-1].lower() in IMAGE_EXTS]
    files.sort(key=lambda f: (cls_of[f[0].split("/", 1)[0]], f[0]))
    if not files:
        raise FileNotFoundError(f"{storage.redact(src, opts)} has no images in class folders: nothing to shard")
    tasks: list[tuple] = []
    part: list[tuple] = []
    total, used = 0, set[str]()
    for rel, n in files:
        key = _key(rel, used)
        part.append((rel, key, rel.rsplit(".", 1)[-1].lower(), cls_of[rel.split("/", 1)[0]]))
        total += n + 1024
        if total >= size:
            tasks.append((_write_folder_part, len(tasks), (src, opts, part)))
            part, total = [], 0
    if part:
        tasks.append((_write_folder_part, len(tasks), (src, opts, part)))
    return tasks, classes


def _key(rel: str, used: set) -> str:
    key = re.sub(r"[./\\\s]", "_", rel.rsplit(".", 1)[0])
    while key in used:
        key += "_"
    used.add(key)
    return key


def _run(tasks: list[tuple], out: str, opts: dict, client: Any, progress: bool) -> tuple[list[dict], int]:
    """Run the parts (skipping those done before); return their records in part order and how many were reused."""
    client = client if client is not None else _current_client()
    bar = _bar(len(tasks), progress)
    try:
        if not client:
            with ThreadPoolExecutor(4) as pool:
                futs = [pool.submit(_part_here, fn, i, arg, out, opts) for fn, i, arg in tasks]
                for f in futs:
                    f.result()
                    bar.update(1)
                results = [f.result() for f in futs]
        else:
            results = _run_on(client, tasks, out, opts, bar)
    finally:
        bar.close()
    return [r for r, _ in results], sum(reused for _, reused in results)


def _run_on(client: Any, tasks: list[tuple], out: str, opts: dict, bar: Any) -> list:
    import dask
    from distributed import as_completed

    futures = client.compute([dask.delayed(_part, pure=False)(fn, i, arg, out, opts) for fn, i, arg in tasks])
    futures = futures if isinstance(futures, list) else [futures]
    for _ in as_completed(futures):
        bar.update(1)
    return client.gather(futures)


def _part_here(fn: Any, i: int, arg: Any, out: str, opts: dict) -> tuple[dict, int]:
    """:func:`_part` without a cluster: a partition of a bag or DataFrame is computed here first."""
    import dask

    return _part(fn, i, dask.compute(arg, scheduler="sync")[0], out, opts)


def _current_client() -> Any:
    try:
        from distributed import get_client

        return get_client()
    except (ImportError, ValueError):
        return None


def _bar(total: int, progress: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="writing shards", unit="part", disable=not progress)


_FS: dict = {}  # role ("out", "src") -> ((pid, url, options), (filesystem, root)): one per process and role, not
# one per part (s3fs: ~0.5 s each)


def _open(url: str, opts: dict, role: str = "out") -> tuple[Any, str]:
    key = (os.getpid(), url, json.dumps(opts, sort_keys=True, default=str))
    held = _FS.get(role)
    if held is None or held[0] != key:
        _FS[role] = held = (key, storage.open_fs(url, opts))
    return held[1]


def _part(fn: Any, i: int, arg: Any, out: str, opts: dict) -> tuple[dict, int]:
    """One part on a worker: ``(its record, 1 if an earlier run had done it else 0)``."""
    fs, root = _open(out, opts)
    record_path = f"{root}/{PARTS}/part-{i:05d}.json"
    tag = _tag(arg)
    if fs.exists(record_path):
        record = json.loads(fs.cat_file(record_path))
        if record.get("tag") == tag and all(fs.exists(path := f"{root}/{s['name']}") and fs.size(path) == s["size"]
                                            for s in record["shards"]):
            return record, 1
    shards, samples = fn(i, arg, fs, root, out)
    record = {"part": i, "tag": tag, "shards": shards, "samples": samples}
    fs.pipe_file(record_path, json.dumps(record).encode())  # after the tars: a record means they are complete
    return record, 0


def _tag(arg: Any) -> str:
    """What the part was planned to hold: a folder part's files and classes (a partition: its number only)."""
    import hashlib

    files = arg[2] if isinstance(arg, tuple) and len(arg) == 3 else None
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16] if files else ""


def _write_tar(fs: Any, root: str, out: str, name: str, items: list) -> tuple[dict, list]:
    data, entries = pack_tar(items)
    storage.call(lambda: fs.pipe_file(f"{root}/{name}", data), f"{out}/{name}", doing="writing the shard")
    return {"name": name, "size": len(data), "crc": crc32(data)}, [[k, c, name, o, n, e] for k, c, o, n, e in entries]


def _write_folder_part(i: int, arg: tuple, fs: Any, root: str, out: str) -> tuple[list, list]:
    src, opts, files = arg
    local = "://" not in src or src.startswith("file://")
    sfs, sroot = storage.open_fs(src, opts) if local else _open(src, opts, "src")
    paths = [f"{sroot}/{f[0]}" for f in files]
    blobs = []
    for path, rel, got in zip(paths, (f[0] for f in files), cat_many(sfs, paths)):  # concurrent, one GET each
        if isinstance(got, BaseException):  # named as a single read names it (no secret), after one more try
            got = storage.call(functools.partial(sfs.cat_file, path), f"{src}/{rel}", storage_options=opts)
        blobs.append(got)
    shard, samples = _write_tar(fs, root, out, f"shard-{i:05d}.tar",
                                [(key, ext, blob, cls) for (_, key, ext, cls), blob in zip(files, blobs)])
    return [shard], samples


def _write_records(i: int, arg: tuple, fs: Any, root: str, out: str) -> tuple[list, list]:
    records, size = arg
    if hasattr(records, "to_dict"):  # a pandas partition of a Dask DataFrame
        records = records.to_dict("records")
    items = [_item(r, i, k) for k, r in enumerate(records)]
    shards: list[dict] = []
    samples: list[list] = []
    chunk: list[tuple] = []
    total = 0
    for item in items + [None]:
        if item is None or (chunk and total + len(item[2]) > size):
            if chunk:
                shard, found = _write_tar(fs, root, out, f"shard-{i:05d}-{len(shards):04d}.tar", chunk)
                shards.append(shard)
                samples += found
            chunk, total = [], 0
        if item is not None:
            chunk.append(item)
            total += len(item[2]) + 1024
    return shards, samples


def _item(record: Any, part: int, k: int) -> tuple[str, str, bytes, int]:
    """``(key, ext, bytes, class)`` of one record of a bag or DataFrame; ValueError naming it when it has no bytes."""
    if isinstance(record, (tuple, list)) and len(record) == 2:
        record = {"image": record[0], "cls": record[1]}
    if not isinstance(record, Mapping):
        raise TypeError(f"sample {k} of partition {part} is a {type(record).__name__}: give dicts or (bytes, class)")
    data_key = next((f for f in ("image", "data", *IMAGE_EXTS) if f in record), None)
    if data_key is None or not isinstance(record[data_key], (bytes, bytearray, memoryview)):
        raise ValueError(f"sample {k} of partition {part} has no bytes under 'image', 'data' or an extension "
                         f"(keys: {sorted(map(str, record))[:8]})")
    ext = str(record.get("ext") or (data_key if data_key in IMAGE_EXTS else "jpg"))
    cls = next((record[f] for f in ("cls", "label", "target") if f in record), -1)
    key = str(record.get("key") or f"p{part:05d}_{k:07d}")
    return key, ext, bytes(record[data_key]), int(cls)


def _index(parts: list[dict], names: Sequence[str]) -> ShardIndex:
    shards = [s for p in parts for s in p["shards"]]
    pos = {s["name"]: j for j, s in enumerate(shards)}
    samples = [s for p in parts for s in p["samples"]]
    return ShardIndex.build([s["name"] for s in shards], [s["size"] for s in shards], [s["crc"] for s in shards],
                            [s[0] for s in samples], [s[1] for s in samples], [pos[s[2]] for s in samples],
                            [s[3] for s in samples], [s[4] for s in samples], [s[5] for s in samples], names)
