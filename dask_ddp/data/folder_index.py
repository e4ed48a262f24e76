"""The one listing of a folder tree behind ``S3ImageFolder``: :class:`FolderIndex` and :func:`index_folder`.

Runs in: the rank process (or wherever the dataset is built), once per job:
the index travels inside the pickled dataset, so DataLoader workers and other
ranks never list again. It opens its filesystem through :func:`dask_ddp.storage.open_fs`, the one door to
a filesystem.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from fsspec.implementations.local import LocalFileSystem

from dask_ddp import storage

__all__ = ["FolderIndex", "index_folder", "normalize_root", "cat_many"]


@dataclass(frozen=True)
class FolderIndex:
    """The one listing of a folder tree: everything :class:`S3ImageFolder` needs, no I/O.

    Attributes
    ----------
    root : str
        The normalized root URL (no trailing ``/``), as in ``S3ImageFolder.root``.
    files : tuple of (str, int)
        ``(relative path, size in bytes)`` of every file under the root, in
        torchvision's walk order (by directory path, then file name).
    dirs : tuple of str
        Relative paths of every directory under the root, sorted.
    """

    root: str
    files: tuple[tuple[str, int], ...]
    dirs: tuple[str, ...]


def normalize_root(root: str | os.PathLike) -> str:
    """The root as ``S3ImageFolder.root`` shows it: ``~`` expanded for local paths, no trailing ``/``."""
    root = os.fspath(root)
    if "://" not in root:
        root = os.path.expanduser(root)
    stripped = root.rstrip("/")
    return stripped if stripped and not stripped.endswith(":") else root


def index_folder(root: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> FolderIndex:
    """List a folder tree once and return its :class:`FolderIndex` (reusable with ``S3ImageFolder(index=...)``).

    On S3 this is one ``ListObjectsV2`` request per 1,000 keys, whatever the depth.

    Parameters
    ----------
    root : str or os.PathLike
        Any fsspec URL (``s3://bucket/prefix``, ``memory://x``, ``file:///x``) or a local path.
    storage_options : mapping, optional
        Passed to the fsspec filesystem, as in :class:`S3ImageFolder`.

    Raises
    ------
    FileNotFoundError
        No such bucket, prefix or folder; the message names the URL.
    NotADirectoryError
        ``root`` is a file.
    PermissionError
        The credentials were refused or missing; the message names the URL, never the secret.
    """
    url, opts = normalize_root(root), dict(storage_options or {})
    fs, fs_root = storage.open_fs(url, opts)
    try:
        found = storage.call(lambda: _walk_local(fs_root) if isinstance(fs, LocalFileSystem) else
                             fs.find(fs_root, withdirs=True, detail=True), url, doing="listing it",
                             storage_options=opts)
    except (PermissionError, FileNotFoundError):
        raise
    except Exception as err:
        err.add_note(f"while listing {storage.redact(url, opts)}")
        raise
    prefix = fs_root if fs_root.endswith("/") else fs_root + "/"
    files, dirs = [], set()
    for name, info in found.items():
        if name.rstrip("/") == fs_root.rstrip("/"):
            if info["type"] != "directory" and not name.endswith("/"):
                raise NotADirectoryError(f"{storage.redact(url, opts)} is a file, not a folder of class folders")
            continue
        rel = name[len(prefix):] if name.startswith(prefix) else name
        if info["type"] == "directory" or name.endswith("/"):
            dirs.add(rel.rstrip("/"))
        else:
            files.append((rel, int(info.get("size") or 0)))
            parts = rel.split("/")[:-1]
            dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    if not found and not storage.call(lambda: fs.isdir(fs_root), url, storage_options=opts):
        raise FileNotFoundError(f"{storage.redact(url, opts)} does not exist (no such bucket, prefix or folder)")
    files.sort(key=lambda f: tuple(f[0].rpartition("/")[::2]))  # os.walk order: directory, then name
    return FolderIndex(url, tuple(files), tuple(sorted(dirs)))


def _walk_local(root: str) -> dict[str, dict]:
    """``fs.find(root, withdirs=True, detail=True)`` for a local folder, following symlinked folders as
    torchvision's ``os.walk(followlinks=True)`` does (fsspec's find does not descend into them)."""
    if not os.path.isdir(root):
        return {root: {"type": "file", "size": os.path.getsize(root)}} if os.path.exists(root) else {}
    found: dict[str, dict] = {root: {"type": "directory"}}
    for top, dirs, files in os.walk(root, followlinks=True):
        for d in dirs:
            found[f"{top.rstrip('/')}/{d}"] = {"type": "directory"}
        for f in files:
            path = f"{top.rstrip('/')}/{f}"
            try:
                size = os.path.getsize(path)
            except OSError:  # a broken link: listed, as by ImageFolder, and fails when loaded
                size = 0
            found[path] = {"type": "file", "size": size}
    return found


def cat_many(fs: Any, paths: list[str], chunk: int = 256) -> list:
    """The bytes of each path, or the exception its read raised, in order: concurrent GETs on an async
    filesystem (``chunk`` at a time), one GET each (:func:`dask_ddp.storage.one_get`), else one read after another.

    Not ``fs.cat``: it expands globs and silently drops keys with ``[``, ``*`` or ``?``. Raises nothing of its own.
    """
    if not getattr(fs, "async_impl", False):
        out: list = []
        for p in paths:
            try:
                out.append(fs.cat_file(p))
            except Exception as err:  # noqa: BLE001 - returned, as the async path does
                out.append(err)
        return out
    import asyncio

    from fsspec.asyn import sync

    kwargs = storage.one_get(fs.__class__)

    async def gather(part: list[str]) -> list:
        return await asyncio.gather(*(fs._cat_file(p, **kwargs) for p in part), return_exceptions=True)

    return [b for lo in range(0, len(paths), chunk) for b in sync(fs.loop, gather, paths[lo:lo + chunk])]
