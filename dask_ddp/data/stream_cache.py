"""A node-local cache of whole shards, bounded in bytes, shared by every process of a host, leaving nothing behind.

Runs in: the rank process and its DataLoader workers.

Files are content-addressed (a hash of the shard's URL, size and CRC-32), so two jobs or users reading
the same shard share one file and different shards never collide. A file is written unnamed
(``O_TMPFILE``) and linked into place once complete: a process killed mid-write leaves no temporary file,
because there is none to leave (where the filesystem lacks ``O_TMPFILE``, a ``.part-<pid>-...`` file is
used and removed on the next start when its process is gone). No lock file and no shared-memory segment
is ever made: while one process downloads a shard, the others of the host wait for its cache file, and that
claim is a Unix socket bound in Linux's abstract namespace, which the kernel removes when the process ends,
however it ends. Eviction removes the least recently used files beyond ``limit`` bytes; a reader holding a
file open keeps its bytes until it closes it. A cached shard is read as a read-only memory map: the processes
of a host that hold the same shard share its pages (the page cache) instead of each holding a copy.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import re
import socket
import time

__all__ = ["ShardCache", "map_file"]

logger = logging.getLogger("dask_ddp.data")
_PART = re.compile(r"^\.part-(\d+)-")


class ShardCache:
    """Whole shards on local disk under ``folder``, at most ``limit`` bytes in all (plus the shards being written)."""

    def __init__(self, folder: str | os.PathLike, limit: int) -> None:
        self.folder, self.limit = os.path.expanduser(os.fspath(folder)), int(limit)
        self.broken = False
        try:
            os.makedirs(self.folder, exist_ok=True)
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
        cached, or the cache is off); raises nothing."""
        if self.broken:
            return None
        path = os.path.join(self.folder, name)
        try:
            data = map_file(path)
            os.utime(path)  # recently used: evicted last
            return data
        except (OSError, ValueError):
            return None

    def claim(self, name: str) -> socket.socket | None:
        """Claim the download of ``name`` for this process (None: another process of the host has it).

        The claim is a Unix socket bound in Linux's abstract namespace (no file: the kernel drops it when its
        process exits, ``kill -9`` included); close it to release. Raises nothing (no claim possible: a socket).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        key = hashlib.sha256(f"{os.path.realpath(self.folder)}\0{name}".encode()).hexdigest()[:40]
        try:
            sock.bind(f"\0dask-ddp-shard-{key}")
            return sock
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE:
                return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # no abstract namespace: download anyway
            return None

    def wait_for(self, name: str, timeout: float = 120.0) -> tuple[bytes | mmap.mmap | None, socket.socket | None]:
        """The bytes another process is downloading (once cached), or a claim to download them here.

        Returns ``(data, None)`` or ``(None, claim)``: the other process finished, died or took longer than
        ``timeout`` s. Raises nothing.
        """
        deadline, delay = time.monotonic() + timeout, 0.005
        while True:
            if (data := self.get(name)) is not None:
                return data, None
            if (claim := self.claim(name)) is not None or time.monotonic() > deadline:
                return None, claim or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            time.sleep(delay)
            delay = min(0.1, delay * 1.5)

    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` under ``name`` (complete or not at all), then evict beyond the limit; raises nothing."""
        if self.broken or len(data) > self.limit:
            return
        try:
            self._write(os.path.join(self.folder, name), data)
            self._evict()
        except OSError as err:
            self._switch_off(err)

    def _write(self, path: str, data: bytes) -> None:
        try:
            fd = os.open(self.folder, os.O_TMPFILE | os.O_WRONLY, 0o644)
        except (OSError, AttributeError):  # no O_TMPFILE here: a named part file, cleaned up by the next start
            part = os.path.join(self.folder, f".part-{os.getpid()}-{os.urandom(4).hex()}")
            try:
                with open(part, "xb") as f:
                    f.write(data)
                os.replace(part, path)
            finally:
                if os.path.exists(part):
                    os.unlink(part)
            return
        try:
            _write_all(fd, data)
            folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
            try:  # dst_dir_fd: CPython then calls linkat(..., AT_SYMLINK_FOLLOW), which links the unnamed file
                os.link(f"/proc/self/fd/{fd}", os.path.basename(path), dst_dir_fd=folder, follow_symlinks=True)
            except FileExistsError:
                pass  # another process cached the same shard: same content
            finally:
                os.close(folder)
        finally:
            os.close(fd)

    def _evict(self) -> None:
        entries = []
        with os.scandir(self.folder) as it:
            for e in it:
                if e.name.endswith(".tar"):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    entries.append((st.st_mtime, st.st_size, e.path))
        total = sum(s for _, s, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size

    def _remove_orphans(self) -> None:
        """Remove ``.part-<pid>-`` files whose process is gone (only where O_TMPFILE is missing)."""
        for name in os.listdir(self.folder):
            m = _PART.match(name)
            if m and not _alive(int(m[1])):
                try:
                    os.unlink(os.path.join(self.folder, name))
                except OSError:
                    pass

    def _switch_off(self, err: OSError) -> None:
        self.broken = True
        logger.warning("the shard cache in %s is off for this process (%s: %s): reading from the store instead",
                       self.folder, type(err).__name__, err)

    def __repr__(self) -> str:
        return f"ShardCache({self.folder!r}, limit={self.limit})"


def map_file(path: str) -> bytes | mmap.mmap:
    """The file at ``path`` mapped read-only (its pages shared with every process that maps it; ``b""`` when it is
    empty: an empty file cannot be mapped). Raises OSError (no such file, ...)."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM
    return True
