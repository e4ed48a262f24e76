"""A node-local cache of whole shards, bounded in bytes, private to one user, shared by that user's processes
of a host, leaving nothing behind.

Runs in: the rank process and its DataLoader workers.

The shards live in ``<cache_dir>/dask-ddp-<uid>`` (a :mod:`dask_ddp.storage.private`: ``0700``, files ``0600``, refused
when another user made it or could write it; every file used is opened without following links and checked
through its own descriptor), so a private bucket's shards are readable by their user alone, and no other
local user can plant a file there: a shard's size and CRC-32 (forgeable in 4 bytes) are checked against the
index, but only for files this user wrote. Two users of a host keep a copy each; no file is shared across
users. Files are content-addressed (a hash of the shard's URL, size and CRC-32), so two jobs of a user reading
the same shard share one file and different shards never collide. A file is written unnamed (``O_TMPFILE``)
and linked into place once complete: a process killed mid-write leaves no temporary file, because there is
none to leave (where the filesystem lacks ``O_TMPFILE``, a ``.part-<pid>-...`` file is used and removed on the
next start when its process is gone). While one process downloads a shard, the others of the host wait for
its cache file; that claim is an open-file-description lock on a byte of ``.claims`` (one empty file in the
private folder, which no other user can open), which the kernel drops when its process ends, however it
ends. Eviction removes the least recently used files beyond ``limit`` bytes, one thread or process at a time
(a lock on another byte of ``.claims``); a reader holding a file open keeps its bytes until it closes it. A
cached shard is read as a read-only memory map of the descriptor that was checked: the processes of a host
that hold the same shard share its pages (the page cache) instead of each holding a copy.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import struct
import time

from dask_ddp.storage.private import PrivateFolder, mapped, others_can_write

__all__ = ["ShardCache", "Claim", "map_file"]

logger = logging.getLogger("dask_ddp.data")
_PART = re.compile(r"^\.part-(\d+)-")
CLAIMS = ".claims"
_EVICTING = 1 << 50  # the byte of .claims that eviction locks: beyond every claim's (48-bit offsets)


class Claim:
    """The download of one shard, held by this process until :meth:`close` (or its end); ``fd`` None: no
    claim could be taken (no lock on this filesystem), the shard is downloaded anyway."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = fd

    def close(self) -> None:
        """Release the claim; raises nothing."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ShardCache:
    """Whole shards on local disk in this user's private folder under ``folder``, at most ``limit`` bytes in all
    (plus the shards being written). ``folder`` is the private folder's path (``<cache_dir>/dask-ddp-<uid>``)."""

    def __init__(self, folder: str | os.PathLike, limit: int) -> None:
        self.home = PrivateFolder(folder)
        self.folder, self.limit = self.home.path, int(limit)
        self.broken = False
        try:
            self.home.fd()
            self._remove_orphans()
            self._evict()  # a process killed between its write and its eviction may have left it over the limit
        except OSError as err:
            self._switch_off(err)

    @staticmethod
    def name(url: str, size: int, crc: int) -> str:
        """The cache file's name for a shard: a hash of its URL, size and CRC-32; raises nothing."""
        return hashlib.sha256(f"{url}\0{size}\0{crc}".encode()).hexdigest()[:40] + ".tar"

    def get(self, name: str) -> bytes | mmap.mmap | None:
        """The cached shard as a read-only memory map (pages shared by the host's processes), or None (not
        cached, refused, or the cache is off); raises nothing."""
        if self.broken:
            return None
        try:
            fd = self.home.open(name)  # this user's regular file that no one else can write, or None
            if fd is None:
                return None
            try:
                os.utime(fd)  # recently used: evicted last
                return mapped(fd)  # the descriptor checked: a file swapped in since changes nothing
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return None

    def claim(self, name: str) -> Claim | None:
        """Claim the download of ``name`` for this process (None: another process of this user has it).

        The claim is an open-file-description lock on one byte of ``.claims`` in the private folder (no other
        user can open it, so none can take a claim; the kernel drops it when its process exits, ``kill -9``
        included); close it to release. Raises nothing (no claim possible: a :class:`Claim` to download anyway).
        """
        if self.broken:
            return Claim()
        at = int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big")
        try:
            fd = os.open(CLAIMS, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.home.fd())
        except OSError:
            return Claim()
        try:
            _lock(fd, at)
            return Claim(fd)
        except OSError as err:
            os.close(fd)
            return None if err.errno in (errno.EAGAIN, errno.EACCES) else Claim()
        except AttributeError:  # no OFD locks here
            os.close(fd)
            return Claim()

    def wait_for(self, name: str, timeout: float = 120.0) -> tuple[bytes | mmap.mmap | None, Claim | None]:
        """The bytes another process is downloading (once cached), or a claim to download them here.

        Returns ``(data, None)`` or ``(None, claim)``: the other process finished, died or took longer than
        ``timeout`` s. Raises nothing.
        """
        deadline, delay = time.monotonic() + timeout, 0.005
        while True:
            if (data := self.get(name)) is not None:
                return data, None
            if (claim := self.claim(name)) is not None or time.monotonic() > deadline:
                return None, claim or Claim()
            time.sleep(delay)
            delay = min(0.1, delay * 1.5)

    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` under ``name`` (complete or not at all), then evict beyond the limit; raises nothing."""
        if self.broken or len(data) > self.limit:
            return
        try:
            self.home.write(name, data)
            self._evict()
        except OSError as err:
            self._switch_off(err)

    def _evict(self) -> None:
        """Remove the least recently used files beyond the limit, one thread or process of the host at a time:
        two that listed the folder together would each remove files for the same excess."""
        try:
            fd = os.open(CLAIMS, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.home.fd())
        except OSError:
            fd = None
        try:
            deadline, delay = time.monotonic() + 10, 0.001
            while fd is not None:  # one stopped (SIGSTOP) while it holds the lock holds the others 10 s at most
                try:
                    _lock(fd, _EVICTING)  # released by the close below, or by the kernel at our end
                    break
                except OSError as err:
                    if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        break  # evict unserialized
                except AttributeError:  # no OFD locks here
                    break
                time.sleep(delay)
                delay = min(0.05, delay * 2)
            self._evict_locked()
        finally:
            if fd is not None:
                os.close(fd)

    def _evict_locked(self) -> None:
        entries = [(st.st_mtime, st.st_size, name) for name, st in self.home.entries()
                   if st is not None and name.endswith(".tar")]
        total = sum(s for _, s, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.limit:
                break
            self.home.unlink(name)
            total -= size

    def _remove_orphans(self) -> None:
        """Remove ``.part-<pid>-`` files whose process is gone (only where O_TMPFILE is missing)."""
        for name, _ in self.home.entries():
            m = _PART.match(name)
            if m and not _alive(int(m[1])):
                try:
                    self.home.unlink(name)
                except OSError:
                    pass

    def _switch_off(self, err: OSError) -> None:
        self.broken = True
        logger.warning("the shard cache in %s is off for this process (%s: %s): reading from the store instead",
                       self.folder, type(err).__name__, err)

    def __repr__(self) -> str:
        return f"ShardCache({self.folder!r}, limit={self.limit})"


def map_file(path: str) -> bytes | mmap.mmap:
    """The file at ``path`` (a local shard, where it is) mapped read-only, its pages shared with every process
    that maps it (``b""`` when it is empty: an empty file cannot be mapped). A file that another user can
    write (group- or world-writable, or owned by another user than this one and root) is read into memory
    instead: its bytes could change under a map after they were checked. Raises OSError (no such file, ...).
    """
    with open(path, "rb") as f:
        if others_can_write(os.fstat(f.fileno())):
            return f.read()
        return mapped(f.fileno())


def _lock(fd: int, at: int) -> None:
    """An open-file-description write lock on byte ``at`` of ``fd``, not waited for. Raises OSError (EAGAIN or
    EACCES: another open file description holds it), AttributeError (no OFD locks on this platform)."""
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, at, 1, 0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM
    return True
