"""The optional on-disk cache of ``S3ImageFolder(cache=...)``: object bytes by URL in a local folder.

Runs in: the rank process and its DataLoader workers (each reads and writes
the same folder; writes are atomic, so they never see half a file).

A cache is a speed-up, never a reason for a sample to fail: when the folder
cannot be used (read-only, a file in the way, disk full), the first failure is
logged once, with the folder and the error, and the cache switches itself off
for that dataset (in that process); samples keep coming from the store.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import uuid

__all__ = ["BlobCache"]

logger = logging.getLogger(__name__)


class BlobCache:
    """Bytes by URL under ``folder/<sha256[:2]>/<sha256[2:]>``; objects are assumed not to change.

    Attributes
    ----------
    folder : str
    error : OSError or None
        What switched the cache off, or None while it is on.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.error: OSError | None = None

    def path(self, url: str) -> str:
        """Where ``url``'s bytes are cached (no I/O)."""
        digest = hashlib.sha256(url.encode()).hexdigest()
        return os.path.join(self.folder, digest[:2], digest[2:])

    def get(self, url: str) -> bytes | None:
        """The cached bytes of ``url``, or None (not cached, or the cache is off). Raises nothing."""
        if self.error is not None:
            return None
        try:
            with open(self.path(url), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as err:  # e.g. a file where the folder should be: the cache cannot work
            self._switch_off(err)
            return None

    def put(self, url: str, blob: bytes) -> None:
        """Store ``blob`` for ``url`` (temp file + ``os.replace``). Raises nothing: a failure switches the cache off."""
        if self.error is not None:
            return
        path = self.path(url)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: readers see the old state or the whole file
        except OSError as err:
            self._switch_off(err)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)  # left only by a failed write

    def _switch_off(self, err: OSError) -> None:
        self.error = err
        logger.warning("S3ImageFolder cache %s cannot be used (%s: %s); caching is off for this dataset, "
                       "samples are read from the store", self.folder, type(err).__name__, err)
