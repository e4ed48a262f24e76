"""The folder of sharded checkpoints: its layout, the commit, listing, readers' leases and ``keep=N`` pruning.

Runs in: the rank process (and one process exporting or inspecting a checkpoint).

In a job's checkpoint folder (``<checkpoint_dir>/<run_id>``, as the whole checkpoints of
:mod:`dask_ddp.checkpoint.whole`), sharded checkpoints live under ``sharded/``::

    sharded/step-000000100-1a2b3c4d/             one save attempt of step 100 (8 random hex digits)
        9f3e-rank-00000-000.distcp ...           shards: raw tensor bytes, hash prefix first (S3 partitions)
        .metadata                                torch DCP's Metadata (torch.save; loaded weights_only)
        manifest.json                            each file's size and CRC-32, world size, bytes, time
    sharded/step-000000100-1a2b3c4d.commit       the commit marker: written last, by one rank
    sharded/step-000000100-1a2b3c4d.lease-1764093000-77aa   a reader's lease (keep=N pruning skips the step)

A step counts only once its marker exists, and the marker is written only
after every rank's files came back verified and the coordinator saw each of
them on the store with the size recorded, then ``.metadata`` and the manifest
were written. One listing of ``sharded/`` finds every committed step. A crash
at any point leaves an attempt folder without a marker: never read, and
removed by a later pruning once older than the kept steps.

A marker proves nothing on its own (whoever can write the folder can write
one, and a folder deleted by hand leaves its marker behind): :func:`choose`,
which picks the step a load reads, checks that the marker names its own step
and folder and that the folder's ``.metadata`` reads (``weights_only=True``,
its items' files inside the folder). A step that does not check out is skipped
with a warning naming it and why, and the newest one that does is loaded; an
explicit ``step=`` that does not check out raises.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
from typing import NamedTuple

from dask_ddp import storage
from dask_ddp.checkpoint.folder import Where, atomic_write
from dask_ddp.checkpoint.sharded import writer as dcp_storage
from dask_ddp.checkpoint.whole import CheckpointError

__all__ = ["Step", "committed", "candidates", "choose", "verify", "commit", "read_metadata", "prune", "lease",
           "SUBFOLDER", "LEASE_TTL"]

logger = logging.getLogger(__name__)

SUBFOLDER = "sharded"
LEASE_TTL = 6 * 3600  # seconds after which a reader's lease is taken for a crash leftover
_ENTRY = re.compile(r"^step-(\d{9,})-([0-9a-f]{8})(\.commit|\.lease-(\d+)-[0-9a-f]+)?$")
_SHARD = re.compile(r"^[0-9a-f]{4}-rank-\d{5,}-\d{3,}\.distcp$")  # dcp_storage.file_name: never a path


class Step(NamedTuple):
    """A committed step: its number, its attempt folder's name and the folder's URL."""
    step: int
    folder: str
    url: str


def base(where: Where) -> tuple[str, str]:
    """(path, URL) of the ``sharded/`` folder of ``where``."""
    return f"{where.root}/{SUBFOLDER}", f"{where.url}/{SUBFOLDER}"


def _listing(where: Where) -> list[str]:
    path, url = base(where)

    def ls():
        where.fs.invalidate_cache(path)  # s3fs caches listings; other ranks and jobs change them
        try:
            return where.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []

    found = retried(where, ls, "listing it")
    return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in found]


def retried(where: Where, fn, doing: str, name: str = ""):
    """:func:`where_call` again after throttling (503, SlowDown) with backoff; a store still throttling after the
    retries (its client's and ours) raises ShardError naming the rank and the URL."""
    try:
        return dcp_storage.with_retries(lambda: where_call(where, fn, doing, name))
    except Exception as exc:  # noqa: BLE001 - named when throttled, else re-raised
        if not dcp_storage.throttled(exc):
            raise
        url = f"{where.raw}/{SUBFOLDER}" + (f"/{name}" if name else "")
        raise dcp_storage.named(exc, _rank(), url, doing.removesuffix(" it"), where.options) from None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def where_call(where: Where, fn, doing: str, name: str = ""):
    """``fn()`` with backend errors as PermissionError / FileNotFoundError naming the URL, never a secret."""
    from dask_ddp import storage

    url = f"{where.raw}/{SUBFOLDER}" + (f"/{name}" if name else "")
    return storage.call(fn, url, doing=doing, storage_options=where.options)


def committed(where: Where, names: list[str] | None = None) -> dict[int, Step]:
    """The committed steps of ``where`` (newest attempt per step), by step number."""
    out: dict[int, Step] = {}
    _, url = base(where)
    for m in map(_ENTRY.match, _listing(where) if names is None else names):
        if m and m[3] == ".commit":
            folder = m[0][: -len(".commit")]
            out[int(m[1])] = Step(int(m[1]), folder, f"{url}/{folder}")
    return dict(sorted(out.items()))


def candidates(where: Where) -> list[Step]:
    """Every step with a commit marker, newest first (several attempts of one step: each, by name)."""
    _, url = base(where)
    found = []
    for m in map(_ENTRY.match, _listing(where)):
        if m and m[3] == ".commit":
            folder = m[0][: -len(".commit")]
            found.append(Step(int(m[1]), folder, f"{url}/{folder}"))
    return sorted(found, reverse=True)


def verify(where: Where, found: Step):
    """The DCP Metadata of ``found`` (as :func:`read_metadata`) once its marker names its own step and folder.

    Raises
    ------
    CheckpointError
        The marker is unreadable or names another step or folder (forged, or not ours), or ``.metadata``
        is missing or unreadable (names the URL and why).
    """
    path, _ = base(where)
    try:
        raw = retried(where, lambda: where.fs.cat_file(f"{path}/{found.folder}.commit"), "reading it",
                      f"{found.folder}.commit")
        marker = json.loads(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{found.url}.commit was removed while it was read (pruned by another job, or by "
                              "hand): load another step=...", url=found.url) from None
    except ValueError as exc:
        marker = f"not JSON ({exc})"
    if not isinstance(marker, dict) or marker.get("step") != found.step or marker.get("folder") != found.folder:
        raise CheckpointError(f"the commit marker {found.url}.commit does not name its own step and folder (it holds "
                              f"{str(marker)[:120]!r}): it was forged or written by something else; delete it, or "
                              "load another step=...", url=found.url)
    return read_metadata(where, found)


def choose(where: Where, step: int | None, leases: contextlib.ExitStack):
    """``(Step, Metadata)`` of ``step`` (None: the newest step that checks out), with a reader's lease on it
    entered into ``leases``; None when no step checks out (or there is none) and ``step`` is None.

    A step that does not check out (:func:`verify`) is skipped with a warning naming it and why.

    Raises
    ------
    FileNotFoundError
        ``step`` has no commit marker (the message lists the committed steps).
    CheckpointError
        No attempt of ``step`` checks out (the last one's reason).
    """
    found = candidates(where)
    tried = [s for s in found if step is None or s.step == step]
    if step is not None and not tried:
        raise FileNotFoundError(f"no committed sharded step {step} in {base(where)[1]}; committed: "
                                f"{sorted({s.step for s in found}) or 'none'}")
    for i, candidate in enumerate(tried):
        held = contextlib.ExitStack()
        held.enter_context(lease(where, candidate))
        try:
            metadata = verify(where, candidate)
        except CheckpointError as exc:
            held.close()
            if step is not None and i == len(tried) - 1:
                raise
            logger.warning("dask-ddp: sharded step %d (%s) is skipped: it does not check out: %s; trying the next "
                           "newest committed step", candidate.step, candidate.url, exc)
            continue
        leases.enter_context(held)
        return candidate, metadata
    return None


def _put(where: Where, path: str, data: bytes, point: str) -> None:
    dcp_storage.fault(point, path=path)
    if storage.is_local(where.fs):

        atomic_write(path, data)
    else:
        retried(where, lambda: where.fs.pipe_file(path, data), "writing it", path.rsplit(f"/{SUBFOLDER}/", 1)[-1])


def commit(where: Where, step: int, folder: str, metadata, files: dict, world_size: int) -> None:
    """Verify every file of ``folder``, write ``.metadata``, ``manifest.json``, then the commit marker.

    Raises
    ------
    ShardError
        A file is missing or holds another size than its rank wrote (the step stays uncommitted).
    """
    import torch

    path, url = base(where)
    folder_path = f"{path}/{folder}"
    dcp_storage.fault("commit-verify", folder=folder)
    where.fs.invalidate_cache(folder_path)
    listed = {str(e["name"]).rsplit("/", 1)[-1]: e.get("size")
              for e in retried(where, lambda: where.fs.ls(folder_path, detail=True), "listing it", folder)}
    for name, record in sorted(files.items()):
        if listed.get(name) != record["bytes"]:
            raise dcp_storage.ShardError(
                f"rank {record['rank']}: {url}/{folder}/{name} holds {listed.get(name)} bytes on the store, the rank "
                f"wrote {record['bytes']}: the store lost data; step {step} is not committed (the previous one "
                "stays the latest): check the store and save again")
    encoded = _encode(metadata)
    torch.save(encoded, buffer := io.BytesIO())
    _put(where, f"{folder_path}/.metadata", buffer.getvalue(), "metadata")
    manifest = {"format": 1, "step": step, "folder": folder, "world_size": world_size, "run_id": where.run_id,
                "bytes": sum(r["bytes"] for r in files.values()), "time": time.time(),
                "files": {n: {"bytes": r["bytes"], "crc32": r["crc32"], "rank": r["rank"]}
                          for n, r in sorted(files.items())}}
    _put(where, f"{folder_path}/manifest.json", json.dumps(manifest).encode(), "manifest")
    _put(where, f"{path}/{folder}.commit", json.dumps({"step": step, "folder": folder}).encode(), "marker")
    dcp_storage.fault("committed", folder=folder)


def _encode(metadata):
    """A copy of DCP's Metadata whose storage data are plain tuples (torch.load(weights_only=True) reads it)."""
    import dataclasses

    plain = {index: tuple(dataclasses.astuple(item)) for index, item in metadata.storage_data.items()}
    return dataclasses.replace(metadata, storage_data=plain, storage_meta=None)


def read_metadata(where: Where, found: Step):
    """The DCP Metadata of a committed step, storage data as :class:`dcp_storage.Item`.

    Raises
    ------
    CheckpointError
        ``.metadata`` is missing or cannot be read (names the URL and what to do).
    """
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    path, _ = base(where)
    name = f"{path}/{found.folder}/.metadata"
    try:
        data = retried(where, lambda: storage.read_whole(where.fs, name), "reading it", f"{found.folder}/.metadata")
        with torch.serialization.safe_globals(_safe_types()):
            metadata = torch.load(io.BytesIO(data), weights_only=True)
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        metadata.storage_data = {index: dcp_storage.Item(file, offset, length, dtype, tuple(shape), crc) for index,
                                 (file, offset, length, dtype, shape, crc) in metadata.storage_data.items()}
        outside = sorted({str(it.file)[:80] for it in metadata.storage_data.values()
                          if not _SHARD.match(str(it.file))})
        if outside:
            raise ValueError(f"its items name files that are not shards of the folder: {outside[:3]}")
    except FileNotFoundError:
        raise CheckpointError(f"{found.url}/.metadata is missing although step {found.step} is committed: it was "
                              "deleted (by hand, or pruning by another job); load another step=...",
                              url=found.url) from None
    except Exception as exc:  # noqa: BLE001 - named and re-raised
        if isinstance(exc, PermissionError):
            raise
        raise CheckpointError(f"cannot read {found.url}/.metadata: {type(exc).__name__}: {str(exc)[:300]}; it is "
                              "corrupt or not a dask-ddp sharded checkpoint: load another step=...",
                              url=found.url) from None
    return metadata


def _safe_types() -> list:
    from torch.distributed.checkpoint import metadata as m

    return [m.Metadata, m.MetadataIndex, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata,
            m.TensorProperties, m.StorageMeta, m._MEM_FORMAT_ENCODING]


@contextlib.contextmanager
def lease(where: Where, found: Step):
    """Hold a reader's lease on ``found`` while the block runs: pruning by any job skips the step."""
    path, _ = base(where)
    name = f"{path}/{found.folder}.lease-{int(time.time())}-{os.urandom(2).hex()}"
    _put(where, name, b"", "lease")
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            where.fs.rm_file(name)


def prune(where: Where, keep: int, written: int) -> list[int]:
    """Remove committed steps older than the newest ``keep`` (never ``written``, never a leased one) and older
    uncommitted attempts; return the steps removed. Markers go first: a step stops counting before its files go."""
    names = _listing(where)
    steps = committed(where, names)
    if len(steps) <= keep:
        return []
    cutoff = sorted(steps)[-keep]
    now = time.time()
    leased = {int(m[1]) for m in map(_ENTRY.match, names) if m and m[4] and now - int(m[4]) < LEASE_TTL}
    doomed = {s for s in steps if s < cutoff and s != written and s not in leased}
    path, _ = base(where)
    for step in sorted(doomed):
        with contextlib.suppress(FileNotFoundError):
            where.fs.rm_file(f"{path}/{steps[step].folder}.commit")
    kept = {s.folder for n, s in steps.items() if n not in doomed}
    for m in map(_ENTRY.match, names):  # the doomed steps' folders, and older attempts never committed
        if m and not m[3] and m[0] not in kept and int(m[1]) < cutoff and int(m[1]) != written \
                and int(m[1]) not in leased:
            with contextlib.suppress(FileNotFoundError):
                where.fs.rm(f"{path}/{m[0]}", recursive=True)
    return sorted(doomed)
