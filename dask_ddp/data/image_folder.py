"""``S3ImageFolder``: torchvision's ``ImageFolder`` over any fsspec URL (``s3://``, ``file://``, ``memory://``).

Runs in: the rank process and its DataLoader workers (built on the client or in a rank).

The bucket is listed once, at construction. The listing (a :class:`FolderIndex`)
and the samples derived from it travel inside the pickled dataset, so ranks and
DataLoader workers never list again. Each process opens its own filesystem
lazily (keyed by pid: s3fs instances are not fork-safe), so ``fork``, ``spawn``
and ``forkserver`` DataLoader workers all work. A DataLoader batch is fetched
with concurrent GETs (:meth:`S3ImageFolder.__getitems__`), optionally through a
local on-disk cache.
"""

from __future__ import annotations

import io
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import fsspec
from PIL import Image, UnidentifiedImageError
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import has_file_allowed_extension

from dask_ddp import storage
from dask_ddp.data.blob_cache import BlobCache
from dask_ddp.data.folder_index import (
    FolderIndex,
    cat_many,
    index_folder,
    normalize_root,
)
from dask_ddp.storage import transient

__all__ = ["S3ImageFolder", "FolderIndex", "ImageDecodeError", "index_folder", "pil_loader"]

logger = logging.getLogger(__name__)


class ImageDecodeError(UnidentifiedImageError):
    """An object's bytes could not be decoded by the loader; the message names its URL.

    A subclass of ``PIL.UnidentifiedImageError`` (itself an ``OSError``), so
    existing ``except OSError`` handlers keep working.
    """


def pil_loader(f: io.BufferedIOBase) -> Image.Image:
    """Decode an image from a binary file-like object with PIL, as RGB (torchvision's ``pil_loader``).

    Raises
    ------
    PIL.UnidentifiedImageError, OSError
        Not a (complete) image; :class:`S3ImageFolder` re-raises it as :class:`ImageDecodeError`.
    """
    return Image.open(f).convert("RGB")


def _file_loader(loader: Callable) -> Callable:
    """torchvision's own loaders ``open()`` a path: give their file-object twin instead (same result)."""
    from torchvision import get_image_backend
    from torchvision.datasets import folder

    if loader is folder.pil_loader or (loader is folder.default_loader and get_image_backend() == "PIL"):
        return pil_loader
    return loader


class _Options(dict):
    """``storage_options`` whose repr hides secret values (credentials live there)."""

    def __repr__(self) -> str:
        return repr(storage.masked(self))


class S3ImageFolder(ImageFolder):
    """torchvision's ``ImageFolder`` for ``root/<class>/**/<image>`` at any fsspec URL.

    Same semantics as ``torchvision.datasets.ImageFolder``: ``classes`` are the
    sorted immediate sub-folders of ``root`` (files directly under it are
    ignored), samples are ordered by class then by a sorted walk of the class
    tree (nested folders included), the extension check is case-insensitive,
    an empty class raises unless ``allow_empty``. ``samples``/``imgs`` hold
    ``(url, class_index)`` with the full URL (``s3://bucket/prefix/cat/1.png``;
    for a plain local root, the same paths ImageFolder gives); ``relpath(i)``
    gives ``cat/1.png``. It subclasses ImageFolder, so ``isinstance`` checks and
    ``find_classes``/``make_dataset`` overrides keep working.

    The root is listed once here; pickling ships the constructor arguments and
    the built index, never a filesystem or client, so DataLoader workers and
    other ranks do not list again (or list once with :func:`index_folder` and
    pass ``index=``). Each process opens its own filesystem on first use
    (fork-, spawn- and forkserver-safe).

    Parameters
    ----------
    root : str or os.PathLike
        ``s3://bucket/prefix``, ``file://...``, a local path, or any fsspec URL.
        (``memory://`` lives in one process: spawned workers see it empty.)
    transform, target_transform : callable, optional
        As in ImageFolder.
    loader : callable, optional
        Called with one binary file-like object (an ``io.BytesIO`` at offset 0
        whose ``.name`` is the sample URL); returns the sample. **Not a path**,
        unlike ImageFolder's. Default: :func:`pil_loader` (PIL, ``.convert("RGB")``);
        torchvision's ``pil_loader`` and ``default_loader`` (PIL backend) are
        accepted too and replaced by it (they would ``open()`` the URL).
    is_valid_file : callable, optional
        Called with the sample URL; replaces the extension filter, as in ImageFolder.
    allow_empty : bool
        Accept class folders without any valid file.
    storage_options : mapping, optional
        fsspec options (``anon``, ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``).
        They are pickled with the dataset (workers need them) but never shown in
        reprs or errors; prefer environment or instance credentials. For ``s3``,
        ``config_kwargs["max_pool_connections"]`` defaults to 64.
    index : FolderIndex, optional
        A listing made earlier (``index_folder(root)`` or ``other.index``): no listing is done.
    cache : str or os.PathLike, optional
        Local folder: each object is written on first read, complete or not at
        all, into this user's private folder ``<cache>/dask-ddp-<uid>`` (``0700``,
        files ``0600``: another local user can neither read nor plant a file;
        the folder may be shared by users) and read from there afterwards. Keyed
        by URL: objects are assumed not to change while cached; clear the folder
        when they do. A folder that cannot be used (read-only, a file in the way,
        disk full, made by another user) is logged once and caching is switched
        off; samples still load.
    retries : int
        Extra attempts for a transient (network, 5xx) fetch error, with exponential backoff.

    Raises
    ------
    FileNotFoundError
        No such bucket, prefix or folder; no class folder; a class without valid file.
    NotADirectoryError
        ``root`` is a file.
    PermissionError
        The credentials were refused; the message names the URL, never the secret.
    ValueError
        ``index`` was built for another root, or ``retries`` is negative.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        loader: Callable[[io.BytesIO], Any] = pil_loader,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        storage_options: Mapping[str, Any] | None = None,
        index: FolderIndex | None = None,
        cache: str | os.PathLike | None = None,
        retries: int = 3,
    ) -> None:
        if int(retries) < 0:
            raise ValueError(f"retries must be 0 or more, got {retries}")
        # s3://KEY:SECRET@bucket/x reads with those credentials; the root and samples show s3://bucket/x
        url, options = storage.split_userinfo(normalize_root(root), storage_options)
        self.storage_options = _Options(options)
        if index is None:
            index = index_folder(url, self.storage_options)
        elif storage.without_userinfo(index.root) != url:
            raise ValueError(f"index was built for {index.root}, not {url}; list it with index_folder({url!r})")
        self.index = index
        self.cache = os.fspath(cache) if cache is not None else None
        self._cache = BlobCache(self.cache) if self.cache is not None else None
        self.retries = int(retries)
        self._fs: Any = None  # this process's filesystem (see fs)
        self._fs_pid: int | None = None
        self._base = url if url.endswith("/") else url + "/"
        super().__init__(url, transform, target_transform, _file_loader(loader), is_valid_file, allow_empty)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        """Classes are the sorted immediate sub-folders of the root, from the index (no I/O).

        Raises
        ------
        FileNotFoundError
            The root has no sub-folder.
        """
        classes = sorted(d for d in self.index.dirs if "/" not in d)
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {self.index.root}.")
        return classes, {c: i for i, c in enumerate(classes)}

    def make_dataset(self, directory: str, class_to_idx: dict[str, int], extensions: tuple[str, ...] | None = None,
                     is_valid_file: Callable[[str], bool] | None = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:
        """``(url, class_index)`` samples from the index, exactly as torchvision's ``make_dataset`` orders them.

        Raises
        ------
        ValueError
            ``class_to_idx`` is empty, or both or neither of ``extensions`` and ``is_valid_file`` are given.
        FileNotFoundError
            A class has no valid file and ``allow_empty`` is False; the message names the classes.
        """
        if not class_to_idx:
            raise ValueError("'class_to_idx' must have at least one entry to collect any samples.")
        if (extensions is None) == (is_valid_file is None):
            raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
        valid = is_valid_file or (lambda p: has_file_allowed_extension(p, extensions))
        by_class: dict[str, list[str]] = {}
        for rel, _ in self.index.files:
            head, sep, _ = rel.partition("/")
            if sep:
                by_class.setdefault(head, []).append(rel)
        samples, empty = [], []
        for cls in sorted(class_to_idx):
            urls = (self._base + rel for rel in by_class.get(cls, ()))
            found = [(url, class_to_idx[cls]) for url in urls if valid(url)]
            samples += found
            empty += [] if found else [cls]
        if empty and not allow_empty:
            msg = f"Found no valid file for the classes {', '.join(empty)} in {self.index.root}. "
            if extensions is not None:
                msg += f"Supported extensions are: {', '.join(extensions)}"
            raise FileNotFoundError(msg)
        return samples

    def relpath(self, index: int) -> str:
        """The path of sample ``index`` relative to the root, e.g. ``"cat/sub/1.png"``.

        Raises
        ------
        ValueError
            The sample's path is not under the root (``samples`` was edited).
        """
        path = self.samples[index][0]
        if not path.startswith(self._base):
            raise ValueError(f"sample {index} ({path}) is not under {self.root}")
        return path[len(self._base):]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """This process's filesystem, opened on first use (a forked child opens its own)."""
        if self._fs is None or self._fs_pid != os.getpid():
            (self._fs, self._fs_root), self._fs_pid = storage.open_fs(self.root, self.storage_options), os.getpid()
        return self._fs

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_fs=None, _fs_pid=None)
        return state

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        """``(sample, target)``; raises as :meth:`__getitems__` does."""
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Any, Any]]:
        """Load a batch with concurrent GETs (DataLoader calls this with a batch's indices).

        Raises
        ------
        ImageDecodeError
            The loader raised ``OSError`` on an object (not an image, truncated); names the URL.
        FileNotFoundError, PermissionError
            An object vanished since the listing, or access was refused; names the URL.
        OSError
            A transient error (network, 5xx) persisted after ``retries`` retries; names the URL.
        """
        samples = [self.samples[i] for i in indices]
        blobs = self._fetch([path for path, _ in samples])
        return [self._item(path, target, blob) for (path, target), blob in zip(samples, blobs)]

    def _item(self, url: str, target: int, blob: bytes) -> tuple[Any, Any]:
        f = io.BytesIO(blob)
        f.name = url
        try:
            sample = self.loader(f)
        except OSError as err:
            raise ImageDecodeError(f"cannot load {url} as an image: {err}") from err
        except Exception as err:
            err.add_note(f"while loading {url}")
            raise
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def _fetch(self, urls: Sequence[str]) -> list[bytes]:
        unique = list(dict.fromkeys(urls))
        cache = self._cache
        got = {u: b for u in unique if (b := cache.get(u)) is not None} if cache else {}
        todo, attempt = [u for u in unique if u not in got], 0
        while todo:  # a fully cached batch never opens the filesystem
            failed = {}
            for url, result in zip(todo, self._cat(todo)):
                if not isinstance(result, BaseException):
                    got[url] = result
                    if cache:
                        cache.put(url, result)  # never raises: a cache that fails switches itself off
                elif attempt < self.retries and self._transient(result):
                    failed[url] = result
                else:
                    raise self._fetch_error(url, result, attempt + 1)
            if failed:
                delay = transient.backoff(attempt)
                url, err = next(iter(failed.items()))
                logger.warning("retrying %d object(s) in %.2fs (attempt %d of %d); %s: %s: %s", len(failed),
                               delay, attempt + 2, self.retries + 1, url, type(err).__name__, err)
                time.sleep(delay)
            todo, attempt = list(failed), attempt + 1
        return [got[u] for u in urls]

    def _cat(self, urls: Sequence[str]) -> list:
        """Bytes or the exception, per URL: one concurrent round for async filesystems (:func:`cat_many`)."""
        fs = self.fs
        return cat_many(fs, [self._fs_path(u) for u in urls], chunk=max(1, len(urls)))

    def _fs_path(self, url: str) -> str:
        if url.startswith(self._base):
            return self._fs_root.rstrip("/") + "/" + url[len(self._base):]
        return self.fs._strip_protocol(url)

    @staticmethod
    def _transient(err: BaseException) -> bool:
        """The one rule (:func:`dask_ddp.storage.transient.transient`); a GET is idempotent: any other OSError too."""
        return transient.transient(err, any_os_error=True)

    def _fetch_error(self, url: str, err: BaseException, attempts: int) -> BaseException:
        builtin = storage.translate(err, url, doing="reading it", storage_options=self.storage_options)
        if builtin is not None:  # not chained: the backend's text may show a secret
            return builtin
        if self._transient(err):
            wrapped = OSError(f"could not read {url} after {attempts} attempts: {type(err).__name__}: {err}")
            wrapped.__cause__ = err
            return wrapped
        err.add_note(f"while reading {url}")
        return err

    def extra_repr(self) -> str:
        return f"Classes: {len(self.classes)}" + (f"\nCache: {self.cache}" if self.cache else "")
