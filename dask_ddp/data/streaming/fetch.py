"""Fetching shards: the node cache first, then one GET each, retried with backoff, checked, prefetched.

Runs in: the rank process and its DataLoader workers (one :class:`ShardFetcher` per process, made lazily).

A whole-shard GET is the fast path on object stores (moto serves one large object at ~470 MiB/s and
8 MiB ranged GETs at a tenth of that); the next shards a reader will need are fetched in a background
thread pool while it decodes the current ones. Every shard is checked against the index's size and CRC-32:
a truncated or corrupt one raises :class:`ShardDataError` naming it. A single sample read out of order
(``dataset[i]`` under a random sampler) is a ranged GET of its bytes instead (:meth:`ShardFetcher.get_range`),
unless its shard is already held.

Without a node cache, a shard fetched from a remote store is held in an anonymous temporary file (``spill``:
``O_TMPFILE`` in ``TMPDIR``, which has no name, so nothing is left after a crash or ``kill -9``) mapped
read-only: a process's window of shards (up to ``keep`` of them, 1 GiB at the default 128 MB) is then clean,
reclaimable page cache rather than the process's own memory; only the shards in flight are held in memory. A
shard in a local folder is mapped read-only where it is (no copy at all; the processes of a host reading it
share its pages), unless another user can write it (then it is read and spilled: a map would show bytes
changed after the check).
"""

from __future__ import annotations

import logging
import mmap
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

from dask_ddp import storage
from dask_ddp.data.streaming.cache import ShardCache, map_file
from dask_ddp.data.streaming.format import ShardDataError, crc32
from dask_ddp.storage import transient

__all__ = ["ShardFetcher", "TRANSIENT_CODES", "Blob"]

#: A shard's bytes: fetched (bytes) or from the node cache (a read-only memory map, sliced like bytes)
Blob = bytes | mmap.mmap

logger = logging.getLogger("dask_ddp.data")
#: the store's codes for "ask again later" (:data:`dask_ddp.storage.transient.TRANSIENT_CODES`, the one rule)
TRANSIENT_CODES = transient.TRANSIENT_CODES


class ShardFetcher:
    """The bytes of shard ``j`` of a dataset at ``root``: cached, retried, verified, with prefetch."""

    def __init__(self, root: str, names: tuple[str, ...], sizes: tuple[int, ...], crcs: tuple[int, ...],
                 storage_options: Mapping[str, Any], cache: ShardCache | None, retries: int = 5,
                 threads: int = 4, keep: int = 8, spill: bool | None = None) -> None:
        self.root, self.names, self.sizes, self.crcs = root, names, sizes, crcs
        self.fs, self.fs_root = storage.open_fs(root, storage_options)
        # None: spill what a remote store gives when there is no node cache; a local file is mapped where it is
        self.local = storage.is_local(self.fs)
        self.spill = (cache is None and not self.local) if spill is None else spill
        self.options, self.cache, self.retries, self.keep = dict(storage_options), cache, retries, keep
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="dask-ddp-shards")
        self.futures: OrderedDict[int, Future] = OrderedDict()
        self.lock = threading.Lock()
        self.bytes_read = 0  # from the store (not the cache)

    def url(self, j: int) -> str:
        return f"{self.root.rstrip('/')}/{self.names[j]}"

    def prefetch(self, shards: list[int]) -> None:
        """Start fetching ``shards`` in the background (those not already held or in flight); raises nothing."""
        with self.lock:
            for j in shards:
                if j not in self.futures:
                    self.futures[j] = self.pool.submit(self._load, j)
                self.futures.move_to_end(j)
            while len(self.futures) > max(self.keep, len(shards)):
                self.futures.popitem(last=False)  # the oldest: a later get() fetches it again

    def get(self, j: int) -> Blob:
        """Shard ``j``'s bytes.

        Raises ShardDataError (corrupt, truncated), FileNotFoundError, PermissionError, OSError (after retries).
        """
        with self.lock:
            fut = self.futures.get(j)
            if fut is None:
                fut = self.futures[j] = self.pool.submit(self._load, j)
            self.futures.move_to_end(j)
        try:
            return fut.result()
        except BaseException:
            with self.lock:
                self.futures.pop(j, None)  # not kept: the next get() tries again
            raise

    def get_range(self, j: int, offset: int, length: int) -> bytes:
        """``length`` bytes of shard ``j`` at ``offset``: a slice of the shard when this process holds it or the
        node cache has it, else one ranged GET (retried as whole shards are; not CRC-checked: a range is not).

        Raises ShardDataError (fewer bytes than the index says), FileNotFoundError, PermissionError, OSError.
        """
        with self.lock:
            fut = self.futures.get(j)
        if fut is not None and fut.done() and fut.exception() is None:
            return fut.result()[offset:offset + length]
        if self.cache and not self.cache.broken and self.cache.get(
                ShardCache.name(self.url(j), self.sizes[j], self.crcs[j])) is not None:
            return self.get(j)[offset:offset + length]  # checked once, then held for the shard's next samples
        blob = self._fetch(j, offset, offset + length)
        if len(blob) != length:
            raise ShardDataError(f"shard {self.url(j)} is truncated or changed: {len(blob)} bytes at offset {offset}, "
                                 f"the index says {length}; rebuild the dataset with write_shards", shard=self.url(j))
        return blob

    def drop(self, j: int) -> None:
        """Forget shard ``j`` (its bytes are freed once no one holds them); raises nothing."""
        with self.lock:
            self.futures.pop(j, None)

    def close(self) -> None:
        """Stop the prefetch threads (running fetches finish); raises nothing."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _load(self, j: int) -> Blob:
        if self.local and self.cache is None:
            return self._mapped(j)
        if not self.cache or self.cache.broken:
            fetched = self._checked(j)
            return _spilled(fetched) if self.spill and self.cache is None else fetched
        cache, name = self.cache, ShardCache.name(self.url(j), self.sizes[j], self.crcs[j])
        if (data := cache.get(name)) is not None and self._ok(j, data, raise_=False):
            return data
        claim = cache.claim(name)  # one process of the host downloads a shard; the others read the cache
        if claim is None:
            data, claim = cache.wait_for(name)
            if data is not None and self._ok(j, data, raise_=False):
                return data
        try:
            data = self._checked(j)
            cache.put(name, data)
        finally:
            if claim is not None:
                claim.close()
        return data

    def _mapped(self, j: int) -> Blob:
        """A local shard mapped read-only where it is, checked (size, CRC-32) as a fetched one; one that another
        user can write is read (and spilled) instead: its bytes could change under a map after the check."""
        path = f"{self.fs_root.rstrip('/')}/{self.names[j]}"
        data = storage.call(lambda: map_file(path), self.url(j), doing="reading the shard",
                            storage_options=self.options)
        self._ok(j, data, raise_=True)
        self.bytes_read += len(data)
        return _spilled(data) if isinstance(data, bytes) else data

    def _checked(self, j: int) -> bytes:
        data = self._fetch(j)
        self._ok(j, data, raise_=True)
        return data

    def _ok(self, j: int, data: Blob, raise_: bool) -> bool:
        size, crc = self.sizes[j], self.crcs[j]
        if size >= 0 and len(data) != size:
            problem = f"is truncated or changed: {len(data)} bytes, the index says {size}"
        elif crc >= 0 and crc32(data) != crc:
            problem = f"is corrupt: its CRC-32 differs from the index's ({crc32(data):08x} != {crc:08x})"
        else:
            return True
        if raise_:
            raise ShardDataError(f"shard {self.url(j)} {problem}; rebuild the dataset with write_shards (or re-copy "
                             "the shard), and check that the index and the shards come from the same build",
                             shard=self.url(j))
        return False

    def _fetch(self, j: int, start: int | None = None, end: int | None = None) -> bytes:
        url, path = self.url(j), f"{self.fs_root.rstrip('/')}/{self.names[j]}"
        calls = [0]

        def get() -> bytes:
            calls[0] += 1
            return storage.call(lambda: self.fs.cat_file(path, start=start, end=end), url,
                                doing="reading the shard", storage_options=self.options)

        def retry(attempt: int, delay: float, err: BaseException) -> None:
            logger.warning("retrying shard %s in %.2fs (attempt %d of %d): %s: %s", url, delay, attempt + 2,
                           self.retries + 1, type(err).__name__, err)

        try:  # a throttle or a network error: retried (dask_ddp.storage.transient); a missing object or a refusal not
            data = transient.retrying(get, tries=self.retries + 1, on_retry=retry)
        except (PermissionError, FileNotFoundError):
            raise
        except Exception as err:
            err.add_note(f"while reading shard {url} (attempt {calls[0]} of {self.retries + 1})")
            raise
        self.bytes_read += len(data)
        return data


def _spilled(data: bytes) -> Blob:
    """``data`` in an anonymous temporary file, mapped read-only (see the module's docstring); ``data`` itself
    where no temporary file can be written (a full or read-only ``TMPDIR``: logged once)."""
    global _SPILL_WARNED
    if not data:
        return data
    try:
        with tempfile.TemporaryFile(prefix="dask-ddp-shard-") as f:  # O_TMPFILE: never a name in TMPDIR
            f.write(data)
            f.flush()
            return mmap.mmap(f.fileno(), len(data), access=mmap.ACCESS_READ)  # the map outlives the descriptor
    except OSError as err:
        if not _SPILL_WARNED:
            _SPILL_WARNED = True
            logger.warning("dask-ddp: shards are held in memory: no temporary file in %s (%s)",
                           tempfile.gettempdir(), err)
        return data


_SPILL_WARNED = False
