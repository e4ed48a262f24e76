"""The optional on-disk cache of ``S3ImageFolder(cache=...)``: object bytes by URL in a private local folder.

Runs in: the rank process and its DataLoader workers (each reads and writes
the same folder; writes are atomic, so they never see half a file).

The objects live in ``<cache>/dask-ddp-<uid>`` (a :mod:`dask_ddp.storage.private`: ``0700``, files ``0600``), so a
private bucket's images are readable by their user alone, and a file is read only when it is a regular
file this user wrote there (another local user can plant none: a folder they made or could write is
refused). A cache is a speed-up, never a reason for a sample to fail: when the folder cannot be used
(read-only, a file in the way, disk full, made by another user), the first failure is logged once, with the
folder and the error, and the cache switches itself off for that dataset (in that process); samples keep
coming from the store.
"""

from __future__ import annotations

import hashlib
import logging
import os

from dask_ddp.storage.private import PrivateFolder

__all__ = ["BlobCache"]

logger = logging.getLogger(__name__)


class BlobCache:
    """Bytes by URL under ``folder/dask-ddp-<uid>/<sha256[:2]>/<sha256[2:]>``; objects are assumed not to change.

    Attributes
    ----------
    folder : str
        The folder given; the files are in this user's private folder under it (``home.path``).
    error : OSError or None
        What switched the cache off, or None while it is on.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.home = PrivateFolder(self.folder)
        self.error: OSError | None = None

    @staticmethod
    def name(url: str) -> str:
        """``url``'s file in the private folder, ``<sha256[:2]>/<sha256[2:]>`` (no I/O)."""
        digest = hashlib.sha256(url.encode()).hexdigest()
        return f"{digest[:2]}/{digest[2:]}"

    def path(self, url: str) -> str:
        """Where ``url``'s bytes are cached (no I/O)."""
        return os.path.join(self.home.path, *self.name(url).split("/"))

    def get(self, url: str) -> bytes | None:
        """The cached bytes of ``url``, or None (not cached, refused, or the cache is off). Raises nothing."""
        if self.error is not None:
            return None
        try:
            fd = self.home.open(self.name(url))  # this user's regular file that no one else can write, or None
            if fd is None:
                return None
            with open(fd, "rb") as f:  # the descriptor checked: a file swapped in since changes nothing
                return f.read()
        except OSError as err:  # e.g. a file where the folder should be, a folder of another user
            self._switch_off(err)
            return None

    def put(self, url: str, blob: bytes) -> None:
        """Store ``blob`` for ``url`` (written unnamed, then linked: complete or not at all). Raises nothing: a
        failure switches the cache off."""
        if self.error is not None:
            return
        try:
            self.home.write(self.name(url), blob)
        except OSError as err:
            self._switch_off(err)

    def _switch_off(self, err: OSError) -> None:
        self.error = err
        logger.warning("S3ImageFolder cache %s cannot be used (%s: %s); caching is off for this dataset, "
                       "samples are read from the store", self.folder, type(err).__name__, err)
