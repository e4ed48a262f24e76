"""The folder a checkpoint call writes to or reads from: where it is, the job's default, atomic writes.

Runs in: the rank process (and the client, given ``directory=``).

The one seam under whole checkpoints (:mod:`.whole`) and sharded ones (:mod:`.sharded`): :func:`where` turns
a ``directory=`` (or, inside a rank, the job's own folder, :func:`job_folder`) into a :class:`Where`: the
filesystem, its root, the URL as shown in messages, and the rank. :func:`call` runs a backend operation with
errors a user acts on (never a secret), :func:`put` writes one object whole (:func:`atomic_write` on local
disk), and :func:`check_int` is the check every public call makes of ``step=`` and ``keep=``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, Callable, NamedTuple

from dask_ddp import storage
from dask_ddp.wire.errors import NotInRankError

__all__ = ["Where", "where", "set_job", "job_folder", "call", "put", "atomic_write", "check_int"]

_JOB: Any = None  # the rank's Context in a rank process (set by dask_ddp.rank.context): its job's folder, rank, world


def set_job(ctx: Any) -> None:
    """The job this process is a rank of (its ``Context``: ``rank``, ``world_size``, ``run_id``,
    ``checkpoint_dir``, ``checkpoint_options``), or None; the rank wing calls it, as the checkpoint wing imports no
    rank code. Raises nothing."""
    global _JOB
    _JOB = ctx


class Where(NamedTuple):
    """Where a checkpoint call reads and writes: the filesystem and its root, the URL for messages, the rank."""

    fs: Any  # an fsspec filesystem
    root: str  # path inside fs, no trailing slash
    url: str  # the directory as the user wrote it, userinfo removed, no trailing slash
    rank: int
    world_size: int
    raw: str  # the directory as the user wrote it, userinfo and all: redacted in messages
    options: dict  # the storage options, redacted in messages
    run_id: str | None  # the job's, inside a rank

    def path(self, name: str) -> str:
        """The path of ``name`` in this folder, for the filesystem."""
        return f"{self.root}/{name}"

    def url_of(self, name: str) -> str:
        """The URL of ``name`` in this folder, for messages (no userinfo)."""
        return f"{self.url}/{name}"


def where(directory: Any, storage_options: Any) -> Where:
    """The folder of a checkpoint call: ``directory`` as given, or inside a rank the job's own folder.

    Raises NotInRankError without ``directory`` outside a rank, ValueError inside a job started without
    ``checkpoint_dir``, and what :func:`dask_ddp.storage.resolve` raises for a bad URL or options.
    """
    ctx = _JOB
    if directory is None:
        if ctx is None:
            raise NotInRankError("no checkpoint directory: pass directory=... (any fsspec URL), or call "
                                 "this inside a dask-ddp rank started with run(..., checkpoint_dir=...)")
        if ctx.checkpoint_dir is None:
            raise ValueError("no checkpoint directory: this job was started without "
                             "run(..., checkpoint_dir=...); pass directory=... to this call")
        directory = job_folder(ctx.checkpoint_dir, ctx.run_id)
    directory = os.fspath(directory)
    if storage_options is None:
        storage_options = (ctx.checkpoint_options if ctx is not None else None) or {}
    fs, root = storage.resolve(directory, storage_options)
    rank, world = (ctx.rank, ctx.world_size) if ctx is not None else (0, 1)
    return Where(fs, root.rstrip("/"), storage.without_userinfo(directory).rstrip("/"), rank, world,
                  directory.rstrip("/"), dict(storage_options), ctx.run_id if ctx is not None else None)


def job_folder(checkpoint_dir: str, run_id: str) -> str:
    """The folder of one job's checkpoints: ``<checkpoint_dir>/<run_id>`` (run ids never repeat)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    return f"{checkpoint_dir if checkpoint_dir.endswith('/') else checkpoint_dir + '/'}{run_id}"


def call(where: Where, fn: Callable[[], Any], name: str = "", doing: str = "reading it") -> Any:
    """``fn()`` with backend errors as PermissionError / FileNotFoundError naming the URL, never a secret."""
    url = f"{where.raw}/{name}" if name else where.raw
    return storage.call(fn, url, doing=doing, storage_options=where.options)


def put(where: Where, name: str, data: bytes) -> None:
    """Write ``name`` whole: a local file atomically, an object in one PUT. Raises as :func:`call`."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(where.fs, LocalFileSystem):
        call(where, lambda: atomic_write(where.path(name), data), name, "writing it")
    else:  # one PUT (or multipart upload): the object appears whole or not at all
        call(where, lambda: where.fs.pipe_file(where.path(name), data), name, "writing it")


def atomic_write(path: str, data: bytes) -> None:
    """Write a local file atomically: a temporary name in the same folder, fsync, ``os.replace``, fsync of the
    folder. Raises OSError (the temporary file removed)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable (not possible on every OS)
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def check_int(what: str, value: Any, low: int) -> None:
    """Raise TypeError unless ``value`` is an int (not a bool), ValueError if it is below ``low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{what} must be >= {low}, got {value}")
